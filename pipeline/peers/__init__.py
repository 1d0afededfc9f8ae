"""Libraries for the other side of the wire (gateways, prefill ranks), torch-free and
stage-free: the client, the receiver, routing among workers, CurveZMQ keys."""
