"""Load progress, from a stage that loads for long (a tower reading its weights and
building its layers) to the supervisor, which gives up on a start only when it stops
progressing (pipeline/runtime/starts.py).

A loader calls `report()` at each step it completes (a tensor read, a layer built);
the stage's process installs the reporter, which moves the stage's heartbeat on. In a
process with no reporter (the in-process worker, a test), `report()` does nothing.
"""
from __future__ import annotations

from typing import Callable

_reporter: Callable[[], None] | None = None


def set_reporter(reporter: Callable[[], None] | None) -> None:
    global _reporter
    _reporter = reporter


def report() -> None:
    """One more step of the load done."""
    if _reporter is not None:
        _reporter()
