"""Named shared-memory objects: segments and semaphores of one pipeline run.

Every object is named ``<prefix>-<run id>-<what>``. The prefix is letters, digits
and underscores (no dash), the run id eight hex digits, so a name parses one way
and ``sweep(prefix)`` can never take another prefix's objects. Each run holds an
exclusive ``flock`` on its ``<prefix>-<run id>-lock`` segment for as long as it
lives; the kernel drops that lock when the process dies, however it dies, and
``sweep`` removes only runs whose lock nobody holds.

Segments are created with mode 0600 and their whole size reserved with
``posix_fallocate``, so a full /dev/shm fails here with a readable error instead
of SIGBUS at first touch. Nothing is registered with Python's resource tracker:
the supervisor owns cleanup, and a tracker in a dying child would unlink
segments that other stages still use.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import shutil
import stat
from typing import cast

import posix_ipc

PAGE = 4096  # a NUMA first touch places whole pages

SHM_DIR = "/dev/shm"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")
_WHAT_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")
_RUN_RE = re.compile(r"^[0-9a-f]{8}$")


class ShmError(RuntimeError):
    """A shared-memory object could not be created or opened."""


class ShmFullError(ShmError):
    """/dev/shm has too little room for a segment, or for a run's objects."""

    def __init__(self, what: str, needed: int, free: int):
        super().__init__(
            f"/dev/shm cannot hold {what}: it needs {needed} bytes "
            f"({needed / 2**20:.1f} MiB) and {free} bytes ({free / 2**20:.1f} MiB) are free; "
            f"enlarge /dev/shm (e.g. docker --shm-size) or shrink the arenas"
        )
        self.needed = needed
        self.free = free


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix or ""):
        raise ValueError(f"shm prefix {prefix!r} must be 1-32 letters, digits or underscores")
    return prefix


def new_run_id() -> str:
    return secrets.token_hex(4)


def object_name(prefix: str, run_id: str, what: str) -> str:
    check_prefix(prefix)
    if not _RUN_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} must be 8 hex digits")
    if not _WHAT_RE.match(what):
        raise ValueError(f"object name part {what!r} must be letters, digits, '_' or '.'")
    return f"{prefix}-{run_id}-{what}"


def parse_name(entry: str) -> tuple[str, str, str] | None:
    """(prefix, run id, what) of a /dev/shm entry of ours (segment or 'sem.'), else None."""
    if entry.startswith("sem."):
        entry = entry[4:]
    parts = entry.split("-", 2)
    if len(parts) != 3:
        return None
    prefix, run_id, what = parts
    if _PREFIX_RE.match(prefix) and _RUN_RE.match(run_id) and _WHAT_RE.match(what):
        return prefix, run_id, what
    return None


def shm_free_bytes() -> int:
    return shutil.disk_usage(SHM_DIR).free


def require_free(parts: dict[str, int]) -> None:
    """Fail before anything is created when /dev/shm cannot hold ``parts`` (bytes by what).

    Reserving a segment that does not fit would first fill /dev/shm, briefly, for
    every other user of it; this check asks the file system instead.
    """
    needed = sum(parts.values())
    free = shm_free_bytes()
    if needed > free:
        what = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in parts.items())
        raise ShmFullError(f"this run's shared memory ({what})", needed, free)


def private_dir(path: str) -> None:
    """Create `path` mode 0700, or check that an existing one is ours alone.

    The default run directory has a predictable name under /tmp: another local user
    could make it first and put their own socket in it, where a gateway would send
    pixels. So a directory owned by someone else, writable by others, or a symlink is
    refused, not used.
    """
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, 0o700, exist_ok=True)
        return
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ShmError(f"run directory {path} exists and is not a directory (a symlink?): refusing it")
    if st.st_uid != os.geteuid():
        raise ShmError(
            f"run directory {path} belongs to uid {st.st_uid}, not to this user "
            f"({os.geteuid()}): refusing it; remove it or choose another run_dir"
        )
    if st.st_mode & 0o022:
        raise ShmError(
            f"run directory {path} is writable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}): refusing it; chmod 700 it or choose another run_dir"
        )


class Segment:
    """A mapped POSIX shared-memory segment. ``buf`` is a writable memoryview, unless
    attached read-only (then any write through it raises)."""

    def __init__(self, name: str, fd: int, size: int, owner: bool, readonly: bool = False):
        self.name = name
        self.size = size
        self.owner = owner
        self._fd = fd
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        self._mmap = mmap.mmap(fd, size, prot=prot) if size else None
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    @property
    def mapped(self) -> mmap.mmap | bytes:
        """What ``buf`` views: the mapping (empty bytes for a segment of no size), for numpy
        arrays over it and for ``find``."""
        return cast("mmap.mmap | bytes", self.buf.obj)

    @classmethod
    def create(cls, name: str, size: int, *, slices: int = 1, touch=None) -> "Segment":
        """A new segment of `size` bytes, all of it allocated now. With `touch`, in `slices`
        page-aligned parts, the k-th inside the context `touch(k)`: a NUMA first touch."""
        if size < 0:
            raise ValueError("segment size must be >= 0")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ShmError(f"shared-memory segment {name!r} already exists") from None
        try:
            os.fchmod(fd, 0o600)  # the umask cannot widen it, but make the mode exact
            bounds = [size * k // slices // PAGE * PAGE for k in range(slices)] + [size]
            for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
                if end <= start:
                    continue
                try:
                    with touch(k) if touch is not None else contextlib.nullcontext():
                        os.posix_fallocate(fd, start, end - start)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                        raise ShmFullError(f"segment {name!r}", size, shm_free_bytes()) from None
                    raise
            return cls(name, fd, size, owner=True)
        except BaseException:
            os.close(fd)
            _unlink_quiet(os.path.join(SHM_DIR, name))
            raise

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> "Segment":
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY if readonly else os.O_RDWR)
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {name!r} does not exist") from None
        try:
            size = os.fstat(fd).st_size
            return cls(name, fd, size, owner=False, readonly=readonly)
        except BaseException:
            os.close(fd)
            raise

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd < 0:
            return
        self.buf.release()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # Someone still holds a view (a numpy array over it); the mapping
                # goes when they do. The fd is ours to close either way.
                pass
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        _unlink_quiet(os.path.join(SHM_DIR, self.name))


def create_semaphore(name: str) -> posix_ipc.Semaphore:
    try:
        return posix_ipc.Semaphore("/" + name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
    except posix_ipc.ExistentialError:
        raise ShmError(f"semaphore {name!r} already exists") from None


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    try:
        return posix_ipc.Semaphore("/" + name)
    except posix_ipc.ExistentialError:
        raise ShmError(f"semaphore {name!r} does not exist") from None


def unlink_semaphore(name: str) -> None:
    try:
        posix_ipc.unlink_semaphore("/" + name)
    except posix_ipc.ExistentialError:
        pass


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class RunLock:
    """Marks a run as alive: an exclusive flock on ``<prefix>-<run id>-lock``.

    The kernel releases it when the holder dies, so ``sweep`` can tell a live run
    from a dead one without trusting pids.
    """

    def __init__(self, prefix: str, run_id: str | None = None):
        self.prefix = check_prefix(prefix)
        self.run_id = run_id or new_run_id()
        self.name = object_name(prefix, self.run_id, "lock")
        path = os.path.join(SHM_DIR, self.name)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self) -> None:
        """Give up the lock and remove its file (after the run's objects are gone)."""
        if self._fd < 0:
            return
        _unlink_quiet(os.path.join(SHM_DIR, self.name))
        os.close(self._fd)
        self._fd = -1


def _run_alive(prefix: str, run_id: str) -> bool:
    path = os.path.join(SHM_DIR, f"{prefix}-{run_id}-lock")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def list_objects(prefix: str, run_id: str | None = None) -> list[str]:
    """The /dev/shm entries (as listed there) that belong to ``prefix`` (and run)."""
    check_prefix(prefix)
    out = []
    for entry in os.listdir(SHM_DIR):
        parsed = parse_name(entry)
        if parsed and parsed[0] == prefix and (run_id is None or parsed[1] == run_id):
            out.append(entry)
    return sorted(out)


def sweep(prefix: str, run_id: str | None = None, *, include_live: bool = False) -> list[str]:
    """Remove what dead runs of ``prefix`` left in /dev/shm; return the entries removed.

    A run whose lock is still held by a live process is left alone unless
    ``include_live`` (a run cleaning up after itself). Names of any other prefix,
    and names that do not parse as ours, are never touched.
    """
    removed = []
    runs: dict[str, list[str]] = {}
    for entry in list_objects(prefix, run_id):
        parsed = parse_name(entry)
        if parsed:  # always: list_objects lists only the names that parse
            runs.setdefault(parsed[1], []).append(entry)
    for rid, entries in runs.items():
        if not include_live and _run_alive(prefix, rid):
            continue
        # The lock last, so a concurrent sweeper never sees a lockless live-looking run.
        entries.sort(key=lambda e: e.endswith("-lock"))
        for entry in entries:
            _unlink_quiet(os.path.join(SHM_DIR, entry))
            removed.append(entry)
    return removed


# ---------------------------------------------------------------- named by their creator
# A segment one process makes for another to take (a client's pixels) carries its
# creator in its name, `<prefix>.px.<pid namespace>.<pid>.<start time>.<n>`: the pid
# alone could be reused, the start time (in clock ticks since boot, /proc/<pid>/stat)
# with it names one process, and the namespace says whether this host's /proc can
# answer for it at all.


def _start_time(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces and parentheses: count from its end.
    return int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])


def _pid_namespace(pid: int | str = "self") -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def creator_tag() -> str:
    """`<pid namespace>.<pid>.<start time>` of this process."""
    return f"{_pid_namespace()}.{os.getpid()}.{_start_time('self')}"


def creator_dead(tag: str) -> bool:
    """Whether the process a creator_tag() names has surely exited: False when it may
    live, or when it ran in another pid namespace (this /proc cannot tell)."""
    try:
        ns, pid, start = (int(part) for part in tag.split("."))
    except ValueError:
        return False
    if ns != _pid_namespace():
        return False
    return _start_time(pid) != start


PIXEL_SEGMENT_RE = re.compile(r"^([A-Za-z0-9_]{1,32})\.px\.(\d+\.\d+\.\d+)\.\d+$")


def pixel_segment_name(prefix: str, n: int) -> str:
    """The /dev/shm entry of a client's n-th pixel segment for a worker of `prefix`."""
    return f"{check_prefix(prefix)}.px.{creator_tag()}.{n}"


def sweep_pixel_segments(prefix: str) -> list[str]:
    """Remove the pixel segments under `prefix` whose creator has exited (no worker took
    them, and their creator can no longer); return the entries removed. A name of the
    older form (no creator in it) or a live creator's is left alone."""
    check_prefix(prefix)
    removed = []
    for entry in os.listdir(SHM_DIR):
        m = PIXEL_SEGMENT_RE.match(entry)
        if m and m[1] == prefix and creator_dead(m[2]):
            _unlink_quiet(os.path.join(SHM_DIR, entry))
            removed.append(entry)
    return removed
