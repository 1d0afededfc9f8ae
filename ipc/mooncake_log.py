"""Mooncake's own log (glog, process wide) held to ours: the transfer engine (transport.py)
and the store client (stages/store_tier.py) load the same library and log through it.

The library reads MC_LOG_LEVEL once, when it is loaded (``set_level_before_loading``);
after that glog's FLAGS_minloglevel in the libglog it loaded is set directly, where it
can be found: quiet while an engine or a client is set up (``quiet_setup``), then the
level that follows this module's Python log level."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading

GLOG_INFO, GLOG_ERROR, GLOG_FATAL = 0, 2, 3

log = logging.getLogger("epd.mooncake")
# Set-ups in progress: the level is quiet until the last one ends (a store client's may
# take long against a master that does not answer, and an engine's must not wait for it).
_setups_lock = threading.Lock()
_setups = [0]
_found: list = []  # glog's level, once found (looked for again until then: the library may load later)


def set_level_before_loading() -> None:
    """MC_LOG_LEVEL for the library's load (INFO prints a line per transfer batch); where
    glog cannot be found later, this is what stays."""
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if log.isEnabledFor(logging.DEBUG) else "ERROR")


def glog_min_level() -> ctypes.c_int | None:
    """glog's FLAGS_minloglevel in the libglog the Mooncake library loaded (the wheel
    bundles one under a hashed name), or None where no such library is mapped."""
    if _found:
        return _found[0]
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "/libglog" in line})
    for path in paths:
        try:
            _found.append(ctypes.c_int.in_dll(ctypes.CDLL(path), "_ZN3fLI17FLAGS_minloglevelE"))
            return _found[0]
        except (OSError, ValueError):
            continue
    log.debug("glog not found among the loaded libraries: Mooncake logs at MC_LOG_LEVEL")
    return None


def following_level() -> int:
    """The glog level that follows this module's Python log level: everything Mooncake
    says at DEBUG, its errors (a failed write's detail, a master that does not answer)
    up to ERROR, nothing above."""
    if log.isEnabledFor(logging.DEBUG):
        return GLOG_INFO
    if log.isEnabledFor(logging.ERROR):
        return GLOG_ERROR
    return GLOG_FATAL


@contextlib.contextmanager
def quiet_setup():
    """Around a set-up of an engine or a store client, after the library is loaded. Every
    healthy one logs at error level ("Local segment descriptor not found", and the first
    in a process "WARNING: Logging before InitGoogleLogging() is written to STDERR"), and
    a store client a dozen INFO lines: above DEBUG nothing is let through, so an operator
    who greps for errors finds none."""
    level = glog_min_level()
    with _setups_lock:
        _setups[0] += 1
        if level is not None:
            level.value = GLOG_INFO if log.isEnabledFor(logging.DEBUG) else GLOG_FATAL
    try:
        yield
    finally:
        with _setups_lock:
            _setups[0] -= 1
            if level is not None and not _setups[0]:
                level.value = following_level()
