#!/usr/bin/env python3
"""Chaos under load: the multi-process pipeline with stages and receivers killed at random.

    .venv/bin/python benchmarks/chaos.py --minutes M [--dense] [--seed S] [--json PATH]

A steady load of multi-item rooms (images from a small hot pool, so cache hits;
fresh images, some sent twice close together, so misses and identical misses in
flight; items split across two receivers, so fanout 2) runs against a worker in
`--mode pipeline` (the sim tower, Mooncake over loopback TCP). Meanwhile, at
random moments drawn from the seed (printed, with every kill, so a run can be
replayed):
- a random stage is SIGKILLed, or SIGSTOPped past `heartbeat_timeout_s` (the
  supervisor must kill and restart it);
- a receiver process is SIGKILLed while writes go on, or just before it would send
  the allocs of rooms already sent; it comes back with the same id (re-register
  replaces the old one) or a new one;
- receivers cancel rooms (a tenth of them, 0-50 ms after their allocs).

Each receiver is its own (spawned) process: its receive buffer is filled with
canary bytes before any alloc; on `success` it checks its rows bit-exact against
the sim tower's formula computed here, and against the success's digest; on `failed` it snapshots the room's
buffers and compares them `QUARANTINE_S` later and at the end, so a row written
after the status shows. It checks, as statuses arrive, that no (room, item) gets
two terminal statuses and no `success` follows `failed` (a cancel is acknowledged
by its `failed`, so nothing may follow that either).

At the end (load stopped, every stage and receiver up): ten rooms more must all
succeed (the worker keeps serving); every room concludes at every receiver alive
to hear it, the same way at all of them and as the worker's room table says; no
room stays live in the worker; after shutdown every stage exited 0 (the sender's
close unregisters its Mooncake memory), each receiver's engine was unregistered
and destroyed, and /dev/shm holds nothing of the run's prefix (segments and
`sem.` semaphores). Pixel segments of requests lost in a SIGKILLed intake's
socket stay the gateway's (docs/design.md, known limit 3): the harness removes those and
counts them, only where intake never recorded the room (it is not in the table,
or only as the reaper's "?" entry of a room canceled or named by the dead
intake's journal) and an intake kill came after it was sent. A receiver alive
at the end that misses a status is excused only where the room concluded within
five seconds (one with --dense) before to a second after a reaper kill (docs/design.md, known
limit 1), or where the worker never saw the room and both an intake kill and a sender
kill (within bootstrap_timeout_s) came after it was sent: its request and its allocs
may both have died in those stages' sockets, and nobody can answer (docs/design.md, known
limit 3); such rooms are listed in the JSON.

`--dense` (issue #11): kills close together while the stages hold rooms, so custody,
restart and replay meet. The load is a window of DENSE_WINDOW (32) rooms in flight,
refilled as they conclude, not a rate; half the items are fanout 2; the caches hold a few
items, so most items go through the tower. Every 0.5-1.2 s one of: a stage SIGKILLed (a
stage that holds rooms, by the room table's custody bits, more often than not, after
waiting up to HOLD_WAIT_S for it to hold one); two stages within 50 ms; a stage and then
its successor while it starts (or just after); a stage killed and its successor SIGSTOPped
while it starts (issue #37: the supervisor gives that start up after stage_start_timeout_s,
its default, and starts another, holding up nothing else meanwhile); now and then a SIGSTOP past
`heartbeat_timeout_s` (4 s here); receiver kills as above. `bootstrap_timeout_s` is 10 s;
`restart_window_s` 5 s keeps the supervisor's restart backoff short (kills this frequent
would otherwise keep it at its 2 s cap).

The bound (both modes): a room concludes at each of its receivers within
`max(deadline, bootstrap_timeout_s)` (the harness sets no deadline_ms, so
bootstrap_timeout_s) of being sent, counting only time when every stage was up and none
stopped (so the time to restart what died is added), plus HUNG_GRACE_S (2 s). A room
over it, or never concluded at a receiver alive to hear it (known limit 1 aside), is hung.

Besides the rest, the JSON has: `rooms_hung`; `longest_outage_s` (the longest time during
the chaos in which no room succeeded at any receiver, with rooms in flight all along: the
worker served nothing); `duplicate_statuses` (a second terminal
status for a (room, item), or success after failed, at one receiver); `wrong_rows` (rows
that differ from the sim tower's after success, or buffers written after failed);
`digest_mismatches` (a success whose digest, protocol 1.1, its receiver's rows do not
hash to); `statuses_recovered_by_query` (statuses a receiver lacked and got as the
repeat that answered its `query` of a room it heard nothing of for QUERY_AFTER_S, 2 s);
`kills` (signals sent to stages and receivers; their list is `kill_log`);
`median_rooms_held_at_kill` (rooms whose custody bit the stage had set, read just before
each SIGKILL or SIGSTOP of a stage); `serving_at_end` (the ten rooms sent after the last
kill all succeeded at every receiver); `violation_count` counts all of them with the rest.

Writes a JSON result with `--json PATH`; exit status 1 if any violation.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from pipeline.testing.chaos import run_chaos  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, required=True, help="how long the chaos goes on")
    ap.add_argument("--seed", type=int, default=None, help="replays a run's schedule (printed at start)")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--dense", action="store_true", help="kills close together under a window of rooms in "
                                                        "flight (see the docstring)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"seed {seed}", flush=True)
    run_dir = tempfile.mkdtemp(prefix="epd-chaos-")
    prefix = f"chaos_{os.getpid()}"
    res = run_chaos(args.minutes * 60, seed, shm_prefix=prefix, run_dir=run_dir,
                    log=lambda s: print(s, flush=True), dense=args.dense, receivers=args.receivers)
    shutil.rmtree(run_dir, ignore_errors=True)
    shown = {k: v for k, v in res.items() if k != "kill_log"}
    print(json.dumps(shown, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if res["violation_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
