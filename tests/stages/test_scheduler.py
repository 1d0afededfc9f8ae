"""The scheduler's batch queue (FIFO determinism, budgets, maximal batches, room removal,
backpressure) and the scheduler stage (credits, replicas)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipc import shm
from ipc.arena import Arena
from stages.records import (OWNER_CACHE, OWNER_SCHEDULER, RoomAbandoned, TowerCredit, TowerDown, TowerRestarted,
                            WorkItem)
from stages.batch_queue import BatchQueue, Entry
from stages.scheduler import SchedulerStage

budgets = st.tuples(st.integers(1, 64), st.integers(1, 8))


@st.composite
def arrivals(draw, max_size=60):
    """Entries with unique (room, item); seqs may tie, arrive in any order."""
    n = draw(st.integers(0, max_size))
    out = []
    seen = set()
    for _ in range(n):
        room = draw(st.integers(0, 5))
        item = draw(st.integers(0, 20))
        if (room, item) in seen:
            continue
        seen.add((room, item))
        seq = draw(st.integers(0, 30))
        tokens = draw(st.one_of(st.integers(1, 20), st.integers(0, 100)))
        out.append(Entry(seq, room, item, tokens, payload=("p", room, item)))
    return draw(st.permutations(out))


def drain(s: BatchQueue, reserve=None) -> list[list[Entry]]:
    batches = []
    while len(s):
        b = s.next_batch(reserve)
        assert b, "a non-empty queue with a permissive reserve must give a batch"
        batches.append(b)
    assert s.next_batch() == []
    return batches


def check_batches(batches, max_tokens, max_items):
    for i, b in enumerate(batches):
        assert 1 <= len(b) <= max_items
        tokens = sum(p.tokens for p in b)
        if tokens > max_tokens:
            assert len(b) == 1, "only a lone oversize item may exceed the token budget"
            assert b[0].tokens > max_tokens
        if i + 1 < len(batches):
            nxt = batches[i + 1][0]
            assert len(b) == max_items or tokens + nxt.tokens > max_tokens, (
                "batch is not maximal: the next item would have fit"
            )


@given(arrivals(), budgets)
def test_batches_are_fifo_within_budget_and_maximal(items, budget):
    max_tokens, max_items = budget
    s = BatchQueue(max_tokens, max_items)
    for p in items:
        s.add(p)
    assert len(s) == len(items)
    assert s.pending_tokens() == sum(p.tokens for p in items)
    batches = drain(s)
    flat = [p for b in batches for p in b]
    assert flat == sorted(items)
    assert [p.payload for p in flat] == [p.payload for p in sorted(items)]
    check_batches(batches, max_tokens, max_items)
    assert len(s) == 0 and s.pending_tokens() == 0


@given(arrivals(), arrivals(), budgets, st.data())
def test_interleaved_adds_keep_order_of_what_is_pending(first, second, budget, data):
    """Adding while draining: each batch is the maximal sorted prefix of what is pending."""
    max_tokens, max_items = budget
    s = BatchQueue(max_tokens, max_items)
    model: list[Entry] = []
    keys = set()
    for p in first:
        s.add(p)
        model.append(p)
        keys.add((p.room, p.item))
    later = [p for p in second if (p.room, p.item) not in keys]
    while model or later:
        if later and data.draw(st.booleans()):
            p = later.pop()
            s.add(p)
            model.append(p)
            continue
        model.sort()
        b = s.next_batch()
        if not model:
            assert b == []
            continue
        assert b == model[: len(b)]
        rest = model[len(b):]
        check_batches([b] + ([[rest[0]]] if rest else []), max_tokens, max_items)
        model = rest
        assert len(s) == len(model)


@given(arrivals(), budgets, st.integers(0, 5))
def test_remove_room_removes_exactly_that_room(items, budget, room):
    s = BatchQueue(*budget)
    for p in items:
        s.add(p)
    gone = s.remove_room(room)
    assert gone == sorted(p for p in items if p.room == room)
    assert s.remove_room(room) == []
    assert room not in s.rooms()
    rest = sorted(p for p in items if p.room != room)
    assert len(s) == len(rest)
    assert s.pending_tokens() == sum(p.tokens for p in rest)
    flat = [p for b in drain(s) for p in b]
    assert flat == rest


@given(arrivals(), budgets, st.lists(st.booleans(), max_size=200))
def test_reserve_false_holds_back_the_same_batch(items, budget, answers):
    max_tokens, max_items = budget
    ref = BatchQueue(max_tokens, max_items)
    s = BatchQueue(max_tokens, max_items)
    for p in items:
        ref.add(p)
        s.add(p)
    reference = drain(ref)

    offered: list[list[Entry]] = []
    answers = list(answers)

    def reserve(batch):
        offered.append(list(batch))
        return answers.pop(0) if answers else True

    got = []
    refused = 0
    while len(s):
        before = len(s)
        b = s.next_batch(reserve)
        if not b:
            assert len(s) == before, "a refused batch must stay queued"
            refused += 1
            continue
        assert b == offered[-1]
        got.append(b)
    # With backpressure the released batches are exactly those without it.
    assert got == reference
    assert s.held_back == refused
    # Every refused offer was the very batch released next (it stayed at the head).
    i = 0
    for b in got:
        while i < len(offered) and offered[i] == b:
            i += 1
    assert i == len(offered)
    assert len(offered) == len(got) + refused


def test_reserve_false_returns_nothing_then_releases():
    s = BatchQueue(10, 4)
    for i, tokens in enumerate([4, 4, 4]):
        s.add(Entry(i, 1, i, tokens))
    assert s.next_batch(lambda b: False) == []
    assert s.held_back == 1
    assert len(s) == 3
    assert [p.item for p in s.next_batch(lambda b: True)] == [0, 1]
    assert [p.item for p in s.next_batch()] == [2]


def test_reserve_exception_keeps_batch_queued():
    s = BatchQueue(10, 4)
    s.add(Entry(0, 1, 0, 3))

    def boom(batch):
        raise RuntimeError("arena gone")

    with pytest.raises(RuntimeError):
        s.next_batch(boom)
    assert len(s) == 1
    assert s.next_batch()[0].item == 0


def test_oversize_entry_goes_alone():
    s = BatchQueue(10, 8)
    s.add(Entry(0, 0, 0, 3))
    s.add(Entry(1, 0, 1, 50))
    s.add(Entry(2, 0, 2, 3))
    assert [p.tokens for p in s.next_batch()] == [3]
    assert [p.tokens for p in s.next_batch()] == [50]
    assert [p.tokens for p in s.next_batch()] == [3]
    assert s.next_batch() == []


def test_ties_broken_by_room_then_item():
    s = BatchQueue(100, 100)
    for room, item in [(2, 0), (1, 1), (1, 0), (0, 5)]:
        s.add(Entry(7, room, item, 1))
    assert [(p.room, p.item) for p in s.next_batch()] == [(0, 5), (1, 0), (1, 1), (2, 0)]


def test_payload_not_compared():
    assert Entry(0, 0, 0, 1, payload=object()) == Entry(0, 0, 0, 1, payload=object())


@pytest.mark.parametrize(
    "tokens, items", [(0, 1), (1, 0), (-5, 3), (3, -1), (0, 0), (1.5, 2), (True, 2), ("8", 2)]
)
def test_invalid_budgets_refused(tokens, items):
    with pytest.raises(ValueError, match="must be"):
        BatchQueue(tokens, items)


def test_negative_tokens_refused():
    with pytest.raises(ValueError):
        BatchQueue(4, 4).add(Entry(0, 0, 0, -1))


# -- the scheduler stage: credits ------------------------------------------------------


@pytest.fixture
def arenas(shm_prefix):
    run_id = shm.new_run_id()
    pixels = Arena.create(shm_prefix, run_id, "pixels", 64 * 1024, block_size=64)
    emb = Arena.create(shm_prefix, run_id, "emb", 64 * 1024, block_size=64)
    try:
        yield pixels, emb
    finally:
        for a in (pixels, emb):
            a.close()
            a.unlink()


def test_restarted_tower_gives_credits_back_and_late_credits_stay_capped(arenas):
    pixel_arena, emb_arena = arenas
    depth = 2
    batches = []

    def emit(dest, rec):
        assert dest == "tower", f"unexpected record to {dest}: {rec!r}"
        batches.append(rec)

    stage = SchedulerStage(emit, queue=BatchQueue(max_tokens_per_batch=100, max_items_per_batch=1),
                           pixel_arena=pixel_arena, emb_arena=emb_arena, entry_bytes=lambda span: 64 * span,
                           custody=None, depth=depth)

    def flowed() -> int:
        stage.tick(0.0)
        n = len(batches)
        for batch in batches:  # the tower's part: done with them
            for w in batch.items:
                pixel_arena.drop(w.pixels, OWNER_SCHEDULER)
                emb_arena.drop(w.out, OWNER_SCHEDULER)
        batches.clear()
        return n

    for i in range(8):  # eight one-item batches of room 1 from the cache
        stage.handle("cache", WorkItem(slot=0, room=1, item=i, seq=i, modality="image", grid_thw=[[1, 1, 1]],
                                       pixel_dtype="float32", n_patches=1, patch_dim=1, span=1,
                                       pixels=pixel_arena.alloc(4, OWNER_CACHE)))
    assert flowed() == depth
    assert flowed() == 0, "no credits: both batches are out"
    stage.handle("tower", TowerRestarted(0))  # both batches died with the old tower
    assert flowed() == depth, "a restarted tower holds no batch: all credits are back"

    # Both out again; the tower restarts once more, but it had finished them just before
    # it died: their credits arrive after the reset.
    stage.handle("tower", TowerRestarted(0))
    for _ in range(depth):
        stage.handle("tower", TowerCredit(0))
    assert stage.credits == [depth]
    assert flowed() == depth, "never more than depth batches out"

    stage.handle("reaper", RoomAbandoned(1))  # drops what is still queued
    assert stage.stats()["scheduler_pending"] == 0
    assert pixel_arena.live_leases() == [] and emb_arena.live_leases() == [], "leases leaked"


def _replica_rig(arenas, towers, sent):
    pixel_arena, emb_arena = arenas
    stage = SchedulerStage(lambda dest, rec: sent.append((dest, rec)),
                           queue=BatchQueue(max_tokens_per_batch=100, max_items_per_batch=1),
                           pixel_arena=pixel_arena, emb_arena=emb_arena, entry_bytes=lambda span: 64 * span,
                           custody=None, depth=2, towers=towers)
    for i in range(12):
        stage.handle("cache", WorkItem(slot=0, room=1, item=i, seq=i, modality="image", grid_thw=[[1, 1, 1]],
                                       pixel_dtype="float32", n_patches=1, patch_dim=1, span=1,
                                       pixels=pixel_arena.alloc(4, OWNER_CACHE)))
    return stage


def _drop_sent(arenas, sent) -> list[tuple[str, int]]:
    """(tower, item) of each batch sent, its leases given back (the tower's part)."""
    pixel_arena, emb_arena = arenas
    out = []
    for dest, batch in sent:
        for w in batch.items:
            pixel_arena.drop(w.pixels, OWNER_SCHEDULER)
            emb_arena.drop(w.out, OWNER_SCHEDULER)
            out.append((dest, w.item))
    sent.clear()
    return out


def test_batches_go_to_the_replica_with_most_credit_and_none_to_one_that_is_down(arenas):
    towers = ("tower0", "tower1", "tower2")
    sent = []
    stage = _replica_rig(arenas, towers, sent)
    stage.tick(0.0)
    # most credit first, the lowest number on a tie: round the replicas, twice
    assert _drop_sent(arenas, sent) == [(towers[i % 3], i) for i in range(6)]
    stage.handle("tower1", TowerCredit(1))
    stage.handle("tower2", TowerCredit(2))
    stage.handle("tower2", TowerCredit(2))
    stage.tick(0.0)
    assert _drop_sent(arenas, sent) == [("tower2", 6), ("tower1", 7), ("tower2", 8)]
    stage.handle("tower0", TowerCredit(0))
    stage.handle("tower0", TowerDown(0))  # died: its credit is gone with it
    stage.handle("tower1", TowerCredit(1))
    stage.tick(0.0)
    assert _drop_sent(arenas, sent) == [("tower1", 9)]
    stage.handle("tower0", TowerRestarted(0))  # its successor is up
    stage.tick(0.0)
    assert _drop_sent(arenas, sent) == [("tower0", 10), ("tower0", 11)]
    assert arenas[0].live_leases() == [] and arenas[1].live_leases() == [], "leases leaked"


def test_replica_choice_is_deterministic(arenas):
    """The same arrivals and the same completions give the same batches to the same replicas."""
    runs = []
    for _ in range(2):
        sent = []
        stage = _replica_rig(arenas, ("tower0", "tower1"), sent)
        got = []
        for k in range(6):
            stage.tick(0.0)
            got += _drop_sent(arenas, sent)
            stage.handle(f"tower{k % 2}", TowerCredit(k % 2))
        stage.handle("reaper", RoomAbandoned(1))
        runs.append(got)
    assert runs[0] == runs[1] and len(runs[0]) == 9


def test_a_part_batch_waits_while_every_replica_computes(arenas):
    """An idle replica takes whatever is pending (latency); while every replica computes,
    a batch goes only once it is full (a part batch would only wait behind that work, and
    smaller batches cost the tower more per item)."""
    pixel_arena, emb_arena = arenas
    sent = []
    stage = SchedulerStage(lambda dest, rec: sent.append((dest, rec)),
                           queue=BatchQueue(max_tokens_per_batch=100, max_items_per_batch=3),
                           pixel_arena=pixel_arena, emb_arena=emb_arena, entry_bytes=lambda span: 64 * span,
                           custody=None, depth=2)
    seq = itertools.count()

    def arrive(n):
        for _ in range(n):
            i = next(seq)
            stage.handle("cache", WorkItem(slot=0, room=1, item=i, seq=i, modality="image", grid_thw=[[1, 1, 1]],
                                           pixel_dtype="float32", n_patches=1, patch_dim=1, span=1,
                                           pixels=pixel_arena.alloc(4, OWNER_CACHE)))
        stage.tick(0.0)
        return [[w.item for w in batch.items] for _, batch in sent]

    assert arrive(1) == [[0]], "an idle tower takes a part batch at once"
    assert arrive(2) == [[0]] and stage.next_tick_in(0.0) is None, "computing: two of three wait, no polling"
    assert arrive(1) == [[0], [1, 2, 3]], "full: it goes"
    assert arrive(2) == [[0], [1, 2, 3]], "no credit left"
    stage.handle("tower", TowerCredit(0))
    stage.tick(0.0)
    assert len(sent) == 2, "one batch still computing: the part batch keeps waiting"
    stage.handle("tower", TowerCredit(0))
    stage.tick(0.0)
    assert [[w.item for w in b.items] for _, b in sent][2:] == [[4, 5]], "idle again: what there is goes"
    _drop_sent(arenas, sent)
    assert arenas[0].live_leases() == [] and arenas[1].live_leases() == [], "leases leaked"


def test_the_stage_is_built_from_its_settings_alone():
    """No configuration of the worker's: its own settings type and the run's objects."""
    from types import SimpleNamespace

    from stages import scheduler
    from stages.settings import SchedulerSettings

    env = SimpleNamespace(spec=SimpleNamespace(row_bytes=256),
                          shared=SimpleNamespace(pixel_arena=None, emb_arena=None))
    stage = scheduler.build(env, SchedulerSettings(max_tokens_per_batch=64, max_items_per_batch=2, tower_replicas=2),
                            "scheduler", lambda dest, rec: None, None)
    assert (stage.queue.max_tokens_per_batch, stage.queue.max_items_per_batch) == (64, 2)
    assert stage.towers == ["tower0", "tower1"]
