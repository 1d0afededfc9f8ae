"""NUMA placement: which CPUs each stage runs on, read from sysfs.

The functions that read the machine take `sysfs_root` (and `proc_root`) so tests
can hand them a fake tree. `plan()` turns the `numa` setting into a CPU list per
stage (None: leave the stage unpinned); `pin()` applies one to this process and
`first_touch()` runs a block of code (creating an arena) on a node's CPUs, so the
kernel places the pages it allocates on that node.
"""
from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager

from pipeline.cli.config import ConfigError, WorkerConfig, parse_numa
from stages import registry

log = logging.getLogger("epd.numa")

_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_NODE_DIR = re.compile(r"^node(\d+)$")


def parse_cpulist(text: str) -> list[int]:
    """ "0-3,8-11" -> [0, 1, 2, 3, 8, 9, 10, 11]; "" -> []."""
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def format_cpulist(cpus) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8" (for messages)."""
    runs = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def nodes(sysfs_root: str = "/sys") -> dict[int, list[int]]:
    """Each NUMA node that has CPUs -> its CPUs. Memory-only nodes are left out;
    a kernel without NUMA (no node directory) gives {}."""
    base = os.path.join(sysfs_root, "devices/system/node")
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        m = _NODE_DIR.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(base, name, "cpulist")) as f:
                cpus = parse_cpulist(f.read())
        except FileNotFoundError:
            continue
        if cpus:
            out[int(m.group(1))] = cpus
    return dict(sorted(out.items()))


def gpu_pci_addresses(sysfs_root: str = "/sys", proc_root: str = "/proc") -> list[str]:
    """The NVIDIA GPUs' PCI addresses in bus-id order: the order of CUDA's device
    indices under CUDA_DEVICE_ORDER=PCI_BUS_ID (and under the default order on a
    machine whose GPUs are all alike)."""
    gpus_dir = os.path.join(proc_root, "driver/nvidia/gpus")
    if os.path.isdir(gpus_dir):
        return sorted(d.lower() for d in os.listdir(gpus_dir) if _PCI_ADDRESS.match(d.lower()))
    driver_dir = os.path.join(sysfs_root, "bus/pci/drivers/nvidia")
    try:
        names = os.listdir(driver_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if not _PCI_ADDRESS.match(name):
            continue
        # the driver also binds NVSwitches (PCI class 0x0680); GPUs are display controllers (0x03xxxx)
        try:
            with open(os.path.join(driver_dir, name, "class")) as f:
                if f.read().strip().lower().startswith("0x03"):
                    out.append(name)
        except FileNotFoundError:
            continue
    return sorted(out)


def _uuid_address(uuid: str, proc_root: str) -> str | None:
    """The PCI address of the GPU whose UUID starts with `uuid` (CUDA accepts a prefix)."""
    gpus_dir = os.path.join(proc_root, "driver/nvidia/gpus")
    try:
        names = os.listdir(gpus_dir)
    except FileNotFoundError:
        return None
    found = []
    for name in names:
        try:
            with open(os.path.join(gpus_dir, name, "information")) as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() == "GPU UUID" and value.strip().startswith(uuid):
                        found.append(name.lower())
        except FileNotFoundError:
            continue
    return found[0] if len(found) == 1 else None


def gpu_node(gpu: int, sysfs_root: str = "/sys", proc_root: str = "/proc",
             visible_devices: str | None = None) -> int | None:
    """The NUMA node of CUDA device `gpu`, or None when unknown (no such GPU, a
    `numa_node` of -1 or missing, a CUDA_VISIBLE_DEVICES entry that names no GPU
    found here). `visible_devices` is CUDA_VISIBLE_DEVICES: `gpu` indexes it."""
    addresses = gpu_pci_addresses(sysfs_root, proc_root)
    if visible_devices is not None:
        entries = [e.strip() for e in visible_devices.split(",")]
        entry = entries[gpu] if 0 <= gpu < len(entries) else ""
        if entry.startswith("GPU-"):
            address = _uuid_address(entry, proc_root)
        elif entry.isdigit() and int(entry) < len(addresses):
            address = addresses[int(entry)]
        else:  # no such entry, or a MIG instance: no PCI device to map it to
            address = None
    else:
        address = addresses[gpu] if 0 <= gpu < len(addresses) else None
    if address is None:
        return None
    try:
        with open(os.path.join(sysfs_root, "bus/pci/devices", address, "numa_node")) as f:
            node = int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None
    return node if node >= 0 else None


def plan(setting: str, gpu: int, stages: list[str], sysfs_root: str = "/sys", *,
         proc_root: str = "/proc", visible_devices: str | None = None,
         allowed: set[int] | None = None, tower_gpus: dict[str, int] | None = None) -> dict[str, list[int] | None]:
    """Each stage's CPUs, or None to leave it unpinned.

    "off": none pinned. "auto": each tower replica on the node of its GPU
    (`tower_gpus`), every other stage on the node of `gpu`; none pinned on a
    machine with one node, and a stage whose GPU's node is unknown unpinned.
    "N": every stage on node N. "tower=1,sender=1,*=0": per stage ("tower" for
    every replica, "tower1" for one; "preprocess" for every worker), "*" for the
    rest (a stage not named, without "*", is left unpinned). A node's CPUs are cut down to `allowed` (the CPUs this
    process may use: taskset, cgroup cpuset).
    """
    replicas, workers = registry.counts_of(stages)
    # "auto", "off" or {stage or "*": node}; its errors name numa
    wanted = parse_numa(setting, max(1, replicas), max(1, workers))
    if wanted == "off":
        return {s: None for s in stages}
    node_cpus = nodes(sysfs_root)
    if wanted == "auto":
        if len(node_cpus) <= 1:
            return {s: None for s in stages}
        tower_gpus = tower_gpus or {}
        near = {g: _near_gpu(g, node_cpus, sysfs_root, proc_root, visible_devices, allowed)
                for g in sorted({gpu, *tower_gpus.values()})}
        return {s: near[tower_gpus.get(s, gpu)] for s in stages}
    out = {}
    for stage in stages:
        node = wanted.get(stage, wanted.get(registry.kind_of(stage), wanted.get("*")))
        if node is None:
            out[stage] = None
            continue
        if node not in node_cpus:
            have = ", ".join(map(str, node_cpus)) or "none (no NUMA information in sysfs)"
            raise ConfigError(f"numa puts {stage} on node {node}, which does not exist or has no CPUs; "
                              f"nodes with CPUs: {have}", "numa")
        cpus = node_cpus[node] if allowed is None else sorted(set(node_cpus[node]) & set(allowed))
        if not cpus:
            raise ConfigError(f"numa puts {stage} on node {node}, whose CPUs {format_cpulist(node_cpus[node])} "
                              f"this process may not use (allowed: {format_cpulist(allowed)}, "
                              f"set by taskset or a cgroup cpuset); pick another node or numa=off", "numa")
        out[stage] = cpus
    return out


def _near_gpu(gpu: int, node_cpus: dict[int, list[int]], sysfs_root: str, proc_root: str,
              visible_devices: str | None, allowed: set[int] | None) -> list[int] | None:
    """The allowed CPUs of GPU `gpu`'s node (numa=auto); None, with a warning, when unknown."""
    node = gpu_node(gpu, sysfs_root, proc_root, visible_devices)
    if node is None or node not in node_cpus:
        log.warning("numa=auto: the NUMA node of GPU %d is unknown; its stages run unpinned "
                    "(set numa to a node number to pin them)", gpu)
        return None
    cpus = node_cpus[node] if allowed is None else sorted(set(node_cpus[node]) & set(allowed))
    if not cpus:
        log.warning("numa=auto: none of node %d's CPUs (%s, nearest GPU %d) is allowed to this "
                    "process (%s); its stages run unpinned", node, format_cpulist(node_cpus[node]), gpu,
                    format_cpulist(allowed))
        return None
    return cpus


def placement(cfg: WorkerConfig) -> dict[str, list[int] | None]:
    """`plan()` for this machine, every stage, and this process's allowed CPUs; the stages
    other than the towers go with the first replica's GPU."""
    gpus = cfg.gpu_list()
    return plan(cfg.numa, gpus[0], registry.stage_names(cfg.tower_replicas, cfg.preprocess_workers),
                visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), allowed=os.sched_getaffinity(0),
                tower_gpus=dict(zip(registry.tower_names(cfg.tower_replicas), gpus)))


def pin(cpus: list[int] | None) -> None:
    """Pin this process (its main thread, and every thread it starts later) to `cpus`."""
    if cpus is not None:
        import psutil

        psutil.Process().cpu_affinity(cpus)


@contextmanager
def first_touch(cpus: list[int] | None):
    """Run the block on `cpus`, then restore: pages the block allocates (posix_fallocate
    of a shared-memory segment) land on those CPUs' node under the default policy.
    The calling thread's affinity, not the process's: psutil would set the main
    thread's, and the caller may be another thread."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
