"""The stages: their names, the module that builds each, and the roles a runtime needs.

A new stage is a module with `build(env, emit, custody)`, a line here, its edges in
pipeline/wiring.py and its records in stages/records.py.
"""
from stages.records import (OWNER_CACHE, OWNER_INTAKE, OWNER_REAPER, OWNER_SCHEDULER, OWNER_SENDER,
                            OWNER_TOWER)

# In the order a round of the in-process loop visits them.
STAGES = ["reaper", "sender", "tower", "scheduler", "cache", "intake"]
MODULES = {"intake": "stages.intake", "cache": "stages.cache", "scheduler": "stages.scheduler",
           "tower": "stages.tower", "sender": "stages.sender", "reaper": "stages.reaper"}
# Each stage's arena owner id, which is also its custody bit in the room table.
OWNERS = {"intake": OWNER_INTAKE, "cache": OWNER_CACHE, "scheduler": OWNER_SCHEDULER,
          "tower": OWNER_TOWER, "sender": OWNER_SENDER, "reaper": OWNER_REAPER}
# The stage that takes new work: a drain stops it first.
REQUEST_STAGE = "intake"
# The tower starts first: the others are built with its spec (row size, patch size).
START_ORDER = ["tower"] + [s for s in STAGES if s != "tower"]
