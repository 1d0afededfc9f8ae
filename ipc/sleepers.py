"""Sleeping until a shared-memory index moves, and waking such sleepers: ipc.ring's handshake.

The indices in shared memory are the truth; semaphores (posix_ipc) only wake
sleepers.  A side with nothing to do stores a "waiting" flag word (carrying a
ticket number), issues a full fence, re-checks the other side's index, and only
then waits on its semaphore, for at most ``WAIT_SLICE`` seconds at a time.  The
other side, after storing its index, issues a full fence, loads the flag, and posts
only if the sleeper is waiting and it has not posted for that ticket yet: at most
one post per sleep, however many records follow.  That is Dekker's pattern: every
CPU, x86-64 (TSO) included, lets a store be reordered with a later load of another
location, so without the fences each side's store could still sit in its store
buffer while it loads the other's stale value, both would miss each other, and the
sleeper would sleep a whole slice.  The fence is ipc.ordering's, a full barrier (a
``lock``-prefixed instruction on x86-64, ``dmb ish`` on aarch64); a lock's acquire
and release would not do, being on a weakly ordered CPU only an acquire and a
release, which keep no store before a later load.  Sleepers re-check the indices
after every wake-up and every slice, so a lost post costs at most one slice and an
extra post one spurious re-check; neither can hang a sleeper or conjure a record.

A consumer of several rings may give them all one "doorbell" semaphore of its own
in place of their data semaphores, and sleep on it in ``wait_any``.

Each function takes the ``'Q'`` view of the header words and the indices of the
words it uses, so the layout stays the ring's.
"""

from __future__ import annotations

import time

import posix_ipc

from ipc.ordering import fence

__all__ = ["WAIT_SLICE", "sleep_until", "wait_any", "wake"]

WAIT_SLICE = 0.1  # longest single semaphore wait; sleepers re-check the indices after each

_monotonic = time.monotonic
_BusyError = posix_ipc.BusyError
_SignalError = posix_ipc.SignalError


def wake(q, flag: int, posted_for: int, sem, posts: int) -> int:
    """The waker's half, called right after its index store: post ``sem`` if the
    ``flag`` word says the other side sleeps and no post went to that ticket yet
    (counted in word ``posts``).  Returns the flag value posted for."""
    fence()  # the index store (a release store, not enough alone) before the flag load
    f = q[flag]
    if f & 1 and f != posted_for:
        sem.release()
        q[posts] += 1
        return f
    return posted_for


def sleep_until(q, ready, timeout: float | None, flag: int, sleeps: int, sem) -> bool:
    """The sleeper's half: raise the ``flag`` word, fence, re-check ``ready()``, and only
    then sleep on ``sem``, a slice at a time, re-checking after every wake-up (each
    sleep counted in word ``sleeps``).  False once ``timeout`` has passed (None: never)."""
    if ready():
        return True
    if timeout is not None:
        if timeout <= 0:
            return False
        deadline = _monotonic() + timeout
    while True:
        ticket = (q[flag] >> 1) + 1
        q[flag] = (ticket << 1) | 1
        fence()  # the flag store before the index load
        if ready():
            q[flag] = ticket << 1
            return True
        if timeout is None:
            wait = WAIT_SLICE
        else:
            wait = deadline - _monotonic()
            if wait <= 0:
                q[flag] = ticket << 1
                return False
            if wait > WAIT_SLICE:
                wait = WAIT_SLICE
        q[sleeps] += 1
        try:
            sem.acquire(wait)
        except (_BusyError, _SignalError):
            pass
        q[flag] = ticket << 1
        if ready():
            return True


def wait_any(views: list, doorbell, timeout: float, head: int, tail: int, flag: int) -> bool:
    """Sleep until one of ``views`` has word ``head`` != word ``tail``, or ``timeout``
    seconds pass; each wakes ``doorbell`` through its ``flag`` word.  The sleeper's half
    for all of them at once: flag every one, fence, re-check every one, and only then
    sleep on the shared doorbell."""
    for q in views:
        if q[head] != q[tail]:
            return True
    if timeout <= 0:
        return False
    tickets = []
    for q in views:
        ticket = (q[flag] >> 1) + 1
        q[flag] = (ticket << 1) | 1
        tickets.append(ticket)
    fence()  # the flag stores before the index loads
    try:
        for q in views:
            if q[head] != q[tail]:
                return True
        try:
            doorbell.acquire(min(timeout, WAIT_SLICE))
        except (_BusyError, _SignalError):
            pass
        return any(q[head] != q[tail] for q in views)
    finally:
        for q, ticket in zip(views, tickets):
            q[flag] = ticket << 1
