"""The lock that the arena's and the room table's writers take on their segment."""

from __future__ import annotations

import fcntl
import os
import threading
import weakref

from . import shm

__all__ = ["SegmentLock"]


class SegmentLock:
    """An exclusive lock on a shared-memory segment, between processes and threads.

    ``flock`` on a private open file description of the segment (``/proc/self/fd``
    re-opens it even after the name is unlinked), so it excludes other processes
    and other objects in this process alike, and the kernel drops it when the
    holder dies, however it dies. A thread lock on top orders this object's
    threads. In a forked child the inherited description (which shares the
    parent's lock) is closed and a fresh one opened, so a child never holds or
    keeps alive its parent's lock.

    ``with lock:`` holds it. ``on_acquire``, when given, runs each time the lock is
    taken, before anything else under it (the arena rolls back what a holder killed
    mid-mutation left); if it raises, the lock is given up again.
    """

    def __init__(self, seg: shm.Segment, on_acquire=None):
        self._seg = seg
        self._on_acquire = on_acquire
        self._t = threading.Lock()
        self._fd = self._open()
        _locks.add(self)

    def _open(self) -> int:
        return os.open(f"/proc/self/fd/{self._seg.fileno()}", os.O_RDWR | os.O_CLOEXEC)

    def acquire(self) -> None:
        if self._fd < 0:
            raise ValueError(f"lock of {self._seg.name!r} is closed")
        self._t.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._t.release()
            raise
        if self._on_acquire is not None:
            try:
                self._on_acquire()
            except BaseException:
                self.release()
                raise

    def release(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._t.release()

    def __enter__(self) -> "SegmentLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _after_fork(self) -> None:
        if self._fd < 0:
            return
        self._t = threading.Lock()
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = self._open()

    def close(self) -> None:
        _locks.discard(self)
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1


_locks: "weakref.WeakSet[SegmentLock]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_locks):
        lock._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
