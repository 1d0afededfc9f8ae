"""What every scenario of benchmarks/pipeline.py shares: the workload's sizes and the
run's context (its arguments, scratch directory, figures and raw results)."""
from __future__ import annotations

import dataclasses

GRID = (1, 32, 32)        # 1024 patches -> 256 rows
TINY_GRID = (1, 16, 16)   # 256 patches -> 64 rows
SMALL_GRID = (1, 4, 4)    # 16 patches (75 KB of pixels) -> 4 rows (28 KB)
CPU_DEVICE_S = 0.2e-3     # device time per image, cpu-bound
SMALL_DEVICE_S = 0.02e-3  # device time per image, small
DEVICE_FACTOR = 3.0       # device-bound: device time = this x the in-process CPU cost
REPLICAS_DEVICE_S = 10e-3  # device time per image, replicas: the (sleeping) device is the bottleneck
PATCH_BYTES = 1176 * 4    # one float32 patch


def image_bytes(grid) -> int:
    return grid[0] * grid[1] * grid[2] * PATCH_BYTES


# (images per trial, trials per mode) of each scenario: --quick, and the full run
SIZES = {"cpu": ((300, 2), (500, 4)), "small": ((2000, 2), (5000, 4)), "device": ((300, 1), (500, 2)),
         "tiny": ((300, 1), (600, 2)), "replicas": ((300, 1), (600, 2)), "store": ((200, 1), (500, 2)),
         "tokenspeed": ((150, 7), (250, 11))}


@dataclasses.dataclass
class Bench:
    """One run of benchmarks/pipeline.py: `results` are the figures (the JSON's top level),
    `raw` each mode's run of each scenario (the JSON's "raw")."""
    args: object
    tmp: str
    hops: int
    results: dict
    raw: dict = dataclasses.field(default_factory=dict)

    @property
    def quick(self) -> bool:
        return self.args.quick

    @property
    def warmup(self) -> int:
        return 2 * self.args.window

    @property
    def latency_images(self) -> int:
        return 100 if self.quick else 400

    def size(self, scenario: str) -> tuple[int, int]:
        """(images per trial, trials per mode), --images and --trials over the defaults."""
        n, trials = SIZES[scenario][0 if self.quick else 1]
        return self.args.images or n, self.args.trials or trials
