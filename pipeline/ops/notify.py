"""The systemd notify protocol (sd_notify(3)), spoken by `run.py serve`'s main process.

A service manager that wants to hear from the worker (systemd with `Type=notify`, or
anything that speaks the same protocol) sets `NOTIFY_SOCKET` to a datagram socket:
a path, or a name in Linux's abstract namespace when it starts with "@". Each
notification is one datagram of newline-separated `KEY=value` lines: `READY=1` once
the worker can take requests, `STATUS=...` for `systemctl status`, `WATCHDOG=1` as a
keep-alive, `STOPPING=1` when a drain begins. `WATCHDOG_USEC` asks for keep-alives
(systemd's `WatchdogSec=`): they go out every half of it, as sd_watchdog_enabled(3)
advises, and only while every stage's heartbeat is fresher than that, so a hung stage
stops them and the manager's own watchdog can act. `WATCHDOG_PID`, when set, names
the one process the keep-alives are asked of.

The protocol is one datagram per notification, so it is written here rather than
taken from a library (sdnotify is unmaintained since 2017; systemd-python needs
libsystemd's headers to build).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Mapping

log = logging.getLogger("epd.notify")

_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Notifications to the service manager; every method is a no-op without one.

    `environ` None: the process environment, from which the three variables are then
    removed (as sd_notify's unset_environment does), so that stage processes and the
    libraries they load, which inherit the environment, cannot speak for the worker:
    the manager hears from the supervisor alone, the main PID it started."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        env = dict(os.environ if environ is None else environ)
        if environ is None:
            for name in _ENV:
                os.environ.pop(name, None)
        path = env.get("NOTIFY_SOCKET", "")
        self.address = ("\0" + path[1:]) if path.startswith("@") else (path or None)
        self.watchdog_s = _watchdog_interval(env)
        self._ready = False
        self._pinged_at = None
        self._withheld = ""
        self._failing = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def is_ready(self) -> bool:
        """Whether READY=1 has gone out: STATUS= is then the supervisor's to keep current."""
        return self._ready

    def send(self, *lines: str) -> bool:
        """One notification of `KEY=value` lines; False if there is no manager or it failed."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto("\n".join(lines).encode(), self.address)
        except OSError as e:
            if not self._failing:  # once per outage: a keep-alive goes out every few seconds
                log.warning("cannot notify the service manager at NOTIFY_SOCKET (%s): %s",
                            self.address.replace("\0", "@"), e)
            self._failing = True
            return False
        self._failing = False
        return True

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={_one_line(text)}")

    def ready(self, text: str = "ready") -> bool:
        self._ready = True
        return self.send("READY=1", f"STATUS={_one_line(text)}")

    def stopping(self, text: str = "draining") -> bool:
        return self.send("STOPPING=1", f"STATUS={_one_line(text)}")

    def watchdog(self, heartbeat_ages: Mapping[str, float | None], now: float | None = None) -> bool:
        """Called from the supervisor's loop, as often as it turns: sends `WATCHDOG=1` when
        half of `WATCHDOG_USEC` has passed since the last one and every stage's heartbeat
        (seconds since it beat; None for a stage not running, e.g. being restarted) is
        younger than that half. None before `ready()`: the manager arms its watchdog at
        READY=1, and stages still starting have no heartbeat. True if it sent one."""
        if self.address is None or self.watchdog_s is None or not self._ready:
            return False
        now = time.monotonic() if now is None else now
        if self._pinged_at is not None and now - self._pinged_at < self.watchdog_s:
            return False
        stale = sorted(name for name, age in heartbeat_ages.items()
                       if age is None or age >= self.watchdog_s)
        if stale:
            why = ", ".join(stale)
            if why != self._withheld:
                log.warning("watchdog keep-alives withheld: no fresh heartbeat from %s", why)
                self._withheld = why
            return False
        if self._withheld:
            log.info("watchdog keep-alives resumed: every stage's heartbeat is fresh")
            self._withheld = ""
        self._pinged_at = now
        return self.send("WATCHDOG=1")


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half of WATCHDOG_USEC in seconds, or None when no keep-alives are asked of this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2e6


def _one_line(text: str) -> str:
    return " ".join(text.split())
