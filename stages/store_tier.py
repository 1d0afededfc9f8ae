"""The third cache tier: a Mooncake Store that several workers share, behind the local tiers.

The cache stage asks it on a local miss and puts what its tower encoded. Every call
into the store client runs on a thread of this module, never on the stage's loop: a
master that is gone answers a call at once, one that stalls holds it for the client's
RPC timeout, and neither may hold a room. So the stage asks (``ask``) and collects
(``answers``) without waiting; an ask unanswered after ``get_timeout_s`` is a miss,
and while a call is stuck past that deadline the store is not asked at all (the
item is encoded). Puts queue, boundedly, behind their own thread.

Names and values
    An entry's name is a keyed hash of the tower's identity (``tower_identity``) and
    the cache key (modality, keyed content hash, span, hidden, dtype, cache_salt): two
    towers, dtypes or salts never share a name. Its value is the rows followed by a
    keyed digest of the name and the rows, under the run's cache key (which the
    workers sharing a store share, ``cache_key_file``): a value of the wrong size, of
    another name, or written by anyone without the key, is refused and counted.

Connection
    The client is set up on the connecting thread once the master's port accepts (the
    client's own set-up blocks for a long time against a master that is not there),
    and again after a failed set-up; once set up, the client finds a restarted master
    by itself.

Closing
    The client's close unmounts this worker's segment from the master (its entries leave
    the store) and holds the GIL while it waits: against a master that is gone it holds
    the whole process for many seconds, and so does the client's destructor, and the
    exit handler Mooncake registers, which closes every client left open. So ``close``
    first asks the master something on a thread, with a bound (``CLOSE_S``): a master
    that answers is told of the close; a client whose master does not is abandoned
    (kept, never closed nor destroyed), and the process ends by
    ``end_process_if_abandoned``, past every exit handler: the OS frees the client's
    memory and the master drops its segment when the client's lease lapses.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import blake3
import numpy as np
import xxhash

from ipc import mooncake_log
from ipc.stats import Histogram

log = logging.getLogger(__name__)

DIGEST_BYTES = 32
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
MAX_ASKS = 64  # asks in flight at most; more are misses at once
MAX_PUTS = 32  # puts queued at most (each holds its rows in the arena); more are dropped and counted
# A put call older than this is stuck (a stalled master). Not the lookup deadline: a put
# holds no room, and on a busy host a healthy one can outlast a deadline made for rooms.
PUT_STUCK_S = 1.0
RETRY_S = 1.0  # between attempts to reach the master
READ_BYTES = 8 << 20  # of a weight file at a time, as its digest is made
DIGESTS_FILE = "checkpoint-digests.json"  # in the run directory: weight files' digests, kept
CLOSE_S = 1.0  # what a close waits for the threads and the master's answer, at most
PROBE_NAME = "epd/close-probe"  # what close asks the master about (a lookup, no entry)
# Clients whose master did not answer at close (see Closing above).
ABANDONED: list = []


def end_process_if_abandoned(code: int) -> None:
    """End this process now with `code` where a store client was abandoned, past Python's
    and the C runtime's exit handlers (Mooncake's would close it, waiting on the master);
    else return. Called by a process's main once everything else is closed."""
    if not ABANDONED:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass(frozen=True)
class StoreSettings:
    master: str  # host:port of mooncake_master
    metadata: str  # P2PHANDSHAKE, or the URL of a metadata server
    segment_bytes: int  # what this worker lends the store
    buffer_bytes: int  # the client's staging buffer: the largest value it puts or gets
    protocol: str
    device: str
    hostname: str
    get_timeout_s: float


def tower_identity(tower: str, spec, tower_config: str, run_dir: str = "") -> bytes:
    """What makes two towers' rows differ: the tower, its spec (hidden, deepstack width,
    dtype, merge, patch) and its weights: a checkpoint directory's digest
    (``checkpoint_digest``), or the configuration the weights were seeded from."""
    weights = tower_config if tower != "sim" else ""
    if weights and os.path.isdir(weights):
        weights = "checkpoint:" + checkpoint_digest(weights, os.path.join(run_dir, DIGESTS_FILE) if run_dir else "")
    return json.dumps({"tower": tower, "spec": asdict(spec), "weights": weights}, sort_keys=True).encode()


def checkpoint_digest(path: str, digests_file: str = "") -> str:
    """SHA-256 of a checkpoint's config.json and, of each weight file, its name, its size
    and the XXH3-128 of every byte of it: two checkpoints that differ anywhere (a
    fine-tuned projector, a few tensors) have two identities, so never share store
    entries. Identical checkpoints on two hosts agree. Reading gigabytes at every start
    is avoided by `digests_file`, where each file's digest is kept under what changes
    when the file does (its real path, size, mtime, ctime and inode)."""
    kept = _read_digests(digests_file)
    found = {}
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == "config.json":
            with open(full, "rb") as f:
                h.update(f.read())
        elif name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            real = os.path.realpath(full)
            st = os.stat(real)
            stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
            entry = kept.get(real)
            if not (isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("xxh3_128"), str)):
                entry = {"stamp": stamp, "xxh3_128": _file_digest(real)}
            found[real] = entry
            h.update(f"{name}:{st.st_size}:{entry['xxh3_128']}".encode())
    if digests_file and found and any(kept.get(k) != v for k, v in found.items()):
        _write_digests(digests_file, {**kept, **found})
    return h.hexdigest()


def _file_digest(path: str) -> str:
    d = xxhash.xxh3_128()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            d.update(view[:n])
    return d.hexdigest()


def _read_digests(digests_file: str) -> dict:
    """What an earlier start kept; nothing if there is none or it cannot be read (then
    every file is read again, which costs time, never a wrong identity)."""
    if not digests_file:
        return {}
    try:
        with open(digests_file, encoding="utf-8") as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _write_digests(digests_file: str, digests: dict) -> None:
    """Written whole and moved into place (in the worker's own run directory): a reader
    sees the old file or the new one."""
    tmp = f"{digests_file}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(digests, f, sort_keys=True)
        os.replace(tmp, digests_file)
    except OSError as e:
        log.warning("checkpoint digests not kept in %s (%s): the next start reads the weights again",
                    digests_file, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


class StoreTier:
    """A worker's client of the shared store: asks and puts on threads of its own."""

    def __init__(self, settings: StoreSettings, identity: bytes, secret: bytes, client_factory=None):
        self.settings = settings
        self.identity = identity
        self.secret = secret
        self.client_factory = client_factory or _mooncake_client
        self.client = None
        self.connecting = None  # the client being set up, until it is (or fails)
        # What the store's values are fetched into: registered with the client once set up.
        self.buffer = np.empty(settings.buffer_bytes, np.uint8)
        self.closing = threading.Event()
        self.lock = threading.Lock()
        self.wake_get = threading.Condition(self.lock)
        self.wake_put = threading.Condition(self.lock)
        self.get_queue: deque = deque()  # (seq, name, nbytes, asked_at)
        self.put_queue: deque = deque()  # (name, view, token)
        self.got: deque = deque()  # (seq, value or None, seconds), appended by the get thread
        self.put_done: deque = deque()  # tokens, appended by the put thread
        self.asked: dict[int, tuple] = {}  # seq -> (key, asked_at), the stage's side
        self.calling_since: float | None = None  # when the get thread's current call began
        self.putting_since: float | None = None  # when the put thread's current call began
        self.stuck = False  # an ask timed out: the store is stalled until the thread's call returns
        self.seq = 0
        self.puts_queued = 0
        self.get_seconds = Histogram()
        self.counts = dict.fromkeys(("hits", "misses", "puts", "put_failures", "put_dropped", "get_failures",
                                     "get_timeouts", "rejected", "skipped"), 0)
        self.threads = [threading.Thread(target=fn, name=f"store-{what}", daemon=True)
                        for what, fn in (("connect", self._connect), ("get", self._get_loop),
                                         ("put", self._put_loop))]
        for t in self.threads:
            t.start()

    # -- the stage's side (its loop's thread) ------------------------------

    def name(self, key: tuple) -> str:
        h = blake3.blake3(key=self.secret)
        h.update(b"epd-store-name|" + self.identity + b"|" + repr(key).encode())
        return "epd/" + h.hexdigest()

    def connected(self) -> bool:
        return self.client is not None

    def stalled(self, now: float) -> bool:
        """A call past the deadline has not returned (an ask timed out, or the call is older)."""
        since = self.calling_since
        if since is None:
            self.stuck = False
            return False
        return self.stuck or now - since > self.settings.get_timeout_s

    def ask(self, key: tuple, nbytes: int, now: float) -> bool:
        """Ask the store for `key`'s rows (`nbytes` of them); the answer comes out of
        `answers`. False: not asked (not connected, stalled, too many asks, rows larger than
        the buffer), a miss now."""
        if (not self.connected() or self.stalled(now) or len(self.asked) >= MAX_ASKS
                or nbytes + DIGEST_BYTES > self.buffer.nbytes):
            self.counts["skipped"] += 1
            return False
        self.seq += 1
        self.asked[self.seq] = (key, now)
        with self.lock:
            self.get_queue.append((self.seq, self.name(key), nbytes, now))
            self.wake_get.notify()
        return True

    def pending(self) -> bool:
        return bool(self.asked) or bool(self.put_done)

    def answers(self, now: float) -> list[tuple[tuple, bytes | None]]:
        """(key, rows or None) of every ask answered, or past its deadline (None, a miss)."""
        out = []
        while self.got:
            seq, value, seconds = self.got.popleft()
            asked = self.asked.pop(seq, None)
            if asked is None:
                continue  # answered after its deadline: the item was encoded meanwhile
            self.get_seconds.observe(seconds)
            out.append((asked[0], value))
        late = [seq for seq, (_, at) in self.asked.items() if now - at > self.settings.get_timeout_s]
        self.stuck = self.stuck or bool(late)
        for seq in late:
            key, _ = self.asked.pop(seq)
            self.counts["get_timeouts"] += 1
            out.append((key, None))
        return out

    def put(self, key: tuple, view: memoryview, token) -> bool:
        """Queue `view` (the rows of `key`) for the store; `token` comes back out of `done`
        once the put thread has copied `view`. False: not queued (counted): not connected,
        too many queued, rows larger than the buffer, or a put stuck (PUT_STUCK_S: a stalled
        master; rows queued behind it would hold their leases)."""
        since = self.putting_since
        if (not self.connected() or self.puts_queued >= MAX_PUTS
                or len(view) + DIGEST_BYTES > self.buffer.nbytes
                or (since is not None and time.monotonic() - since > PUT_STUCK_S)):
            self.counts["put_dropped"] += 1
            return False
        self.puts_queued += 1
        with self.lock:
            self.put_queue.append((self.name(key), view, token))
            self.wake_put.notify()
        return True

    def done(self) -> list:
        """Tokens of the puts finished (stored or failed)."""
        out = []
        while self.put_done:
            out.append(self.put_done.popleft())
        self.puts_queued -= len(out)
        return out

    def stats(self) -> dict:
        """The cache stage's stats() keys of the store: its state, and what metrics count."""
        c = self.counts
        return {"store": {**c, "connected": self.connected(), "master": self.settings.master,
                          "asks_in_flight": len(self.asked), "puts_queued": self.puts_queued},
                "store_gets": {"hit": c["hits"], "miss": c["misses"], "rejected": c["rejected"],
                               "failed": c["get_failures"], "timeout": c["get_timeouts"], "skipped": c["skipped"]},
                "store_puts": {"stored": c["puts"], "failed": c["put_failures"], "dropped": c["put_dropped"]},
                "store_get_seconds": self.get_seconds.snapshot()}

    def close(self) -> list:
        """Stop the threads and close the client, each within CLOSE_S (see Closing); the
        tokens of every put not done (their views are no longer read)."""
        with self.lock:  # a client the connecting thread sets up from now on is not published
            self.closing.set()
            self.wake_get.notify_all()
            self.wake_put.notify_all()
        end = time.monotonic() + CLOSE_S
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        left = self.done() + [token for _, _, token in self.put_queue]
        self.put_queue.clear()
        client, self.client = self.client, None
        if self.threads[0].is_alive():  # inside the client's set-up (or about to be)
            ABANDONED.append(self.connecting)
        if client is None:
            return left
        if not self._master_answers(client, end):
            log.warning("store: the master at %s does not answer: leaving without unmounting this "
                        "worker's segment (the master drops it when the client's lease lapses)",
                        self.settings.master)
            ABANDONED.append(client)
            return left
        try:
            client.close()  # unmounts this worker's segment: its entries leave the store
        except Exception as e:
            log.warning("store: closing the client: %s", e)
        return left

    @staticmethod
    def _master_answers(client, end: float) -> bool:
        """Whether a lookup of the master's is answered by `end` (on a thread: a lookup,
        unlike a close, lets the GIL go while it waits)."""
        got: list = []
        probe = threading.Thread(target=lambda: got.append(client.is_exist(PROBE_NAME)),
                                 name="store-close-probe", daemon=True)
        probe.start()
        probe.join(max(0.0, end - time.monotonic()))
        return bool(got) and got[0] >= 0  # 0 or 1; an error is negative

    # -- the threads -------------------------------------------------------

    def digest(self, name: str, rows) -> bytes:
        h = blake3.blake3(key=self.secret)
        h.update(b"epd-store-value|" + name.encode() + b"|")
        h.update(rows)
        return h.digest()

    def _connect(self) -> None:
        s = self.settings
        host, _, port = s.master.rpartition(":")
        while not self.closing.is_set():
            try:
                socket.create_connection((host, int(port)), timeout=RETRY_S).close()
            except OSError:
                self.closing.wait(RETRY_S)
                continue
            if self.closing.is_set():
                return
            try:
                client = self.connecting = self.client_factory()
                with mooncake_log.quiet_setup():
                    rc = client.setup(s.hostname, s.metadata, s.segment_bytes, s.buffer_bytes, s.protocol,
                                      s.device, s.master)
                if rc == 0:
                    rc = client.register_buffer(self.buffer.ctypes.data, self.buffer.nbytes)
            except Exception as e:  # not installed, a setting it refuses: said once, local tiers only
                log.error("store: cannot set up a Mooncake Store client (%s); serving without the store", e)
                return
            with self.lock:
                if self.closing.is_set():  # close has abandoned it (self.connecting)
                    return
                self.connecting = None
                if rc == 0:
                    self.client = client
            if rc == 0:
                log.info("store: connected to the master at %s", s.master)
                return
            log.warning("store: setting up the client against %s failed (%s); trying again", s.master, rc)
            self.closing.wait(RETRY_S)

    def _get_loop(self) -> None:
        while True:
            with self.lock:
                while not self.get_queue and not self.closing.is_set():
                    self.wake_get.wait()
                if self.closing.is_set():
                    return
                seq, name, nbytes, asked_at = self.get_queue.popleft()
            started = time.monotonic()
            if started - asked_at > self.settings.get_timeout_s:
                continue  # the stage has given up on it (a miss): no call to make
            self.calling_since = started
            try:
                value = self._get(name, nbytes)
            except Exception as e:  # a client that raises is a failure, never the stage's
                log.warning("store: get failed: %s", e)
                self.counts["get_failures"] += 1
                value = None
            self.calling_since = None
            self.got.append((seq, value, time.monotonic() - started))

    def _get(self, name: str, nbytes: int):
        """The rows, or None. Copied out of the buffer before their digest is checked: a
        registered buffer is open to writes through the client's data port."""
        buf = self.buffer
        size = self.client.get_into(name, buf.ctypes.data, buf.nbytes)
        if size == NOT_FOUND:
            self.counts["misses"] += 1
            return None
        if size < 0:  # the call failed (the master gone), or a value larger than the buffer
            self.counts["get_failures"] += 1
            return None
        if size != nbytes + DIGEST_BYTES:
            self.counts["rejected"] += 1
            return None
        value = buf[:size].copy()
        rows = value[:nbytes]
        if value[nbytes:].tobytes() != self.digest(name, rows):
            self.counts["rejected"] += 1
            return None
        self.counts["hits"] += 1
        return rows

    def _put_loop(self) -> None:
        while True:
            with self.lock:
                while not self.put_queue and not self.closing.is_set():
                    self.wake_put.wait()
                if self.closing.is_set():
                    return
                queued = list(self.put_queue)
                self.put_queue.clear()
            # Copies of every queued view first, so their leases go back now, not after calls
            # that a stalled master may hold.
            copies = []
            for name, view, token in queued:
                copies.append((name, np.frombuffer(view, np.uint8).copy()))
                self.put_done.append(token)
            del queued, view
            for name, rows in copies:
                self.putting_since = time.monotonic()
                try:
                    rc = self.client.put_parts(name, rows, self.digest(name, rows))
                except Exception as e:
                    log.warning("store: put failed: %s", e)
                    rc = -1
                self.putting_since = None
                self.counts["puts" if rc == 0 else "put_failures"] += 1


def _mooncake_client():
    mooncake_log.set_level_before_loading()
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()
