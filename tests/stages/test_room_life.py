"""The sender's room life (stages/room_life.py): every transition from every phase does
what docs/design.md's table says, an impossible one changes nothing and is named, and
the container's indexes always agree with the lives they index."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stages.room_life import FAILING, FENCED, GONE, LIVE, OPEN, OPENING, WRITING, Phase, RoomLives, Write
from stages.room_life import W as WAITING


class Alloc:  # what a life keeps of an alloc: the receiver, for take_held
    receiver = "rx"


def _write() -> Write:
    return Write(item=0, receiver="rx", pending=None, started=0.0, digest=b"")


# Each transition: its call, and the phase it leads to from each phase that allows it.
TRANSITIONS = {
    "hold": (lambda life: life.hold((0.0, Alloc(), 0)), {WAITING: WAITING, FENCED: WAITING}),
    "keep_early": (lambda life: life.keep_early(object()), {WAITING: WAITING, FENCED: FENCED}),
    "fence_unopened": (lambda life: life.fence_unopened(0.0), {WAITING: FENCED, FENCED: FENCED}),
    "open": (lambda life: life.open(3, (4, 4)), {WAITING: OPENING, FENCED: OPENING}),
    "opened": (lambda life: life.opened(), {OPENING: OPEN}),
    "wrote": (lambda life: life.wrote(_write()), {OPENING: OPENING, OPEN: WRITING, WRITING: WRITING}),
    "fail": (lambda life: life.fail(), {OPENING: FAILING, OPEN: FAILING, WRITING: FAILING}),
    "conclude": (lambda life: life.conclude(0.0), {FAILING: FENCED}),
    "succeed": (lambda life: life.succeed(), {OPEN: GONE, WRITING: GONE}),
}

# How a new room reaches each phase.
PATHS = {
    WAITING: ["hold"],
    FENCED: ["fence_unopened"],
    OPENING: ["open"],
    OPEN: ["open", "opened"],
    WRITING: ["open", "opened", "wrote"],
    FAILING: ["open", "opened", "fail"],
    GONE: ["open", "opened", "succeed"],
}


def _life_in(phase: Phase, lives: RoomLives, room: int = 1):
    life = lives.life(room)
    for step in PATHS[phase]:
        assert TRANSITIONS[step][0](life), (step, life.fault)
    assert life.phase is phase
    return life


@pytest.mark.parametrize("phase", list(PATHS), ids=lambda p: p.value)
@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_each_transition_from_each_phase(phase, name):
    lives = RoomLives(max_fenced=8)
    life = _life_in(phase, lives)
    call, allowed = TRANSITIONS[name]
    moved = call(life)
    if phase in allowed:
        assert moved and not life.fault
        assert life.phase is allowed[phase]
    else:  # impossible: refused, named, and nothing changed
        assert not moved and life.phase is phase
        assert life.fault.startswith("sender: impossible transition of room 1: ") and phase.value in life.fault
    _check_indexes(lives)


def test_opened_while_failing_before_custody_ends_failing_in_custody():
    # A room failed while its RoomOpened was being handled: the handling's end keeps it failing.
    lives = RoomLives(max_fenced=8)
    life = _life_in(OPENING, lives)
    assert life.wrote(_write()) and life.fail()
    assert life.opened() and life.phase is FAILING and life.in_custody
    assert not life.opened() and life.phase is FAILING  # only once


def test_writes_collected_take_a_writing_room_back_to_open():
    lives = RoomLives(max_fenced=8)
    life = _life_in(WRITING, lives)
    assert 1 in lives.writing
    life.polled([])
    assert life.phase is OPEN and 1 not in lives.writing and 1 in lives.live


def test_remembered_fences_are_bounded_oldest_first():
    lives = RoomLives(max_fenced=3)
    for room in range(5):
        assert lives.life(room).fence_unopened(float(room))
    assert list(lives.fenced) == [2, 3, 4]
    assert lives.get(0) is None and lives.get(1) is None  # nothing else held: forgotten
    _check_indexes(lives)


ROOMS = st.integers(0, 3)
STEPS = st.lists(st.tuples(ROOMS, st.sampled_from(sorted(TRANSITIONS) + ["polled", "take_held", "take_early",
                                                                         "forget_fence"])), max_size=60)


@given(STEPS)
def test_any_sequence_keeps_the_indexes_true(steps):
    """Whatever the sender asks, in any order: a refused transition leaves its phase, and
    every index names exactly the lives it should."""
    lives = RoomLives(max_fenced=2)
    for room, name in steps:
        life = lives.life(room)
        before = life.phase
        if name == "polled":
            life.polled([])
        elif name == "take_held":
            life.take_held()
        elif name == "take_early":
            life.take_early()
        elif name == "forget_fence":
            life.forget_fence()
        else:
            call, allowed = TRANSITIONS[name]
            moved = call(life)
            assert moved == (before in allowed), (name, before)
            if not moved:
                assert life.phase is before
        _check_indexes(lives)


def _check_indexes(lives: RoomLives) -> None:
    for room, life in lives.by_room.items():
        assert life.room == room and life.phase is not GONE
        assert (room in lives.live) == (life.phase in LIVE)
        assert (room in lives.holding) == bool(life.held)
        assert (room in lives.waiting) == bool(life.early)
        assert (room in lives.fenced) == (life.fenced_at is not None)
        assert (room in lives.writing) == (bool(life.writes) and life.phase in LIVE)
        if life.phase is WAITING:
            assert life.held or life.early or life.fenced_at is not None, "an empty waiting life is kept"
    for index in (lives.live, lives.holding, lives.waiting, lives.fenced, lives.writing):
        assert set(index) <= set(lives.by_room)
    assert len(lives.fenced) <= lives.max_fenced
