"""Shared test fixtures: every test gets its own shm prefix and must leave /dev/shm clean."""
from __future__ import annotations

import itertools
import os
import secrets

import pytest
from hypothesis import HealthCheck, settings

from ipc import shm

# Before any test module imports grpc, which reads it at import: see pipeline/runtime/supervisor.py.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# Profiles: `ci` (CI set: fixed examples, derandomized so a run is reproducible), `dev`
# (the default: random), `stress` (pick it with --hypothesis-profile=stress: 20x dev's
# examples, for a long soak; the state machines of test_protocol_model.py scale their
# own, more expensive, examples down from these counts).
settings.register_profile(
    "ci", deadline=None, max_examples=50, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("stress", deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

_counter = itertools.count()
# One token per test session (xdist workers inherit it): prefixes carry it, so the
# end-of-session check sees this session's objects and not another's running beside it.
# (Not EPD_*: those are the worker's settings, and run.py rejects unknown ones.)
TOKEN = os.environ.setdefault("TEST_SHM_TOKEN", secrets.token_hex(2))


def _shm_entries() -> set[str]:
    return set(os.listdir(shm.SHM_DIR))


@pytest.fixture
def shm_prefix():
    """A prefix no other test (or xdist worker) uses; the test must leave nothing under it."""
    prefix = f"t{TOKEN}_{os.getpid()}_{next(_counter)}"
    yield prefix
    left = shm.list_objects(prefix)
    shm.sweep(prefix, include_live=True)
    assert not left, f"test left shared-memory objects behind: {left}"


def pytest_collection_modifyitems(session, config, items):
    # xdist hands tests out in this order: the longest first, not last beside an idle worker.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_sessionstart(session):
    session.config._shm_before = _shm_entries()


def pytest_sessionfinish(session, exitstatus):
    # Under xdist this runs in each worker and in the controller; the controller's
    # check, after all workers have exited, is the one that sees every test.
    if hasattr(session.config, "workerinput"):
        return
    new = sorted(e for e in _shm_entries() - session.config._shm_before if f"t{TOKEN}_" in e)
    if new:
        print(f"\n/dev/shm holds new entries after the test session: {new}")
        session.exitstatus = 1


@pytest.fixture(params=["inprocess", "pipeline"])
def mode(request):
    """Each of the worker's two modes, for a test that runs in both."""
    return request.param


@pytest.fixture
def made():
    """Call it with what a test starts: each is closed at the end, newest first, whatever
    the test did."""
    objs = []
    yield objs.append
    for obj in reversed(objs):
        obj.close()


@pytest.fixture
def worker_rig(shm_prefix, tmp_path):
    """A factory of a worker (`mode`, its settings `sim_config`'s from `over`, its tower
    `tower_obj` if given), a client of it and a receiver of each of `names`, all closed at
    the test's end, newest first. It returns the worker, the client and the list of
    receivers; `worker_rig.made` is what it closes, for what else a test wants closed
    with them."""
    from pipeline.peers.client import Client
    from pipeline.peers.receiver import Receiver
    from pipeline.testing.workers import sim_config, start_worker

    made = []

    def start(mode: str, *, names=("rx",), buffer_bytes: int = 64 << 20, tower_obj=None, **over):
        w = start_worker(mode, sim_config(shm_prefix, tmp_path, **over), tower=tower_obj)
        made.append(w)
        client = Client(w.cfg.intake, shm_prefix)
        made.append(client)
        rx = []
        for name in names:  # each closed at the end even if the next one fails to start
            rx.append(Receiver(name, w.cfg.bootstrap, buffer_bytes=buffer_bytes))
            made.append(rx[-1])
        return w, client, rx

    start.made = made
    yield start
    for obj in reversed(made):
        obj.close()


@pytest.fixture
def root_logger():
    """The root logger, its handlers and level put back after the test."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)
