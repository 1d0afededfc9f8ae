"""The files in deploy/ hold against the worker they deploy: the systemd unit's timeouts,
watchdog, exit codes and run directory against its worker.toml; the Kubernetes manifests'
/dev/shm size, ports, probes, GPU and user against the ConfigMap's configuration; and
every metric the Grafana dashboard and the Prometheus alerts name against a live worker's
/metrics. `systemd-analyze verify` and `promtool check rules` run here where installed,
and always in .ci/run."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra: pip install -e '.[test]'")

from pipeline.runtime import wiring  # noqa: E402
from pipeline.cli.main import EXIT_CODES  # noqa: E402
from pipeline.cli.config import load_config  # noqa: E402
from stages import registry  # noqa: E402
from tests.helpers import PipelineWorker, sim_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "epd-worker.service"
KUBERNETES = DEPLOY / "kubernetes" / "epd-worker.yaml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "epd-worker.json"
pytestmark = pytest.mark.timeout(180)
# The checkpoint the files name is on the host they deploy to, not here: the tiny tower
# stands in for it when the configuration is validated.
HERE = {"EPD_TOWER_CONFIG": "tiny"}


def test_every_file_in_deploy_is_checked_here():
    checked = {UNIT, UNIT.with_name("worker.toml"), KUBERNETES, ALERTS, DASHBOARD}
    present = {p for p in DEPLOY.rglob("*") if p.is_file()}
    assert present == checked, f"not checked by tests/project/test_deploy.py: {sorted(present - checked)}"


def exit_code(command: str, meaning: str) -> int:
    """The exit code EXIT_CODES gives `command` for `meaning` (e.g. "bad configuration")."""
    return int(re.search(rf"(\d) {meaning}", EXIT_CODES[command])[1])


def seconds(value: str) -> float:
    """A systemd time span: "40", "40s", "2min", "1min 30s"."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts, value
    return sum(float(n) * units[u] for n, u in parts)


# ---------------------------------------------------------------- systemd

def unit_file(path: Path) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values]}}, a key given several times keeping each value."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit_fits_the_worker():
    service = unit_file(UNIT)["Service"]
    one = {key: values[-1] for key, values in service.items()}
    argv = one["ExecStart"].split()
    assert argv[0].endswith("/bin/epd-worker") and argv[1] == "serve", argv
    config_path = argv[argv.index("--config") + 1]
    assert config_path == "/etc/epd/worker.toml"
    cfg, _ = load_config(str(UNIT.with_name("worker.toml")), environ=HERE)
    assert cfg.tower == "qwen2.5-vl" and cfg.metrics_endpoint, "the probes and metrics need an endpoint"

    assert one["Type"] == "notify" and one.get("NotifyAccess", "main") == "main"
    assert one["KillMode"] == "mixed" and one["KillSignal"] == "SIGTERM"
    # The watchdog outlasts a stage's missed heartbeats and its restart.
    assert seconds(one["WatchdogSec"]) > 2 * cfg.heartbeat_timeout_s
    assert seconds(one["TimeoutStopSec"]) >= cfg.drain_timeout_s + 30
    assert seconds(one["TimeoutStartSec"]) > cfg.start_timeout_s
    # Exit codes: a clean stop (0) is not restarted, a failure is, bad configuration never.
    assert exit_code("serve", "stopped by SIGTERM") == 0 and one["Restart"] == "on-failure"
    prevent = " ".join(service["RestartPreventExitStatus"]).split()
    assert str(exit_code("serve", "bad configuration")) in prevent
    for code in (exit_code("serve", "a stage kept dying"), exit_code("serve", "the worker could not start")):
        assert str(code) not in prevent, code
    # Hardening that leaves the GPU, RDMA devices and /dev/shm reachable.
    assert one.get("PrivateDevices", "no") == "no" and one.get("PrivateIPC", "no") == "no"
    assert "DeviceAllow" not in one and "ProtectClock" not in one and "ProtectKernelLogs" not in one
    if one.get("ProtectSystem") == "strict":
        assert "/dev/shm" in one.get("ReadWritePaths", "") and cfg.run_dir in one.get("ReadWritePaths", "")
    assert one["LimitMEMLOCK"] == "infinity"
    # The run directory (intake socket) is the one systemd makes for the user.
    assert cfg.run_dir == f"/run/{one['RuntimeDirectory']}" and one["RuntimeDirectoryMode"] == "0700"
    assert cfg.intake == f"ipc://{cfg.run_dir}/intake.sock"


def test_systemd_analyze_verifies_the_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (.ci/run installs Debian's systemd)")
    script = Path(sys.prefix) / "bin" / "epd-worker"
    if not script.exists():
        pytest.skip(f"no console script at {script}: run scripts/setup.sh")
    # verify checks that ExecStart's program exists: point it at this environment's.
    unit = tmp_path / UNIT.name
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={script}", UNIT.read_text(), flags=re.M))
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr


# ---------------------------------------------------------------- Kubernetes

def quantity(value) -> int:
    """A Kubernetes quantity in bytes: 2Gi, 512Mi, 1G, 1024."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(value))
    assert m, value
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12}
    return int(m[1]) * scale[m[2]]


def manifests() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(KUBERNETES.read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs) and set(kinds) == {"ConfigMap", "Deployment", "Service"}, sorted(kinds)
    return kinds


def worker_container(pod: dict) -> dict:
    (worker,) = [c for c in pod["containers"] if c["name"] == "encode-worker"]
    return worker


def pod_config(kinds: dict, container: dict, tmp_path: Path):
    """The worker's effective configuration in the pod: the ConfigMap's worker.toml and the
    container's EPD_* environment, $(POD_IP) standing for an address."""
    path = tmp_path / "worker.toml"
    path.write_text(kinds["ConfigMap"]["data"]["worker.toml"])
    env = {e["name"]: e["value"].replace("$(POD_IP)", "10.1.2.3") for e in container.get("env", [])
           if e["name"].startswith("EPD_")}
    cfg, _ = load_config(str(path), environ={**env, **HERE})
    return cfg


def shm_needed(cfg) -> int:
    """What the worker checks /dev/shm for at start (pipeline/runtime/serving.py, supervisor.py):
    both arenas, the receiver, told and held tables, and one ring per edge."""
    return (cfg.pixel_arena_bytes + cfg.embedding_arena_bytes + wiring.tables_bytes(cfg)
            + len(wiring.edges(cfg.tower_replicas)) * cfg.ring_bytes)


def test_kubernetes_deployment_fits_its_configuration(tmp_path):
    kinds = manifests()
    deployment, service = kinds["Deployment"], kinds["Service"]
    pod = deployment["spec"]["template"]["spec"]
    worker = worker_container(pod)
    cfg = pod_config(kinds, worker, tmp_path)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}

    # The command reads the ConfigMap where it is mounted.
    argv = worker["command"] + worker.get("args", [])
    assert argv[:2] == ["epd-worker", "serve"]
    config_dir = argv[argv.index("--config") + 1].rsplit("/", 1)[0]
    assert volumes[mounts[config_dir]]["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]

    # /dev/shm: memory-backed, above what the worker checks for plus a request's pixels
    # in the gateway's segments; the container's memory limit covers it and the host cache.
    dshm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert dshm["medium"] == "Memory"
    shm_size = quantity(dshm["sizeLimit"])
    assert shm_size >= shm_needed(cfg) + cfg.max_pixel_bytes_per_request + (64 << 20), \
        (shm_size, shm_needed(cfg))
    limits = worker["resources"]["limits"]
    assert quantity(limits["memory"]) >= shm_size + cfg.host_cache_bytes + (4 << 30)
    assert int(limits["nvidia.com/gpu"]) == len(registry.tower_names(cfg.tower_replicas))

    # Ports: the metrics endpoint's and the bootstrap's; probes on the metrics port.
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports["metrics"] == int(cfg.metrics_endpoint.rsplit(":", 1)[1])
    assert ports["bootstrap"] == int(cfg.bootstrap.rsplit(":", 1)[1])
    assert cfg.bootstrap == "tcp://10.1.2.3:17600" and cfg.hostname == "10.1.2.3"
    probes = {kind: worker[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {kind: p["path"] for kind, p in probes.items()} == {
        "startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    assert all(p["port"] in ("metrics", ports["metrics"]) for p in probes.values())
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > cfg.start_timeout_s
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]

    # Stopping: the grace period covers the preStop pause, the drain and the stop.
    pause = worker["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pause + cfg.drain_timeout_s + 30

    # The run directory (intake socket) inside a volume the gateway shares.
    run_mount = next(m for m in mounts if cfg.run_dir == m or cfg.run_dir.startswith(m + "/"))
    assert cfg.run_dir != run_mount, "an emptyDir is 0777: the worker refuses it as its run directory"
    assert cfg.intake == f"ipc://{cfg.run_dir}/intake.sock"

    # The Service selects the pods and names the ports the container opens.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports) | set(ports.values())
    assert service["spec"].get("clusterIP") == "None", "receivers register with every worker pod"


def test_kubernetes_gateway_shares_shm_run_dir_and_user(tmp_path):
    kinds = manifests()
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    worker = worker_container(pod)
    cfg = pod_config(kinds, worker, tmp_path)
    (gateway,) = [c for c in pod["containers"] if c["name"] != "encode-worker"]
    shared = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    for mount in gateway["volumeMounts"]:
        assert shared.get(mount["name"]) == mount["mountPath"], mount
    gateway_paths = {m["mountPath"] for m in gateway["volumeMounts"]}
    assert "/dev/shm" in gateway_paths
    assert any(cfg.run_dir.startswith(p + "/") for p in gateway_paths)
    # One user id for both: the pod's, overridden by neither container.
    assert isinstance(pod["securityContext"]["runAsUser"], int) and pod["securityContext"]["runAsUser"] > 0
    for container in pod["containers"]:
        assert "runAsUser" not in container.get("securityContext", {}), container["name"]


# ---------------------------------------------------------------- Prometheus and Grafana

METRIC = re.compile(r"\b(epd_[a-z0-9_]+)\b")


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [r for group in doc["groups"] for r in group["rules"]]
    assert rules
    for rule in rules:
        assert {"alert", "expr", "labels", "annotations"} <= rule.keys(), rule
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
    return rules


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in doc["panels"] for t in panel.get("targets", [])]
    exprs += [v["definition"] for v in doc["templating"]["list"] if v.get("definition")]
    assert exprs and len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    return exprs


def test_alerts_cover_what_the_issue_asks():
    exprs = " ".join(r["expr"] for r in alert_rules())
    for metric in ("epd_stage_restarts_total", "epd_stage_heartbeat_age_seconds", "epd_rooms_total",
                   "epd_arena_bytes", "epd_room_latency_seconds_bucket"):
        assert metric in exprs, metric
    assert "reason" in exprs  # rooms failed, by reason


def test_promtool_checks_the_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed here (.ci/run installs Debian's prometheus)")
    p = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def exported_names(text: str) -> set[str]:
    """Every sample name in a Prometheus text exposition, and each histogram's base name."""
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, re.M))
    names |= set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    return names


def test_every_metric_named_is_exported_by_a_live_worker(shm_prefix, tmp_path):
    named = {m for expr in [r["expr"] for r in alert_rules()] + dashboard_exprs() for m in METRIC.findall(expr)}
    assert named
    w = PipelineWorker(sim_config(shm_prefix, tmp_path, metrics_endpoint="127.0.0.1:0"))
    try:
        url = f"http://127.0.0.1:{w.runtime.metrics.port}/metrics"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
    finally:
        w.close()
    exported = exported_names(text)
    assert "epd_room_latency_seconds_bucket" in exported and "epd_stage_restarts_total" in exported
    missing = sorted(named - exported)
    assert not missing, f"named in deploy/ but not exported by the worker: {missing}"

