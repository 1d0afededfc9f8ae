"""The reference design (`--mode inprocess`): every stage object in one process, one loop.

The same stage objects run in the multi-process pipeline; here the loop hands
records from one to the next by direct calls.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import zmq

from ipc import shm
from ipc.arena import Arena, StaleLease
from ipc.rooms import RoomState, RoomTable
from pipeline.config import WorkerConfig
from pipeline.transport import Engine
from stages.cache import EmbeddingCache
from stages.hash_cache import HashCache
from stages.intake import Intake
from stages.reaper import Reaper, StatusPusher
from stages.records import (OWNER_CACHE, OWNER_SCHEDULER, OWNER_TOWER, RoomFailure, WorkItem)
from stages.scheduler import Pending, Scheduler
from stages.sender import Sender
from stages.tower import Tower, TowerError, TowerItem, build_tower, numpy_dtype

log = logging.getLogger("epd.worker")


class Worker:
    def __init__(self, cfg: WorkerConfig, tower: Tower | None = None):
        self.cfg = cfg = cfg.resolved().validate()
        self.tower = None
        self.engine = None
        self.ctx = None
        self._objects = []
        shm.sweep(cfg.shm_prefix)  # what a dead run of this prefix left
        self.lock = shm.RunLock(cfg.shm_prefix)
        run_id = self.lock.run_id
        try:
            # Built before the arenas: torch's import is slow and may fail; then nothing is left.
            self.tower = tower or build_tower(cfg.tower, **cfg.tower_settings())
            spec = self.spec = self.tower.spec
            self.pixel_arena = self._own(Arena.create(cfg.shm_prefix, run_id, "pixels", cfg.pixel_arena_bytes))
            self.emb_arena = self._own(Arena.create(cfg.shm_prefix, run_id, "emb", cfg.embedding_arena_bytes))
            self.rooms = self._own(RoomTable.create(cfg.shm_prefix, run_id, "rooms",
                                                    cfg.max_live_rooms + cfg.max_tombstones + 64))
            self.engine = Engine(cfg.hostname, cfg.protocol, cfg.device)
            self.engine.register(self.emb_arena.address, self.emb_arena.size)
            self.ctx = zmq.Context()
            os.makedirs(cfg.run_dir, mode=0o700, exist_ok=True)
            self.intake_sock = self._bind(zmq.PULL, cfg.intake)
            self.bootstrap_sock = self._bind(zmq.PULL, cfg.bootstrap)
        except BaseException:
            self.close()
            raise

        self.intake = Intake(prefix=cfg.shm_prefix, run_id=run_id, pixel_arena=self.pixel_arena,
                             rooms=self.rooms, patch_dim=spec.patch_dim, merge=spec.merge,
                             max_items_per_request=cfg.max_items_per_request,
                             max_pixel_bytes_per_request=cfg.max_pixel_bytes_per_request,
                             max_live_rooms=cfg.max_live_rooms)
        self.cache = EmbeddingCache(self.emb_arena, OWNER_CACHE, cfg.arena_cache_bytes, cfg.host_cache_bytes)
        self.hash_cache = HashCache(pixel_arena=self.pixel_arena, cache=self.cache, hidden=spec.hidden,
                                    dtype=spec.dtype, trust_client_hash=cfg.trust_client_hash)
        self.scheduler = Scheduler(cfg.max_tokens_per_batch, cfg.max_items_per_batch)
        self.sender = Sender(arena=self.emb_arena, engine=self.engine, rooms=self.rooms,
                             hidden=spec.hidden, dtype=spec.dtype, deepstack_width=spec.deepstack_width,
                             bootstrap_timeout_s=cfg.bootstrap_timeout_s,
                             max_held_allocs=cfg.max_held_allocs)
        self.pusher = StatusPusher(self.ctx, cfg.status_hwm)
        self.reaper = Reaper(rooms=self.rooms, pusher=self.pusher, fence=self.sender.fence,
                             forget=self.sender.forget, tombstone_ttl_s=cfg.tombstone_ttl_s,
                             max_tombstones=cfg.max_tombstones)
        self.job = None
        self.batch: list[WorkItem] = []
        self.stalled: tuple[bytes, float] | None = None
        self.tower_batches = 0
        self.tower_items = 0
        self.accepting = True

    # ------------------------------------------------------------ set-up helpers
    def _own(self, obj):
        self._objects.append(obj)
        return obj

    def _bind(self, kind, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100000)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            raise RuntimeError(f"cannot bind {endpoint}: {e}") from None
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)
        return sock

    # ------------------------------------------------------------ the loop
    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step()

    def step(self, max_wait: float = 0.02) -> None:
        busy = self.job is not None or len(self.scheduler) or self.sender.busy() or self.stalled
        wait_ms = 0 if busy else int(max_wait * 1000)
        if self.bootstrap_sock.poll(wait_ms, zmq.POLLIN) or self.intake_sock.poll(0, zmq.POLLIN):
            pass
        self._drain(self.bootstrap_sock, self.sender.on_bootstrap)
        self._pump()
        if self.stalled:
            frame, arrival = self.stalled
            self.stalled = None
            self._on_intake(frame, arrival)
        if self.accepting and not self.stalled:
            self._drain(self.intake_sock, self._on_intake, until=lambda: self.stalled is not None)
        self._tower_step()
        self.sender.poll()
        self._pump()
        self.reaper.tick()
        self._pump()

    def _drain(self, sock, handle, limit: int = 256, until=None) -> None:
        for _ in range(limit):
            if until is not None and until():
                return
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            handle(frame)

    def _on_intake(self, frame: bytes, arrival: float | None = None) -> None:
        arrival = time.monotonic() if arrival is None else arrival
        res = self.intake.handle(frame, arrival)
        if res.stalled:
            self.stalled = (frame, arrival)
            return
        if res.failure:
            self.reaper.fail(res.failure)
            return
        if res.opened is None:
            return
        self.reaper.on_opened(res.opened)
        self.sender.on_opened(res.opened)
        for w in res.items:
            self._on_item(w)
        self.rooms.advance(res.opened.slot, res.opened.room, RoomState.QUEUED)

    def _on_item(self, w: WorkItem) -> None:
        try:
            ready, miss = self.hash_cache.on_item(w)
        except StaleLease:
            self.reaper.fail(RoomFailure(w.slot, w.room, "pixels were lost before hashing"))
            return
        if ready is not None:
            self.sender.on_ready(ready)
        elif miss is not None:
            self._queue(miss)

    def _queue(self, w: WorkItem) -> None:
        self.pixel_arena.transfer(w.pixels, OWNER_CACHE, OWNER_SCHEDULER)
        self.scheduler.add(Pending(w.seq, w.room, w.item, w.span, w))

    # ------------------------------------------------------------ tower
    def _entry_bytes(self, span: int) -> int:
        return span * self.spec.row_bytes

    def _reserve(self, batch: list[Pending]) -> bool:
        taken = []
        for p in batch:
            lease = self.emb_arena.alloc(self._entry_bytes(p.span), OWNER_SCHEDULER)
            if lease is None:
                for w, l in taken:
                    self.emb_arena.drop(l, OWNER_SCHEDULER)
                    w.out = None
                return False
            p.payload.out = lease
            taken.append((p.payload, lease))
        return True

    def _tower_step(self) -> None:
        if self.job is not None:
            if not self.job.done():
                return
            self._finish_batch()
        batch = self.scheduler.next_batch(self._reserve)
        if batch:
            self._start_batch([p.payload for p in batch])

    def _start_batch(self, batch: list[WorkItem]) -> None:
        spec = self.spec
        items, outs = [], []
        for w in batch:
            self.pixel_arena.transfer(w.pixels, OWNER_SCHEDULER, OWNER_TOWER)
            self.emb_arena.transfer(w.out, OWNER_SCHEDULER, OWNER_TOWER)
            px = np.frombuffer(self.pixel_arena.view(w.pixels), dtype=numpy_dtype(w.pixel_dtype))
            items.append(TowerItem(w.modality, [tuple(g) for g in w.grid_thw],
                                   px.reshape(w.n_patches, w.patch_dim)))
            flat = np.frombuffer(self.emb_arena.view(w.out), dtype=spec.np_dtype)
            main = flat[: w.span * spec.hidden].reshape(w.span, spec.hidden)
            deep = (flat[w.span * spec.hidden:].reshape(w.span, spec.deepstack_width)
                    if spec.deepstack_width else None)
            outs.append((main, deep))
            self.rooms.advance(w.slot, w.room, RoomState.ENCODING, OWNER_TOWER)
        self.batch = batch
        self.tower_batches += 1
        self.tower_items += len(batch)
        try:
            self.job = self.tower.start(items, outs)
        except TowerError as e:
            self.job = _Failed(e)

    def _finish_batch(self) -> None:
        job, batch = self.job, self.batch
        self.job, self.batch = None, []
        try:
            job.result()
            error = None
        except TowerError as e:
            error = f"tower failed: {e}"
        for w in batch:
            self.pixel_arena.drop(w.pixels, OWNER_TOWER)
            w.pixels = None
        if error is None:
            for w in batch:
                for ready in self.hash_cache.on_encoded(w.key, w.out):
                    self.sender.on_ready(ready)
                self.emb_arena.drop(w.out, OWNER_TOWER)
            return
        failed_rooms = {w.room for w in batch}
        for w in batch:
            self.emb_arena.drop(w.out, OWNER_TOWER)
        for w in batch:
            failures, again = self.hash_cache.on_encode_failed(w.key, error, failed_rooms)
            for f in failures:
                self.reaper.fail(f)
            if again is not None:
                self._queue(again)

    # ------------------------------------------------------------ between sender and reaper
    def _pump(self) -> None:
        while self.sender.events:
            events, self.sender.events = self.sender.events, []
            for ev in events:
                self.reaper.on_event(ev)
        if self.reaper.conclusions:
            for room, outcome, _ in self.reaper.conclusions:
                if outcome == "failed":
                    for p in self.scheduler.remove_room(room):
                        self.pixel_arena.drop(p.payload.pixels, OWNER_SCHEDULER)
                    self.hash_cache.forget_room(room)
            self.on_conclusions(self.reaper.conclusions)
            self.reaper.conclusions = []

    def on_conclusions(self, conclusions: list) -> None:
        """Hook for callers that watch rooms conclude (the demo, tests)."""

    # ------------------------------------------------------------ state
    def stats(self) -> dict:
        return {
            "rooms": dict(self.reaper.outcomes),
            "intake_dropped": dict(self.intake.dropped),
            "intake_failed": dict(self.intake.failed),
            "sender_dropped": dict(self.sender.dropped),
            "cache": self.cache.stats(),
            "dedup_hits": self.hash_cache.dedup_hits,
            "tower_batches": self.tower_batches,
            "tower_items": self.tower_items,
            "status_undelivered": self.pusher.undelivered,
            "bytes_written": self.sender.bytes_written,
        }

    def idle(self) -> bool:
        return (self.job is None and not len(self.scheduler) and not self.sender.busy()
                and not self.stalled and not self.sender.live)

    def drain(self, deadline_s: float) -> None:
        """Stop taking work; let rooms in flight finish until the deadline; fail the rest."""
        self.accepting = False
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not self.idle():
            self.step(0.005)
        for e in self.rooms.entries():
            if e.state < RoomState.SUCCESS:
                self.reaper.fail(RoomFailure(e.slot, e.room, "worker shutting down"))
        for _ in range(200):
            self.step(0.005)
            if not self.sender.busy():
                break
        self._pump()

    def close(self) -> None:
        if self.job is not None:
            try:
                self.job.result(timeout=10)
            except Exception:
                pass
        if getattr(self, "cache", None) is not None:
            self.cache.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if getattr(self, "pusher", None) is not None:
            self.pusher.close()
        if self.ctx is not None:
            for name in ("intake_sock", "bootstrap_sock"):
                sock = getattr(self, name, None)
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
            self.ctx = None
            if self.cfg.intake.startswith("ipc://"):
                try:
                    os.unlink(self.cfg.intake[len("ipc://"):])
                except FileNotFoundError:
                    pass
        if self.tower is not None:
            self.tower.close()
            self.tower = None
        for obj in reversed(self._objects):
            obj.close()
            obj.unlink()
        self._objects = []
        if self.lock is not None:
            shm.sweep(self.cfg.shm_prefix, self.lock.run_id, include_live=True)
            self.lock.release()
            self.lock = None


class _Failed:
    """A tower job that failed at launch."""

    def __init__(self, error: TowerError):
        self.error = error

    def done(self) -> bool:
        return True

    def result(self, timeout=None) -> None:
        raise self.error
