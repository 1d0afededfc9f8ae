"""NUMA placement: plans from fake sysfs trees of 1, 2 and 4 nodes, the GPU's node,
per-stage settings, errors; and real pinning of a child process on this machine."""
from __future__ import annotations

import os
import threading

import psutil
import pytest

from pipeline.ops import numa
from pipeline.cli.config import ConfigError
from stages import registry
from tests.helpers import fork_call, sim_config, wait_child

STAGES = registry.stage_names(1)


def fake_machine(root, node_cpus: dict[int, str], gpus=(), *, nvidia_proc=True, nvswitches=()):
    """A sysfs (root/sys) and procfs (root/proc) tree: nodes with their cpulists, and
    GPUs as (PCI address, numa_node, uuid); returns (sysfs_root, proc_root)."""
    sys_root, proc_root = root / "sys", root / "proc"
    for node, cpus in node_cpus.items():
        d = sys_root / "devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    (sys_root / "devices/system/node/possible").parent.mkdir(parents=True, exist_ok=True)
    (sys_root / "devices/system/node/possible").write_text("0-63\n")  # not a node directory
    devices = [(addr, node, uuid, "0x030200") for addr, node, uuid in gpus] + \
              [(addr, node, None, "0x068000") for addr, node in nvswitches]
    for addr, node, uuid, pci_class in devices:
        dev = sys_root / "bus/pci/devices" / addr
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{node}\n")
        (dev / "class").write_text(pci_class + "\n")
        driver = sys_root / "bus/pci/drivers/nvidia"
        driver.mkdir(parents=True, exist_ok=True)
        (driver / addr).symlink_to(dev)
        if nvidia_proc and uuid is not None:
            info = proc_root / "driver/nvidia/gpus" / addr
            info.mkdir(parents=True)
            (info / "information").write_text(
                f"Model: \t\t NVIDIA H100\nIRQ:   \t\t 140\nGPU UUID: \t {uuid}\nBus Location: \t {addr}\n")
    return str(sys_root), str(proc_root)


TWO_NODES = {0: "0-7,16-23", 1: "8-15,24-31"}
FOUR_NODES = {0: "0-3", 1: "4-7", 2: "8-11", 3: "12-15"}
# listed out of bus order on purpose: CUDA index 0 is the lowest bus id
TWO_GPUS = [("0000:b1:00.0", 1, "GPU-bbbb1111-0000"), ("0000:3b:00.0", 0, "GPU-aaaa2222-0000")]


def node(spec: dict[int, str], n: int) -> list[int]:
    return numa.parse_cpulist(spec[n])


def test_cpulists_parse_and_format():
    assert numa.parse_cpulist("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert numa.parse_cpulist("5") == [5]
    assert numa.parse_cpulist("\n") == []
    assert numa.format_cpulist([11, 0, 1, 2, 3, 8, 9, 10]) == "0-3,8-11"
    assert numa.format_cpulist([4]) == "4"


def test_one_node_runs_unpinned_unless_told(tmp_path):
    sysfs, proc = fake_machine(tmp_path, {0: "0-15"}, [("0000:3b:00.0", 0, "GPU-a")])
    assert numa.nodes(sysfs) == {0: list(range(16))}
    assert numa.plan("auto", 0, STAGES, sysfs, proc_root=proc) == {s: None for s in STAGES}
    assert numa.plan("off", 0, STAGES, sysfs, proc_root=proc) == {s: None for s in STAGES}
    assert numa.plan("0", 0, STAGES, sysfs, proc_root=proc) == {s: list(range(16)) for s in STAGES}


def test_no_numa_in_sysfs_is_one_node(tmp_path):
    assert numa.nodes(str(tmp_path)) == {}
    assert numa.plan("auto", 0, STAGES, str(tmp_path), proc_root=str(tmp_path)) == {s: None for s in STAGES}
    with pytest.raises(ConfigError, match="numa.*no NUMA information") as e:
        numa.plan("0", 0, STAGES, str(tmp_path), proc_root=str(tmp_path))
    assert e.value.key == "numa"


def test_two_nodes_auto_follows_the_gpu(tmp_path):
    sysfs, proc = fake_machine(tmp_path, TWO_NODES, TWO_GPUS)
    assert numa.gpu_pci_addresses(sysfs, proc) == ["0000:3b:00.0", "0000:b1:00.0"]
    assert numa.gpu_node(0, sysfs, proc) == 0
    assert numa.gpu_node(1, sysfs, proc) == 1
    assert numa.gpu_node(2, sysfs, proc) is None
    assert numa.plan("auto", 1, STAGES, sysfs, proc_root=proc) == {s: node(TWO_NODES, 1) for s in STAGES}
    assert numa.plan("auto", 0, STAGES, sysfs, proc_root=proc) == {s: node(TWO_NODES, 0) for s in STAGES}
    # a GPU index with no GPU behind it: unknown node, unpinned
    assert numa.plan("auto", 5, STAGES, sysfs, proc_root=proc) == {s: None for s in STAGES}


def test_auto_puts_each_tower_replica_on_its_gpus_node(tmp_path):
    sysfs, proc = fake_machine(tmp_path, TWO_NODES, TWO_GPUS)
    stages = registry.stage_names(3)
    got = numa.plan("auto", 1, stages, sysfs, proc_root=proc, tower_gpus={"tower0": 1, "tower1": 0, "tower2": 5})
    assert got == {**{s: node(TWO_NODES, 1) for s in stages}, "tower1": node(TWO_NODES, 0), "tower2": None}
    # "tower" names every replica; a replica's own name wins
    got = numa.plan("tower=1,tower2=0,*=0", 0, stages, sysfs, proc_root=proc)
    assert got == {**{s: node(TWO_NODES, 0) for s in stages}, "tower0": node(TWO_NODES, 1),
                   "tower1": node(TWO_NODES, 1)}
    with pytest.raises(ConfigError, match="numa names no stage 'tower3'"):
        numa.plan("tower3=1", 0, stages, sysfs, proc_root=proc)


def test_gpu_node_from_the_driver_directory_skips_nvswitches(tmp_path):
    sysfs, proc = fake_machine(tmp_path, TWO_NODES, TWO_GPUS, nvidia_proc=False,
                               nvswitches=[("0000:05:00.0", 0)])
    assert not os.path.exists(os.path.join(proc, "driver/nvidia/gpus"))
    assert numa.gpu_pci_addresses(sysfs, proc) == ["0000:3b:00.0", "0000:b1:00.0"]
    assert numa.gpu_node(1, sysfs, proc) == 1


def test_unknown_gpu_node_leaves_auto_unpinned(tmp_path):
    sysfs, proc = fake_machine(tmp_path, TWO_NODES, [("0000:3b:00.0", -1, "GPU-a")])
    assert numa.gpu_node(0, sysfs, proc) is None
    assert numa.plan("auto", 0, STAGES, sysfs, proc_root=proc) == {s: None for s in STAGES}
    # no GPU at all (the sim tower on a CPU machine)
    sysfs, proc = fake_machine(tmp_path / "nogpu", TWO_NODES)
    assert numa.plan("auto", 0, STAGES, sysfs, proc_root=proc) == {s: None for s in STAGES}


def test_cuda_visible_devices_maps_the_index(tmp_path):
    sysfs, proc = fake_machine(tmp_path, TWO_NODES, TWO_GPUS)
    assert numa.gpu_node(0, sysfs, proc, visible_devices="1") == 1
    assert numa.gpu_node(1, sysfs, proc, visible_devices="1,0") == 0
    assert numa.gpu_node(0, sysfs, proc, visible_devices="GPU-bbbb") == 1  # a UUID prefix, as CUDA allows
    assert numa.gpu_node(0, sysfs, proc, visible_devices="GPU-aaaa2222-0000") == 0
    assert numa.gpu_node(0, sysfs, proc, visible_devices="MIG-1234") is None
    assert numa.gpu_node(1, sysfs, proc, visible_devices="0") is None
    assert numa.gpu_node(0, sysfs, proc, visible_devices="") is None
    assert numa.plan("auto", 0, STAGES, sysfs, proc_root=proc, visible_devices="1") == \
        {s: node(TWO_NODES, 1) for s in STAGES}


def test_four_nodes_per_stage(tmp_path):
    sysfs, proc = fake_machine(tmp_path, FOUR_NODES, [("0000:3b:00.0", 2, "GPU-a")])
    got = numa.plan("tower=3,sender=3,*=1", 0, STAGES, sysfs, proc_root=proc)
    assert got == {s: node(FOUR_NODES, 3 if s in ("tower", "sender") else 1) for s in STAGES}
    got = numa.plan("tower=2, intake=0", 0, STAGES, sysfs, proc_root=proc)
    assert got == {s: (node(FOUR_NODES, 2) if s == "tower" else node(FOUR_NODES, 0) if s == "intake" else None)
                   for s in STAGES}
    assert numa.plan("3", 0, STAGES, sysfs, proc_root=proc) == {s: [12, 13, 14, 15] for s in STAGES}
    assert numa.plan("auto", 0, STAGES, sysfs, proc_root=proc) == {s: [8, 9, 10, 11] for s in STAGES}


def test_memory_only_nodes_do_not_count(tmp_path):
    sysfs, proc = fake_machine(tmp_path, {0: "0-7", 1: ""}, [("0000:3b:00.0", 1, "GPU-a")])
    assert numa.nodes(sysfs) == {0: list(range(8))}
    assert numa.plan("auto", 0, STAGES, sysfs, proc_root=proc) == {s: None for s in STAGES}
    with pytest.raises(ConfigError, match="node 1.*nodes with CPUs: 0"):
        numa.plan("tower=1", 0, STAGES, sysfs, proc_root=proc)


@pytest.mark.parametrize("setting, message", [
    ("4", r"numa puts reaper on node 4, which does not exist.*nodes with CPUs: 0, 1, 2, 3"),
    ("tower=9,*=0", r"numa puts tower on node 9"),
    ("tower=one", r"numa must be"),
    ("gpu=1", r"numa names no stage 'gpu'"),
    ("tower=1,tower=2", r"numa gives 'tower' twice"),
    ("-1", r"numa must be"),
])
def test_bad_settings_name_numa(tmp_path, setting, message):
    sysfs, proc = fake_machine(tmp_path, FOUR_NODES)
    with pytest.raises(ConfigError, match=message) as e:
        numa.plan(setting, 0, STAGES, sysfs, proc_root=proc)
    assert e.value.key == "numa"


def test_cpus_outside_the_allowed_set(tmp_path):
    sysfs, proc = fake_machine(tmp_path, TWO_NODES, TWO_GPUS)
    # taskset / cpuset allow part of node 1: cut down to it
    got = numa.plan("1", 0, STAGES, sysfs, proc_root=proc, allowed={8, 9, 0})
    assert got == {s: [8, 9] for s in STAGES}
    # none of node 1: an explicit setting is an error that says why ...
    with pytest.raises(ConfigError, match=r"node 1, whose CPUs 8-15,24-31 this process may not use "
                                          r"\(allowed: 0-3") as e:
        numa.plan("tower=1,*=0", 1, STAGES, sysfs, proc_root=proc, allowed={0, 1, 2, 3})
    assert e.value.key == "numa"
    # ... and auto, which chose nothing, leaves the stages where the operator put them
    assert numa.plan("auto", 1, STAGES, sysfs, proc_root=proc, allowed={0, 1, 2, 3}) == {s: None for s in STAGES}


def _pinned_child(cpus, out_path):
    numa.pin(cpus)
    seen = {}
    t = threading.Thread(target=lambda: seen.setdefault("thread", sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    with open(out_path, "w") as f:
        f.write(f"{sorted(psutil.Process().cpu_affinity())} {seen['thread']}")


def test_pin_a_child_process_for_real(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    last = allowed[-1]
    # this machine as two fake nodes: the last allowed CPU is node 1
    sysfs, proc = fake_machine(tmp_path, {0: numa.format_cpulist(allowed[:-1]), 1: str(last)})
    cpus = numa.plan("tower=1", 0, STAGES, sysfs, proc_root=proc, allowed=set(allowed))["tower"]
    assert cpus == [last]
    out = tmp_path / "affinity"
    assert wait_child(fork_call(_pinned_child, cpus, str(out))) == 0
    assert out.read_text() == f"{[last]} {[last]}"  # the process, and a thread it started later
    assert sorted(os.sched_getaffinity(0)) == allowed  # the parent is untouched


def test_first_touch_moves_only_the_calling_thread_and_restores(tmp_path):
    before = sorted(os.sched_getaffinity(0))
    target = [before[-1]]
    seen = {}

    def create():
        with numa.first_touch(target):
            seen["inside"] = sorted(os.sched_getaffinity(0))
            seen["main thread"] = sorted(psutil.Process().cpu_affinity())
        seen["after"] = sorted(os.sched_getaffinity(0))

    t = threading.Thread(target=create)
    t.start()
    t.join()
    assert seen == {"inside": target, "main thread": before, "after": before}
    with numa.first_touch(None):
        assert sorted(os.sched_getaffinity(0)) == before


def test_supervisor_checks_numa_before_making_anything(shm_prefix, tmp_path):
    from ipc import shm
    from pipeline.runtime.supervisor import Supervisor

    with pytest.raises(ConfigError, match="numa puts"):
        Supervisor(sim_config(shm_prefix, tmp_path, numa="63"))
    assert shm.list_objects(shm_prefix) == []


def test_pipeline_stages_run_on_their_planned_cpus(shm_prefix, tmp_path, monkeypatch):
    """The supervisor hands each stage process its CPUs (here a plan made up for this
    2-CPU machine, one stage alone on the last CPU) and the stage pins itself."""
    from pipeline.runtime.boards import Heartbeats
    from tests.helpers import PipelineWorker

    allowed = sorted(os.sched_getaffinity(0))
    planned = {s: None for s in STAGES}
    planned["tower"] = [allowed[-1]]
    planned["sender"] = [allowed[0]]
    monkeypatch.setattr(numa, "placement", lambda cfg: dict(planned))
    w = PipelineWorker(sim_config(shm_prefix, tmp_path))
    try:
        for stage in STAGES:
            pid = int(w.runtime.hb.row(stage)[Heartbeats.PID])
            got = sorted(psutil.Process(pid).cpu_affinity())
            assert got == (planned[stage] or allowed), stage
    finally:
        w.close()
