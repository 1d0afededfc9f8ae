"""Memory ordering between the processes that share a ring: acquire loads, release stores, a fence.

A ring's producer writes a record (and, before pushing it, the arena bytes the record
points at) and only then stores the new ``head``; the consumer loads ``head`` and only
then reads the record.  x86-64 (TSO) keeps such stores in order and such loads in
order by itself; a weakly ordered CPU such as aarch64 (NVIDIA Grace) does not: there a
consumer could see the new ``head`` before the bytes it covers, and read a record of
the lap before, or garbage.  So every pair that must stay in order says so:

- ``Words.store_release(i, v)``: every load and store of this thread before it is
  visible before word ``i`` is (a producer's ``head``, a consumer's ``tail``);
- ``Words.load_acquire(i)``: no load or store of this thread after it happens before
  it (a consumer's ``head``, a producer's ``tail``);
- ``fence()``: a full barrier, the only one that keeps a store before a later load of
  another word (the sleepers' handshake, Dekker's pattern).

The call sites are in ipc/ring.py and ipc/sleepers.py, each with the pair it orders.

They are the C compiler's ``__atomic`` builtins in ``ipc._ordering`` (ipc/ordering.c,
a small extension built at install): plain moves and a ``lock``-prefixed fence on
x86-64, ``ldar``, ``stlr`` and ``dmb ish`` on aarch64; a call costs less than a
``memoryview`` item access.  (``ctypes`` into libatomic costs an order of magnitude more per call;
``threading.Lock`` as a fence orders a store before a later load only on x86.)  Where
the extension is not built, importing this module fails with how to build it: no ring
runs without its barriers.

``check_cpu()`` is the start-up guard (the runtime's, and ``Ring.create``'s): it
refuses a CPU for which these barriers have not been reasoned through
(``python -m ipc.litmus`` then checks a host).
"""

from __future__ import annotations

import platform

try:
    from ipc._ordering import LOCK_FREE_U64, Words, fence
except ImportError as exc:  # no unordered fallback: say how to build it
    raise ImportError(
        "ipc._ordering, the memory barriers the shared-memory rings need (ipc/ordering.c), is "
        "not built: run scripts/setup.sh, or `pip install -e .` in the project's environment "
        f"(it needs a C compiler and the Python headers): {exc}"
    ) from exc

__all__ = ["ORDERED_CPUS", "UnsupportedCPU", "Words", "check_cpu", "fence"]

# platform.machine() of the CPUs whose memory model the rings' barriers are written for:
# x86-64 (TSO: the barriers cost nothing) and aarch64 (weakly ordered: they are needed).
ORDERED_CPUS = {"x86_64": "x86-64", "AMD64": "x86-64", "aarch64": "aarch64", "arm64": "aarch64"}


class UnsupportedCPU(RuntimeError):
    """The shared-memory rings' memory ordering is not in place on this CPU."""


def check_cpu() -> str:
    """The CPU's architecture if the rings' barriers are in place for it; else UnsupportedCPU,
    with why.  Call it before any ring or shared table is made."""
    machine = platform.machine()
    if machine not in ORDERED_CPUS:
        raise UnsupportedCPU(
            f"refusing to start on a {machine or 'unknown'} CPU: the shared-memory rings order "
            f"their records with barriers written for {', '.join(sorted(set(ORDERED_CPUS.values())))} "
            "only; on another memory model a stage could read a record before its bytes arrive. "
            "To support it, reason the barriers through for its memory model, add it to "
            "ipc.ordering.ORDERED_CPUS, then check this host with `python -m ipc.litmus`."
        )
    if not LOCK_FREE_U64:
        raise UnsupportedCPU(
            f"refusing to start: 8-byte atomics are not lock-free on this {machine} build, so the "
            "rings' barriers would take a lock private to each process and order nothing between them"
        )
    return ORDERED_CPUS[machine]
