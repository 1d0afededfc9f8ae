"""The baselines a benchmark divides by, each measured in a fresh child process
(in_child) so that nothing of the parent (threads, loaded libraries, CPU time) enters
it: the one-way wake of a bare semaphore, the least a process can spend taking a
client's segment, the tower's forward alone on the scheduler's batches."""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

from stages.registry import CACHE, INTAKE, REAPER, SCHEDULER, SENDER, TOWER

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
# A fresh encode's critical path (docs/design.md, "The life of an image"): each step is a ring
# in the pipeline, checked against pipeline/runtime/wiring.py's EDGES by hops_on_fresh_path().
FRESH_ENCODE_PATH = (INTAKE, CACHE, SCHEDULER, TOWER, SENDER, REAPER)


def in_child(fn, *args, timeout: float = 600.0):
    """fn(*args) in a fresh spawned process: nothing of this one (threads, loaded
    libraries, CPU time) enters the measurement; its result or its error."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=child_call, args=(child, fn, args))  # not daemonic: it may start its own
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"{fn.__name__} gave no answer in {timeout:.0f} s")
        ok, value = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in its child process: {value}")
    return value


def child_call(conn, fn, args) -> None:
    try:
        value = (True, fn(*args))
    except BaseException as e:  # reported to the parent, which raises
        value = (False, f"{type(e).__name__}: {e}")
    conn.send(value)


def hops_on_fresh_path() -> int:
    """Ring hops of a fresh encode's critical path, each checked to be a ring of the wiring."""
    from pipeline.runtime.wiring import EDGES

    steps = list(zip(FRESH_ENCODE_PATH, FRESH_ENCODE_PATH[1:]))
    missing = [s for s in steps if s not in EDGES]
    if missing:
        raise RuntimeError(f"FRESH_ENCODE_PATH has steps that are no ring in pipeline/runtime/wiring.py: {missing}")
    return len(steps)


def raw_semaphore_wake(quick: bool) -> dict:
    """benchmarks/ring.py's wake measurement (run in a child: it forks its own);
    its raw figures, among them the one-way wake of a sleeper on a bare semaphore."""
    import contextlib
    import importlib.util
    import io

    from ipc import shm

    spec = importlib.util.spec_from_file_location("bench_ring", os.path.join(HERE, "ring.py"))
    ring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ring)
    shm.sweep(ring.PREFIX)
    lock = shm.RunLock(ring.PREFIX)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its own report; the figures are returned
            r = ring.bench_latency(lock.run_id, quick)
    finally:
        shm.sweep(ring.PREFIX, lock.run_id, include_live=True)
        lock.release()
    return r["raw"]


def raw_intake_read(prefix: str, nbytes: int, n: int, hashed: bool = False) -> dict:
    """The least a process can spend taking a client's segment: segments made as the
    gateway makes them (Client.publish), then, timed, each opened, fstat'ed, read with
    preadv into a resident buffer, unlinked and closed (the last close frees its pages).
    Process CPU (all threads) per image, in chunks so that /dev/shm holds few at once.
    `hashed`: each piece also hashed as it lands, as the intake stage does (its READ_PIECE)."""
    import numpy as np

    from ipc import shm
    from ipc.hashing import cache_hasher, new_cache_key
    from pipeline.peers.client import Client, unlink_segment
    from stages.segments import READ_PIECE

    client = Client(f"ipc://{tempfile.gettempdir()}/epd-bench-nobody.sock", prefix)
    px = np.random.default_rng(3).standard_normal(nbytes // 4, dtype=np.float32)
    buf = np.ones(nbytes, np.uint8)  # resident: every page touched
    view = memoryview(buf)
    key = new_cache_key()  # intake hashes under the run's secret key (keyed BLAKE3)
    cpu = wall = 0.0
    done = 0
    names: list[str] = []
    try:
        while done < n:
            names = [client.publish(px) for _ in range(min(64, n - done))]
            c0, t0 = time.process_time(), time.perf_counter()
            for name in names:
                path = os.path.join(shm.SHM_DIR, name[1:])
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                size = os.fstat(fd).st_size
                os.unlink(path)
                got = 0
                if hashed:
                    h = cache_hasher(key, "image", [(1, 1, 1)], "float32")
                    while got < size:
                        k = os.preadv(fd, [view[got:min(size, got + READ_PIECE)]], got)
                        h.update(view[got:got + k])
                        got += k
                    h.digest()
                else:
                    while got < size:
                        got += os.preadv(fd, [view[got:size]], got)
                os.close(fd)
            cpu += time.process_time() - c0
            wall += time.perf_counter() - t0
            done += len(names)
            names = []
    finally:
        for name in names:
            unlink_segment(name)
        client.close()
    return {"images": done, "bytes": nbytes, "cpu_ms_per_image": cpu * 1000 / done,
            "wall_ms_per_image": wall * 1000 / done}


def scheduler_batches(grids: list, n: int, merge: int, max_tokens: int, max_items: int) -> list[list[tuple]]:
    """The batches the scheduler forms from n images (grids cycled as the client does)
    all waiting at once: its own packing (stages/batch_queue.py) on the same queue."""
    from stages.batch_queue import BatchQueue, Entry

    queue = BatchQueue(max_tokens, max_items)
    for room in range(n):
        g = tuple(grids[room % len(grids)])
        queue.add(Entry(room, room, 0, g[0] * g[1] * g[2] // merge ** 2, g))
    out = []
    while queue:
        out.append([e.payload for e in queue.next_batch()])
    return out


def spin(stop) -> None:
    """A pure-Python loop: work on another core that touches next to no memory."""
    x = 0
    while not stop.is_set():
        for i in range(10000):
            x += i


def tower_alone(cfg_kwargs: dict, grids: list, n: int, trials: int, seed: int, busy_neighbour: bool = False) -> dict:
    """The worker's tower (built as the tower stage builds it: build_tower(cfg.tower,
    **cfg.tower_settings())) on the scheduler's batches of n images, one
    start(...).result() after another in this one process, outs in one buffer
    registered with the device as the embedding arena is; images/s, best of trials.
    `busy_neighbour`: while a second process spins a Python loop (another core busy with
    work that shares nothing with the tower, as the other stages are in a pipeline)."""
    import mmap

    import numpy as np

    from pipeline.cli.config import WorkerConfig
    from stages.towers import TowerItem, build_tower

    cfg = WorkerConfig(**cfg_kwargs)
    tower = build_tower(cfg.tower, **cfg.tower_settings())
    spec = tower.spec
    batches = scheduler_batches(grids, n, spec.merge, cfg.max_tokens_per_batch, cfg.max_items_per_batch)
    most = max(sum(g[0] * g[1] * g[2] // spec.merge ** 2 for g in b) for b in batches)
    # page-aligned and resident, as the embedding arena is
    out_buf = np.frombuffer(mmap.mmap(-1, most * spec.row_bytes), spec.np_dtype)
    out_buf.fill(0)
    tower.register_host_memory(out_buf.ctypes.data, out_buf.nbytes)  # False (nothing) on CPU
    rng = np.random.default_rng(seed)
    pixels = {tuple(g): rng.standard_normal((g[0] * g[1] * g[2], spec.patch_dim), dtype=np.float32)
              for g in grids}
    def run(batch) -> None:
        items, outs, row = [], [], 0
        for g in batch:
            span = g[0] * g[1] * g[2] // spec.merge ** 2
            # one array per grid: a forward's time does not depend on the values
            items.append(TowerItem("image", [list(g)], pixels[g]))
            main = out_buf[row * spec.hidden:(row + span) * spec.hidden].reshape(span, spec.hidden)
            outs.append((main, None))
            row += span
        tower.start(items, outs).result()

    for batch in batches[:3]:  # warm-up
        run(batch)
    rates = []
    spinner = stop = None
    if busy_neighbour:
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        spinner = ctx.Process(target=spin, args=(stop,), daemon=True)
        spinner.start()
        time.sleep(0.5)  # started and spinning
    try:
        for _ in range(trials):
            t0 = time.perf_counter()
            for batch in batches:
                run(batch)
            rates.append(n / (time.perf_counter() - t0))
    finally:
        if spinner is not None:
            stop.set()
            spinner.join(5)
    tower.close()
    return {"images_per_s": max(rates), "trials": rates, "images": n, "batches": len(batches),
            "items_per_batch": n / len(batches)}
