"""Operations: the metrics endpoint, systemd's notify protocol, NUMA placement, and
which endpoints peers off this host can reach."""
