"""Scenarios cpu (4.8 MB images, cpu-bound) and small (75 KB images): both modes of the
worker with the sim tower, their throughput, CPU per image, latency one image at a time
and the intake stage's CPU, each against its baseline."""
from __future__ import annotations

import os

from benchmarks.harness.baselines import in_child, raw_intake_read, raw_semaphore_wake
from benchmarks.harness.report import describe, print_ratio
from benchmarks.harness.session import run_pair
from benchmarks.scenarios.common import CPU_DEVICE_S, GRID, SMALL_DEVICE_S, SMALL_GRID, Bench, image_bytes
from stages.registry import INTAKE

CLIENT = "client (gateway + receiver)"


def floors(quick: bool, grid: tuple, n_read: int):
    """The hop and intake baselines, measured while both workers of the pair are up and idle."""
    nbytes = image_bytes(grid)

    def between(_sessions) -> dict:
        return {"wake": in_child(raw_semaphore_wake, quick),
                "intake_read": in_child(raw_intake_read, f"bench_{os.getpid()}_rd", nbytes, n_read),
                "intake_read_hash": in_child(raw_intake_read, f"bench_{os.getpid()}_rh", nbytes, n_read, True)}
    return between


def cpu(b: Bench) -> None:
    n, trials = b.size("cpu")
    print(f"cpu-bound: {GRID}, device {CPU_DEVICE_S * 1e3:.1f} ms/image, {n} images x {trials} "
          f"trials per mode, window {b.args.window}; latency: {b.latency_images} images one at a time", flush=True)
    pair = run_pair("cpu", b.tmp, b.args, device_s=CPU_DEVICE_S, grids=(GRID,), n=n, trials=trials,
                    warmup=b.warmup, latency=b.latency_images, between=floors(b.quick, GRID, 300 if b.quick else 1000))
    for mode, r in pair.items():
        b.raw[f"cpu_bound_{mode}"] = r
        print(describe(r), flush=True)
    pair_figures(b, "", "4.8 MB", pair)


def small(b: Bench) -> None:
    n, trials = b.size("small")
    print(f"small: {SMALL_GRID}, device {SMALL_DEVICE_S * 1e3:.2f} ms/image, {n} images x "
          f"{trials} trials per mode, window {b.args.window}; latency: {b.latency_images} images one at a "
          f"time", flush=True)
    pair = run_pair("small", b.tmp, b.args, device_s=SMALL_DEVICE_S, grids=(SMALL_GRID,), n=n, trials=trials,
                    warmup=b.warmup, latency=b.latency_images,
                    between=floors(b.quick, SMALL_GRID, 3000 if b.quick else 10000))
    for mode, r in pair.items():
        b.raw[f"small_{mode}"] = r
        print(describe(r), flush=True)
    pair_figures(b, "small_", "75 KB", pair)


def pair_figures(b: Bench, key: str, scenario: str, pair: dict) -> None:
    """The throughput, CPU, latency and intake figures of one sim-tower pair of runs;
    `key` is the prefix of its JSON keys ("" or "small_")."""
    inp, pip = pair["inprocess"], pair["pipeline"]
    between = pip["between"]
    print_ratio(f"{key}pipeline_vs_inprocess_throughput", pip["images_per_s"], inp["images_per_s"], b.results)
    cpu_figures(b.results, key, inp, pip)
    latency_figures(b.results, key, inp, pip, between, b.hops)
    intake_figures(b.results, key, scenario, pip, between)


def cpu_figures(results: dict, key: str, inp: dict, pip: dict) -> None:
    # What the cores allow: all CPU per image (worker, Mooncake's threads, the client)
    # of the in-process run, spread perfectly over every core.
    cores = len(os.sched_getaffinity(0))
    ti, tp = inp["trials"][inp["best_trial"]], pip["trials"][pip["best_trial"]]
    cpu_i, cpu_p = sum(ti["cpu_ms_per_image"].values()), sum(tp["cpu_ms_per_image"].values())
    worker_i, worker_p = cpu_i - ti["cpu_ms_per_image"][CLIENT], cpu_p - tp["cpu_ms_per_image"][CLIENT]
    ceiling = cores * 1000.0 / cpu_i
    results[f"{key}cpu_ms_per_image_all_processes"] = {"inprocess": cpu_i, "pipeline": cpu_p}
    results["cores"] = cores
    results[f"{key}pipeline_vs_inprocess_throughput_ceiling"] = ceiling / inp["images_per_s"]
    print(f"  CPU per image, all processes (client included): inprocess {cpu_i:.3f} ms, pipeline "
          f"{cpu_p:.3f} ms; {cores} cores busy at the in-process cost would give {ceiling:.0f} "
          f"images/s = {ceiling / inp['images_per_s']:.2f}x in-process (the most any split "
          f"of the same work can reach here)", flush=True)
    results[f"{key}pipeline_cpu_per_image_vs_inprocess_worker_only"] = worker_p / worker_i
    print_ratio(f"{key}pipeline_cpu_per_image_vs_inprocess", cpu_p, cpu_i, results, ".3f",
                f"   (the worker alone, client left out: {worker_p:.3f} / {worker_i:.3f} = "
                f"{worker_p / worker_i:.2f})")


def latency_figures(results: dict, key: str, inp: dict, pip: dict, between: dict, hops: int) -> None:
    lp, li = pip["latency_ms"], inp["latency_ms"]
    added = lp["p50"] - li["p50"]
    wake_ms = between["wake"]["raw_semaphore_one_way_p50_us"] / 1000
    floor = hops * wake_ms
    results[f"{key}added_latency_ms_p50"] = added
    results[f"{key}raw_semaphore_one_way_wake_us_p50"] = wake_ms * 1000
    print(f"latency one at a time, ms p50/p90/p99: inprocess {li['p50']:.3f}/{li['p90']:.3f}/"
          f"{li['p99']:.3f}, pipeline {lp['p50']:.3f}/{lp['p90']:.3f}/{lp['p99']:.3f}")
    print(f"  {key}added_latency_ms_p50 = {lp['p50']:.3f} - {li['p50']:.3f} = {added:.3f} ms; hop floor = "
          f"{hops} hops x raw one-way semaphore wake p50 {wake_ms * 1000:.1f} us = {floor:.3f} ms")
    print_ratio(f"{key}added_latency_vs_hop_floor", added, floor, results, ".3f")


def intake_figures(results: dict, key: str, scenario: str, pip: dict, between: dict) -> None:
    intake = pip["trials"][pip["best_trial"]]["cpu_ms_per_image"].get(INTAKE)
    if intake is None:
        return
    read = between["intake_read"]["cpu_ms_per_image"]
    results[f"{key}intake_cpu_ms_per_image"] = intake
    results[f"{key}raw_read_cpu_ms_per_image"] = read
    print_ratio(f"{key}intake_cpu_vs_raw_read", intake, read, results, ".3f",
                f"   (intake process CPU per image / open+preadv+unlink+close of a {scenario} segment "
                f"into a resident buffer, one process)")
    # Intake also hashes the pixels as it reads them (the cache stage used to read them
    # again for that): the same floor with the hash taken the same way.
    read_hash = between["intake_read_hash"]["cpu_ms_per_image"]
    results[f"{key}raw_read_hash_cpu_ms_per_image"] = read_hash
    results[f"{key}intake_cpu_vs_raw_read_and_hash"] = intake / read_hash
    print(f"  {key}intake_cpu_vs_raw_read_and_hash = {intake:.3f} / {read_hash:.3f} = "
          f"{intake / read_hash:.2f}  (no target; the floor above, each piece hashed as it lands)", flush=True)
