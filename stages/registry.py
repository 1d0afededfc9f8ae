"""The stages: their names, the module that builds each, and the roles a runtime needs.

A new stage is a module with `build(env, name, emit, custody)`, a line here, its edges
in pipeline/runtime/wiring.py and its records in stages/records.py.

The stage list depends on one setting, `tower_replicas`: one tower is the stage
`tower`, N > 1 are `tower0` .. `tower{N-1}` (one process, one GPU, one owner number
each). Everything keyed by stage (heartbeats, counters, metrics, `run.py status`,
`numa`) uses these names; `tower` in the wiring and the records table stands for
every replica.
"""
from stages.records import (INTAKE, CACHE, PREPROCESS, SCHEDULER, TOWER, SENDER, REAPER,  # noqa: F401 (route by these)
                            SUPERVISOR, OWNER_CACHE, OWNER_INTAKE, OWNER_PREPROCESS, OWNER_REAPER,
                            OWNER_SCHEDULER, OWNER_SENDER, OWNER_TOWER, TowerDown)

# Replica k > 0 takes owner number OWNER_REAPER + k: the arenas have 16 owner slots
# (ipc/arena.py's max_owners) and the room table 31 custody bits.
MAX_TOWER_REPLICAS = 8
assert OWNER_REAPER + MAX_TOWER_REPLICAS - 1 < OWNER_PREPROCESS < 16
MODULES = {INTAKE: "stages.intake", CACHE: "stages.cache", PREPROCESS: "stages.preprocess",
           SCHEDULER: "stages.scheduler", TOWER: "stages.tower", SENDER: "stages.sender", REAPER: "stages.reaper"}
# Each stage's arena owner id, which is also its custody bit in the room table.
OWNERS = {INTAKE: OWNER_INTAKE, CACHE: OWNER_CACHE, PREPROCESS: OWNER_PREPROCESS, SCHEDULER: OWNER_SCHEDULER,
          TOWER: OWNER_TOWER, SENDER: OWNER_SENDER, REAPER: OWNER_REAPER}
# The stage that takes new work: a drain stops it first.
REQUEST_STAGE = INTAKE


def tower_names(replicas: int) -> list[str]:
    return [TOWER] if replicas == 1 else [f"{TOWER}{k}" for k in range(replicas)]


def stage_names(replicas: int) -> list[str]:
    """In the order a round of the in-process loop visits them."""
    return [REAPER, SENDER, *tower_names(replicas), SCHEDULER, PREPROCESS, CACHE, INTAKE]


def start_order(replicas: int) -> list[str]:
    """The towers start first: the others are built with their spec (row size, patch size)."""
    towers = tower_names(replicas)
    return towers + [s for s in stage_names(replicas) if s not in towers]


def replicas_of(n_stages: int) -> int:
    """The tower replicas of a run with `n_stages` stages."""
    return n_stages - len(stage_names(1)) + 1


def replica_of(name: str) -> int | None:
    """The replica number of a tower stage (0 for `tower`); None for any other stage."""
    if name == TOWER:
        return 0
    if name.startswith(TOWER) and name[len(TOWER):].isdigit():
        return int(name[len(TOWER):])
    return None


def kind_of(name: str) -> str:
    """The stage's row in MODULES, OWNERS, the wiring and the records table."""
    return TOWER if replica_of(name) is not None else name


def owner_of(name: str) -> int:
    k = replica_of(name)
    return OWNERS[name] if k is None else OWNER_TOWER if k == 0 else OWNER_REAPER + k


def last_words(name: str) -> list[tuple[str, object]]:
    """What the supervisor writes on a dead stage's own output rings, in its place, before
    its successor starts: behind everything the dead one pushed, ahead of anything the
    successor will. A tower replica's: the scheduler sends it nothing until it is back."""
    k = replica_of(name)
    return [] if k is None else [(SCHEDULER, TowerDown(k))]
