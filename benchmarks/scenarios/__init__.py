"""The scenarios of benchmarks/pipeline.py, each a function of the run's context
(common.Bench) that measures, prints its figures and puts them in the results. They run
in this order (device reads cpu's in-process figure)."""
from __future__ import annotations

from benchmarks.scenarios.device import device
from benchmarks.scenarios.load import load
from benchmarks.scenarios.media import media_scenario
from benchmarks.scenarios.replicas import replicas
from benchmarks.scenarios.sim_pair import cpu, small
from benchmarks.scenarios.store import store
from benchmarks.scenarios.tiny import tiny
from benchmarks.scenarios.tokenspeed import tokenspeed
from benchmarks.scenarios.vllm import vllm

SCENARIOS = {"cpu": cpu, "small": small, "device": device, "replicas": replicas, "load": load, "tiny": tiny,
             "tokenspeed": tokenspeed, "store": store, "vllm": vllm, "media": media_scenario}
