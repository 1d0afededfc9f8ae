"""The stages: their names, the module that builds each, and the roles a runtime needs.

A new stage is a module with `build(env, settings, name, emit, custody)`, a line here,
its settings type in stages/settings.py (mapped from the configuration in
pipeline/runtime/stage_settings.py), its edges in pipeline/runtime/wiring.py and its
records in stages/records.py.

The stage list depends on two settings, `tower_replicas` and `preprocess_workers`:
one tower is the stage `tower`, N > 1 are `tower0` .. `tower{N-1}` (one process, one
GPU, one owner number each); likewise one preprocess stage is `preprocess`, N > 1 are
`preprocess0` .. `preprocess{N-1}`. Everything keyed by stage (heartbeats, counters,
metrics, `run.py status`, `numa`) uses these names; `tower` and `preprocess` in the
wiring and the records table stand for every replica and every worker.
"""
from stages.records import (INTAKE, CACHE, PREPROCESS, SCHEDULER, TOWER, SENDER, REAPER,  # noqa: F401 (route by these)
                            SUPERVISOR, OWNER_CACHE, OWNER_INTAKE, OWNER_PREPROCESS, OWNER_REAPER,
                            OWNER_SCHEDULER, OWNER_SENDER, OWNER_TOWER, PreprocessDown, TowerDown)

# Replica k > 0 takes owner number OWNER_REAPER + k: the arenas have 16 owner slots
# (ipc/arena.py's max_owners) and the room table 31 custody bits.
MAX_TOWER_REPLICAS = 8
assert OWNER_REAPER + MAX_TOWER_REPLICAS - 1 < OWNER_PREPROCESS < 16
# Preprocess worker 0 is OWNER_PREPROCESS; worker k > 0 takes PREPROCESS_OWNERS_AT + k,
# past the 16 slots (owner 15 stays free for a stage to come): a run with more than one
# worker makes its arenas with more owner slots (pipeline/runtime/wiring.py's arena_owners),
# inside the room table's 32 custody bits. Independent of the tower replicas' numbers,
# so the two caps combine freely.
MAX_PREPROCESS_WORKERS = 8
PREPROCESS_OWNERS_AT = 15
assert PREPROCESS_OWNERS_AT + MAX_PREPROCESS_WORKERS - 1 < 32
MODULES = {INTAKE: "stages.intake", CACHE: "stages.cache", PREPROCESS: "stages.preprocess",
           SCHEDULER: "stages.scheduler", TOWER: "stages.tower", SENDER: "stages.sender", REAPER: "stages.reaper"}
# Each stage's arena owner id, which is also its custody bit in the room table.
OWNERS = {INTAKE: OWNER_INTAKE, CACHE: OWNER_CACHE, PREPROCESS: OWNER_PREPROCESS, SCHEDULER: OWNER_SCHEDULER,
          TOWER: OWNER_TOWER, SENDER: OWNER_SENDER, REAPER: OWNER_REAPER}
# The stage that takes new work: a drain stops it first.
REQUEST_STAGE = INTAKE


def _numbered(kind: str, n: int) -> list[str]:
    return [kind] if n == 1 else [f"{kind}{k}" for k in range(n)]


def _number_of(kind: str, name: str) -> int | None:
    if name == kind:
        return 0
    if name.startswith(kind) and name[len(kind):].isdigit():
        return int(name[len(kind):])
    return None


def tower_names(replicas: int) -> list[str]:
    return _numbered(TOWER, replicas)


def preprocess_names(workers: int) -> list[str]:
    return _numbered(PREPROCESS, workers)


def stage_names(replicas: int, workers: int = 1) -> list[str]:
    """In the order a round of the in-process loop visits them."""
    return [REAPER, SENDER, *tower_names(replicas), SCHEDULER, *preprocess_names(workers), CACHE, INTAKE]


def start_order(replicas: int, workers: int = 1) -> list[str]:
    """The towers start first: the others are built with their spec (row size, patch size)."""
    towers = tower_names(replicas)
    return towers + [s for s in stage_names(replicas, workers) if s not in towers]


def counts_of(stages: list[str]) -> tuple[int, int]:
    """(tower replicas, preprocess workers) of a run whose stages are `stages`."""
    return (sum(replica_of(s) is not None for s in stages), sum(worker_of(s) is not None for s in stages))


def replica_of(name: str) -> int | None:
    """The replica number of a tower stage (0 for `tower`); None for any other stage."""
    return _number_of(TOWER, name)


def worker_of(name: str) -> int | None:
    """The worker number of a preprocess stage (0 for `preprocess`); None for any other stage."""
    return _number_of(PREPROCESS, name)


def kind_of(name: str) -> str:
    """The stage's row in MODULES, OWNERS, the wiring and the records table."""
    return TOWER if replica_of(name) is not None else PREPROCESS if worker_of(name) is not None else name


def owner_of(name: str) -> int:
    k = replica_of(name)
    if k is not None:
        return OWNER_TOWER if k == 0 else OWNER_REAPER + k
    k = worker_of(name)
    if k is not None:
        return OWNER_PREPROCESS if k == 0 else PREPROCESS_OWNERS_AT + k
    return OWNERS[name]


def last_words(name: str) -> list[tuple[str, object]]:
    """What the supervisor writes on a dead stage's own output rings, in its place, before
    its successor starts: behind everything the dead one pushed, ahead of anything the
    successor will. A tower replica's: the scheduler sends it nothing until it is back. A
    preprocess worker's: the cache drops the count of items outstanding there and sends
    it none until it is back."""
    k = replica_of(name)
    if k is not None:
        return [(SCHEDULER, TowerDown(k))]
    k = worker_of(name)
    return [] if k is None else [(CACHE, PreprocessDown(k))]
