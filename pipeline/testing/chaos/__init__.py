"""Chaos under load: the multi-process pipeline with stages and receivers killed at
random while rooms flow, every invariant checked (benchmarks/chaos.py describes the run
and its result; tests/soak/test_chaos.py runs it short and dense).

settings.py holds the knobs, receiver.py the receiver processes and their checks,
events.py the kills, timeline.py what died when, harness.py the run, checks.py the
judgment at its end."""
from __future__ import annotations

from pipeline.testing.chaos.settings import ChaosSettings


def run_chaos(chaos_s: float, seed: int, *, shm_prefix: str, run_dir: str, log=print, dense: bool = False,
              **over) -> dict:
    """A chaos run of `chaos_s` seconds from `seed` (the same seed replays the schedule);
    its result (benchmarks/chaos.py lists the keys)."""
    from pipeline.testing.chaos.harness import Chaos

    settings = (ChaosSettings.dense_run(chaos_s, seed, **over) if dense
                else ChaosSettings(chaos_s=chaos_s, seed=seed, **over))
    return Chaos(settings, shm_prefix=shm_prefix, run_dir=run_dir, log=log).run()
