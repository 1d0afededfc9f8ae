"""No `failed` while a dead sender's bytes can still land (issue #24, item 3).

A SIGKILLed sender's TCP connections outlive it in the kernel (ipc/tcp_table.py): what
it had queued for a receiver that stalls its reads still lands once the receiver
resumes. If the receiver heard `failed` meanwhile and gave the buffers to a new room,
those late bytes land over the new room's rows, after its `success`. The receiver here
stalls its Mooncake reads (SIGSTOP of the process that owns its engine) while the sender
is killed in the middle of a large write, and resumes once the sender was restarted; a
receiver told `failed` reuses the same buffer for a new room at once.

Pipeline mode only: in-process, the sender's death is the worker's, and nobody is told.
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from ipc import tcp_table, wire
from ipc.rooms import RoomState
from pipeline.peers.client import Client, Item
from tests.helpers import expected_sim_rows, image, sim_config, start_worker
from tests.peers.test_delivery import BIG_GRID, WIDE, StalledReceiver, room_state, wait_for

pytestmark = pytest.mark.timeout(180)
ROWS, HIDDEN = 1024, 3584


def queued_for(rx: StalledReceiver) -> int:
    """Bytes orphaned connections may still deliver to the stalled receiver."""
    table = tcp_table.read_table()
    dest = tcp_table.destination(rx.session, table, tcp_table.port_groups(table))
    return dest.carried(tcp_table.orphaned(table))


def test_no_failed_while_a_dead_senders_bytes_can_land(shm_prefix, tmp_path):
    w = start_worker("pipeline", sim_config(shm_prefix, tmp_path, **WIDE))
    made = [w]
    try:
        client = Client(w.cfg.intake, shm_prefix)
        made.append(client)
        rx = StalledReceiver("stalled", w.cfg.bootstrap)
        made.append(rx)
        rx.alloc(1, 4, HIDDEN)  # the session opened: the big write stalls in its socket, not the handshake
        client.encode(1, "warm", [Item("image", *image(3, grid=(1, 4, 4)))])
        assert [st["state"] for st in rx.statuses(1)] == ["success"]

        rx.alloc(2, ROWS, HIDDEN)
        rx.stop()
        client.encode(2, "dies", [Item("image", *image(4, grid=BIG_GRID))])
        wait_for(lambda: room_state(w, 2) == RoomState.TRANSFERRING and
                 any(s.tx_queue > 1 << 20 for s in tcp_table.read_table()), what="the big write to stall in its socket")
        sender = w.runtime.procs["sender"].pid
        os.kill(sender, signal.SIGKILL)
        wait_for(lambda: getattr(w.runtime.procs.get("sender"), "pid", sender) != sender, what="the sender's restart")
        late_then = queued_for(rx)
        assert late_then, "the dead sender's connection carries nothing: nothing to wait for"

        # What a receiver does: once its room is failed, its buffer goes to the next room.
        told_early = bool(rx.status.poll(200))  # a status told at the death is here by now
        heard = rx.statuses(2) if told_early else []
        if not told_early:
            rx.resume()
            heard = rx.statuses(2)
        assert [st["state"] for st in heard] == ["failed"]
        new = Item("image", *image(5, grid=BIG_GRID))
        rx.alloc(3, ROWS, HIDDEN)  # the same buffer
        client.encode(3, "reuses", [new])
        rx.resume()
        (ok,) = rx.statuses(3)
        assert ok["state"] == "success", ok
        wait_for(lambda: queued_for(rx) == 0, what="the late bytes to land")
        main, _ = expected_sim_rows(new.pixels, "image", ROWS, HIDDEN, 0, "bfloat16")
        got = np.frombuffer(rx.read(0, ROWS * HIDDEN * 2), np.uint16).reshape(ROWS, HIDDEN)
        wrong = int((got != main).any(axis=1).sum())
        assert not told_early, (f"failed was told while {late_then} bytes of the dead sender could still land; "
                                f"{wrong} of the next room's {ROWS} rows were overwritten by them")
        assert wrong == 0 and wire.rows_digest((got.tobytes(),)) == ok["digest"]
    finally:
        for obj in reversed(made):
            obj.close()


HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def row(local: str, remote: str, state: int, tx: int, rx: int, inode: int) -> str:
    def addr(a):
        ip, port = a.split(":")
        return "".join(f"{int(x):02X}" for x in reversed(ip.split("."))) + f":{int(port):04X}"
    return f"   0: {addr(local)} {addr(remote)} {state:02X} {tx:08X}:{rx:08X} 00:00000000 00000000 0 0 {inode}\n"


def test_the_socket_table_counts_bytes_an_orphan_can_still_deliver_and_to_whom(tmp_path):
    net, proc = tmp_path / "net", tmp_path / "proc"
    (proc / "77" / "fd").mkdir(parents=True)
    net.mkdir()
    (proc / "77" / "fd" / "3").symlink_to("socket:[501]")  # a receiver's RPC and data ports
    (proc / "77" / "fd" / "4").symlink_to("socket:[502]")
    (proc / "78" / "fd").mkdir(parents=True)
    (proc / "78" / "fd" / "3").symlink_to("socket:[505]")  # another receiver's RPC port
    (net / "tcp").write_text(HEADER + "".join([
        row("0.0.0.0:7000", "0.0.0.0:0", 0x0A, 0, 0, 501),            # its RPC port
        row("0.0.0.0:7001", "0.0.0.0:0", 0x0A, 0, 0, 502),            # its data port
        row("0.0.0.0:9000", "0.0.0.0:0", 0x0A, 0, 0, 505),            # the other's
        row("127.0.0.1:40000", "127.0.0.1:7001", 4, 4097, 0, 0),       # an orphan: 4096 bytes and its FIN
        row("127.0.0.1:7001", "127.0.0.1:40000", 1, 0, 300, 503),      # ... 300 more unread at the receiver
        row("127.0.0.1:40001", "127.0.0.1:9000", 5, 0, 0, 0),          # an orphan with all acknowledged
        row("127.0.0.1:9000", "127.0.0.1:40001", 8, 0, 1, 504),        # ... its FIN heard, not read: no byte
        row("127.0.0.1:40002", "127.0.0.1:9100", 4, 1, 0, 0),          # an orphan with only its FIN left
        row("127.0.0.1:40003", "10.0.0.9:7001", 1, 50, 0, 0),          # to another host
    ]))
    table = tcp_table.read_table(str(net))
    orphans = tcp_table.orphaned(table)
    assert sorted(orphans) == [(("10.0.0.9", 7001), 50), (("127.0.0.1", 7001), 4396)]
    groups = tcp_table.port_groups(table, str(proc))
    here = tcp_table.destination("127.0.0.1:7000", table, groups)
    assert here.ports == {7000, 7001} and here.carried(orphans) == 4396
    assert tcp_table.destination("127.0.0.1:9000", table, groups).carried(orphans) == 0  # another process
    assert tcp_table.destination("127.0.0.1:9999", table, groups).carried(orphans) == 4396  # not found: any port
    assert tcp_table.destination("10.0.0.9:7000", table, groups).carried(orphans) == 50  # elsewhere: any port
    assert tcp_table.destination("prefill-3:7000", table, groups).addresses is None
