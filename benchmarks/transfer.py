#!/usr/bin/env python3
"""sender_vs_raw_mooncake: embeddings/s through the sender ÷ raw Mooncake writes, same engines.

The worker runs in this process (in-process mode, sim tower, hidden 3584 bfloat16,
256 rows = 1.8 MB per item); the receiver runs in a child process, as a prefill
rank would. The cache is warmed with one image and every room then asks for that
image, so what is measured is the sender's path: alloc in, validation, write,
status out (alloc to success status, a window of allocs in flight). The baseline
writes the same payload, from the same arena, to the same receive buffers with
raw `transfer_sync_write` calls on the same engine pair, in the same run.

    .venv/bin/python benchmarks/transfer.py --quick --json /tmp/transfer.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ipc import shm  # noqa: E402
from pipeline.client import Client, Item  # noqa: E402
from pipeline.config import WorkerConfig  # noqa: E402
from pipeline.running import Running, free_port  # noqa: E402

HIDDEN, SPAN, DTYPE = 3584, 256, "bfloat16"
ITEM_BYTES = SPAN * HIDDEN * 2
GRID = (1, 32, 32)  # 1024 patches -> 256 rows



def receiver_main(bootstrap: str, conn, n_rooms: int, window: int, first_room: int) -> None:
    from pipeline.receiver import Receiver

    r = Receiver("bench-rx", bootstrap, buffer_bytes=(window + 2) * ITEM_BYTES + (1 << 20))
    # The raw baseline writes into these regions too.
    regions = [r._take(ITEM_BYTES) for _ in range(window)]
    for off in regions:
        r._give(off, ITEM_BYTES)
    conn.send((r.engine.session, r.address, regions))
    assert conn.recv() == "go"
    t0 = time.perf_counter()
    next_room, outstanding, done = first_room, set(), 0
    while done < n_rooms:
        while len(outstanding) < window and next_room < first_room + n_rooms:
            r.alloc(next_room, 0, span=SPAN, hidden=HIDDEN, dtype=DTYPE)
            outstanding.add(next_room)
            next_room += 1
        r.poll(0.05)
        for room in [x for x in outstanding if r.concluded(x, 1)]:
            outstanding.discard(room)
            r.release(room)
            done += 1
    elapsed = time.perf_counter() - t0
    conn.send((elapsed, len(r.failed), r.violations))
    conn.recv()
    r.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer items (well under a minute)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--window", type=int, default=8, help="allocs in flight at the receiver")
    args = ap.parse_args()
    n = 200 if args.quick else 1000
    prefix = f"bench_tx{os.getpid()}"
    tmp = tempfile.mkdtemp(prefix="epd-bench-")
    cfg = WorkerConfig(shm_prefix=prefix, intake=f"ipc://{tmp}/intake.sock", run_dir=tmp,
                       bootstrap=f"tcp://127.0.0.1:{free_port()}", tower="sim", sim_hidden=HIDDEN,
                       sim_dtype=DTYPE, sim_time_per_row_s=0.0, embedding_arena_bytes=64 << 20,
                       arena_cache_bytes=16 << 20, pixel_arena_bytes=64 << 20,
                       max_live_rooms=n + 16, max_tombstones=n + 16)
    ctx = mp.get_context("spawn")
    w = Running(cfg, "inprocess")
    parent, child = ctx.Pipe()
    rx = ctx.Process(target=receiver_main, args=(cfg.bootstrap, child, n, args.window, 1), daemon=True)
    rx.start()
    try:
        session, address, regions = parent.recv()
        client = Client(w.cfg.intake, prefix)
        px = np.random.default_rng(0).standard_normal((GRID[1] * GRID[2], 1176), dtype=np.float32)
        for room in range(1, n + 1):
            client.encode(room, f"bench-{room}", [Item("image", [list(GRID)], px)])
        deadline = time.monotonic() + 120
        while w.worker.rooms.count_live() < n and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the register, and every room hashed and ready
        parent.send("go")
        sender_s, failed, violations = parent.recv()

        # Raw: the same bytes (the cached lease) to the same regions, sync writes.
        cache = w.worker.stages["cache"].hc.cache
        lease = cache.lease_of(cache.keys("arena")[0])
        src = w.worker.shared.emb_arena.address + lease.offset
        te = w.worker.env.engine._te
        w.stop.set()  # the worker loop is idle from here; keep it off the GIL
        w.thread.join(10)
        t0 = time.perf_counter()
        for k in range(n):
            rc = te.transfer_sync_write(session, src, address + regions[k % len(regions)], ITEM_BYTES)
            if rc != 0:
                raise RuntimeError(f"raw transfer_sync_write failed: {rc}")
        raw_s = time.perf_counter() - t0
        parent.send("bye")
        rx.join(30)
        client.close()
    finally:
        if rx.is_alive():
            rx.kill()
        w.close()
        shm.sweep(prefix)
    sender_rate, raw_rate = n / sender_s, n / raw_s
    result = {
        "items": n, "item_bytes": ITEM_BYTES, "window": args.window,
        "sender_items_per_s": sender_rate, "raw_items_per_s": raw_rate,
        "sender_vs_raw_mooncake": sender_rate / raw_rate,
        "failed_rooms": failed, "violations": len(violations),
    }
    print(f"sender: {n} items of {ITEM_BYTES / 1e6:.2f} MB, alloc to success status, window "
          f"{args.window}: {sender_rate:.0f} items/s ({sender_rate * ITEM_BYTES / 1e6:.0f} MB/s)")
    print(f"raw transfer_sync_write, same engines and buffers: {raw_rate:.0f} items/s "
          f"({raw_rate * ITEM_BYTES / 1e6:.0f} MB/s)")
    print(f"sender_vs_raw_mooncake = {result['sender_vs_raw_mooncake']:.2f}  (target >= 0.8)")
    if failed or violations:
        print(f"FAILED rooms: {failed}, violations: {violations}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if not failed and not violations else 1


if __name__ == "__main__":
    sys.exit(main())
