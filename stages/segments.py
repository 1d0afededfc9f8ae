"""Clients' pixel segments: which names the worker may take, taking them (open, then
unlink), reading them, and closing them.

A segment is taken only if its name is `/<prefix>...` without another `/`, not one of
the worker's own objects, and it is a regular file (never through a symlink) owned by
the worker's user; its read must find exactly the size the request says.
"""
from __future__ import annotations

import os
import queue
import stat
import threading

from ipc import shm
from ipc.wire import PixelsRef, ProtocolError

READ_PIECE = 512 << 10  # pixels read and hashed at a time: fits a core's L2

# A segment its read found at most this large is closed in the handling thread: handing
# a descriptor to the closer thread (a wake-up, the GIL changing hands twice) costs more
# than closing a small segment, and far less than closing a large one.
CLOSE_INLINE_BYTES = 128 << 10


def name_problem(prefix: str, name: str) -> str | None:
    """Why the worker will not open `name`, or None if it is a client segment it may take."""
    if len(name) > 255:
        return f"segment name {name[:80]!r}... is {len(name)} characters, longer than 255"
    if not name.startswith("/" + prefix):
        return f"segment {name[:80]!r} is outside the worker's shm prefix '/{prefix}'"
    rest = name[1:]
    if "/" in rest or "\0" in rest or rest in (".", ".."):
        return f"segment name {name[:80]!r} may not contain '/' or NUL"
    if rest.startswith("sem.") or shm.parse_name(rest) is not None:
        return f"segment {name[:80]!r} names one of the worker's own objects"
    return None


def take(prefix: str, names) -> dict[str, int | str]:
    """Open and unlink every acceptable segment of `names`: name -> fd, or why not."""
    taken: dict[str, int | str] = {}
    for name in names:
        if name in taken:
            continue
        problem = name_problem(prefix, name)
        if problem:
            taken[name] = problem
            continue
        path = os.path.join(shm.SHM_DIR, name[1:])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            taken[name] = f"segment {name!r} does not exist"
            continue
        except OSError as e:
            # handed over all the same (the room fails with this reason): a segment left
            # because its open failed (out of descriptors, say) would stay in /dev/shm
            # for good, so it goes by name, by the rules a dead intake's leftovers go by
            taken[name] = f"segment {name!r} cannot be opened: {e.strerror}"
            unlink_left(prefix, name)
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                os.close(fd)
                taken[name] = f"segment {name!r} is not a regular segment of the worker's user"
                continue
            os.unlink(path)
        except OSError:
            pass
        taken[name] = fd
    return taken


def read_into(fd: int | str, px: PixelsRef, view: memoryview, hasher) -> None:
    """The segment's pixels into `view`, hashed piece by piece as each lands (`hasher`, if
    given): the bytes are read once, while they are in this core's cache. `fd` is what
    `take` found for the segment; ProtocolError if that is a reason, or its size is not
    the request's."""
    if isinstance(fd, str):
        raise ProtocolError(fd)
    size = os.fstat(fd).st_size
    if size != px.nbytes:
        raise ProtocolError(f"segment {px.shm!r} holds {size} bytes; shape and dtype need {px.nbytes}")
    got = 0
    while got < px.nbytes:
        n = os.preadv(fd, [view[got:got + READ_PIECE]], got)
        if n <= 0:
            raise ProtocolError(f"segment {px.shm!r} shrank while it was read")
        if hasher is not None:
            hasher.update(view[got:got + n])
        got += n


def close(taken: dict, nbytes: dict | None = None) -> None:
    """Close what `take` opened. `nbytes`: each segment's size, as its read checked it; a
    segment whose size is not known so (a request refused, or a read that failed) goes to
    the closer thread."""
    for name, fd in taken.items():
        if not isinstance(fd, int):
            continue
        if nbytes is not None and nbytes.get(name, CLOSE_INLINE_BYTES + 1) <= CLOSE_INLINE_BYTES:
            try:
                os.close(fd)
            except OSError:
                pass
        else:
            _closer.close(fd)


def unlink_left(prefix: str, name: str) -> None:
    """Unlink a segment a dead intake was about to take, by the rules `take` goes by."""
    if not name or name_problem(prefix, name) is not None:
        return
    path = os.path.join(shm.SHM_DIR, name[1:])
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
    except FileNotFoundError:
        pass


class _Closer:
    """Closes taken segments' descriptors on a thread of its own: the last close of an
    unlinked segment frees its pages, a large part of intake's time per large image,
    and os.close releases the GIL while the kernel does it."""

    def __init__(self):
        self.fds: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.pid = 0

    def close(self, fd: int) -> None:
        if self.thread is None or self.pid != os.getpid():  # none yet, or inherited by a fork
            self.pid = os.getpid()
            self.thread = threading.Thread(target=self._run, name="segment-closer", daemon=True)
            self.thread.start()
        self.fds.put(fd)

    def _run(self) -> None:
        while True:
            fd = self.fds.get()
            try:
                os.close(fd)
            except OSError:
                pass


_closer = _Closer()
