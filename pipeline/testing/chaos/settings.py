"""The chaos run's knobs: the workload's shape, how often things die, and the settings
of the worker under it."""
from __future__ import annotations

import dataclasses

HIDDEN, DEEPSTACK, DTYPE, MERGE = 256, 64, "bfloat16", 2
CANARY = 0xA5
QUARANTINE_S = 3.0
QUERY_AFTER_S = 2.0      # a receiver queries a room it heard nothing of for this long (protocol 1.1)
STATS_SETTLE_S = 2.0     # counters a stage publishes a few times a second: bound on waiting for them to clear
GRIDS = [("image", (1, 4, 4)), ("image", (1, 8, 8)), ("image", (1, 8, 12)), ("video", (2, 4, 6))]
HOT_POOL = 24            # images that recur all run long: cache hits
CANCEL_P = 0.1
FANOUT2_P = 0.4
ZERO_ROW_SHARD_P = 0.05  # a fanout-2 item where one receiver takes 0 rows
MAX_OPEN_ROOMS = 32
ROOMS_PER_S = 20.0
DENSE_WINDOW = 32        # --dense: rooms kept in flight (the issue asks for at least 24)
DENSE_MAX_ROOMS_PER_S = 250.0  # --dense: only sizes the room table, so no verdict is evicted
HUNG_GRACE_S = 2.0       # on top of a room's bound: the reaper's tick, a busy 2-core machine
INTAKE_LOSS_S = 0.5      # a request sent this soon after an intake's death can still go to its dead socket
HOLD_WAIT_S = 1.0        # --dense: how long a kill waits for its stage to hold a room
FINAL_ROOMS = 10         # sent after the chaos: all must succeed


def span_of(grid) -> int:
    t, h, w = grid
    return t * h * w // MERGE ** 2


@dataclasses.dataclass
class ChaosSettings:
    chaos_s: float                 # how long kills go on
    seed: int
    receivers: int = 2
    event_every_s: tuple = (1.5, 3.5)
    heartbeat_timeout_s: float = 2.0
    bootstrap_timeout_s: float = 3.0
    settle_timeout_s: float = 90.0
    dense: bool = False
    fanout2_p: float = FANOUT2_P
    arena_cache_bytes: int = 2 << 20
    host_cache_bytes: int = 4 << 20
    restart_window_s: float = 60.0
    # the worker's default: a start under this load takes several times a quiet one, and a
    # bound near that gives up starts that were merely slow, again and again
    stage_start_timeout_s: float = 8.0
    # known limit 1 excuses a room that concluded this long before a reaper kill (or stop)
    reaper_loss_before_s: float = 5.0

    @classmethod
    def dense_run(cls, chaos_s: float, seed: int, **over) -> "ChaosSettings":
        """--dense: kills close together while many rooms are in flight. The caches hold a
        few items (the hot pool is ~210 KB of rows) so most items go through the tower;
        a short restart window keeps the supervisor's backoff near 50 ms, as kills this
        frequent would otherwise keep it at its 2 s cap and the pipeline mostly down. Known
        limit 1 covers statuses sent "in the microseconds before" a reaper kill: with a reaper
        killed every few seconds, the 5 s window of the sparse mode would excuse a third of
        the run, and it hid rooms one receiver heard and another did not."""
        kw = dict(event_every_s=(0.5, 1.2), heartbeat_timeout_s=4.0, bootstrap_timeout_s=10.0,
                  dense=True, fanout2_p=0.5, arena_cache_bytes=48 << 10, host_cache_bytes=96 << 10,
                  restart_window_s=5.0, reaper_loss_before_s=1.0)
        kw.update(over)
        return cls(chaos_s=chaos_s, seed=seed, **kw)

    @property
    def max_rooms(self) -> int:
        """Rooms the run sends at most: the room table keeps every one's verdict to the end."""
        per_s = DENSE_MAX_ROOMS_PER_S if self.dense else ROOMS_PER_S * 1.5
        return int(self.chaos_s * per_s) + 1000

    def worker_config(self, prefix: str, run_dir: str):
        """The worker under the chaos: the sim tower, Mooncake over loopback TCP."""
        from pipeline.testing.workers import sim_config

        return sim_config(
            prefix, run_dir, sim_hidden=HIDDEN, sim_deepstack_width=DEEPSTACK, sim_dtype=DTYPE, sim_merge=MERGE,
            sim_time_per_row_s=2e-4, pixel_arena_bytes=64 << 20, embedding_arena_bytes=32 << 20,
            arena_cache_bytes=self.arena_cache_bytes, host_cache_bytes=self.host_cache_bytes,
            max_live_rooms=512,
            # every room stays in the table to the end, for the verdicts (send_room stops short of it)
            max_tombstones=self.max_rooms + 1000, tombstone_ttl_s=3600.0,
            bootstrap_timeout_s=self.bootstrap_timeout_s, heartbeat_timeout_s=self.heartbeat_timeout_s,
            restart_limit=1_000_000, restart_window_s=self.restart_window_s, drain_timeout_s=5.0,
            stage_start_timeout_s=self.stage_start_timeout_s)
