"""deploy/: the Prometheus config, the Grafana dashboard's PromQL, and the Ray / KubeRay files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import promql_parser
import pytest
import yaml

from pagedserve.cluster.metrics import snapshot_families
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# Grafana's variables are not PromQL: give them values before parsing.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$model_name": "m"}


def exported_names() -> set[str]:
    """Every series name /metrics exports (counters' _total, histograms' _bucket/_sum/_count)."""
    sched = Scheduler(SchedulerConfig(max_model_len=64), [WorkerSpec(0, 4, 16)])
    names = set()
    for fam in snapshot_families(sched.metrics_snapshot(), "m"):
        names.update(s.name for s in fam.samples)
    return names


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "pagedserve.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def selector_names(expr: str) -> set[str]:
    for var, val in GRAFANA_VARS.items():
        expr = expr.replace(var, val)
    found: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def test_promtool_accepts_prometheus_yml():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    out = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_yml_scrapes_the_default_http_port():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]


def test_dashboard_promql_parses_and_names_only_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "pagedserve.json").read_text())
    assert dash["title"] == "pagedserve" and dash["panels"]
    exprs = dashboard_exprs()
    assert len(exprs) >= 12
    exported = exported_names()
    used: set[str] = set()
    for expr in exprs:
        names = selector_names(expr)  # raises on a PromQL syntax error
        assert names, expr
        assert names <= exported, f"{expr}: not exported: {names - exported}"
        used |= names
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("kv cache", "waiting", "time to first token", "inter-token", "throughput",
                  "preemption", "prefix-cache", "swap"):  # fmt: skip
        assert topic in titles, topic
    # The templating query names an exported metric too.
    (var,) = dash["templating"]["list"]
    (metric,) = re.findall(r"label_values\(([^,]+),", var["definition"])
    assert metric in exported


def test_a_wrong_metric_name_is_caught():
    assert selector_names('rate(pagedserve:no_such_total{model_name="$model_name"}[1m])') == {
        "pagedserve:no_such_total"
    }
    with pytest.raises(ValueError):
        selector_names("sum(rate(x[1m])")


def test_runtime_env_and_ray_cluster_yaml():
    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert set(env) <= {"working_dir", "excludes", "env_vars", "pip", "py_modules"}
    assert env["working_dir"] == "."
    assert all(isinstance(v, str) for v in env["env_vars"].values())  # Ray requires strings
    assert int(env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) >= 3
    cluster = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    for key in ("cluster_name", "provider", "auth", "setup_commands", "head_start_ray_commands",
                "worker_start_ray_commands"):  # fmt: skip
        assert key in cluster, key
    assert cluster["provider"]["type"] == "local"
    assert any("--head" in c for c in cluster["head_start_ray_commands"])


def _check_ray_cluster_spec(spec: dict) -> None:
    """The RayClusterSpec fields the manifests use (KubeRay ray.io/v1)."""
    assert spec["rayVersion"] == "2.60.0"
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    assert head["template"]["spec"]["containers"][0]["image"]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and group["minReplicas"] <= group["replicas"]
        assert group["replicas"] <= group["maxReplicas"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        assert group["template"]["spec"]["containers"][0]["image"]


def test_kuberay_rayjob():
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    allowed = {"entrypoint", "runtimeEnvYAML", "submissionMode", "shutdownAfterJobFinishes",
               "ttlSecondsAfterFinished", "activeDeadlineSeconds", "rayClusterSpec"}  # fmt: skip
    assert set(spec) <= allowed, set(spec) - allowed
    assert spec["entrypoint"].startswith("python -m pagedserve.cluster.job ")
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode")
    assert isinstance(yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"], dict)
    _check_ray_cluster_spec(spec["rayClusterSpec"])


def test_kuberay_manifests_all_load():
    files = sorted((DEPLOY / "kuberay").glob("*.yaml"))
    assert files
    for f in files:
        docs = list(yaml.safe_load_all(f.read_text()))
        for d in docs:
            assert (d["apiVersion"], d["kind"]) in {
                ("ray.io/v1", "RayJob"),
                ("ray.io/v1", "RayService"),
                ("v1", "Service"),
            }, f


def _check_serve_config(cfg: dict) -> None:
    """A Ray Serve config that Ray's own schema accepts and whose application builds."""
    from ray.serve.schema import ServeDeploySchema

    from pagedserve.cluster.serve_app import app, cluster_config_from_args

    schema = ServeDeploySchema.model_validate(cfg)  # raises on unknown / mistyped fields
    (application,) = schema.applications
    assert application.import_path == "pagedserve.cluster.serve_app:app"
    args = application.args
    config = cluster_config_from_args(args["serve_args"])  # the options parse
    assert config.server.http_port is None and config.ray_address == "auto"
    assert app(args) is not None  # the builder accepts exactly these args
    (dep,) = application.deployments
    assert dep.name == "PagedServeDeployment" and dep.num_replicas == 1


def test_serve_config_yaml():
    cfg = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    _check_serve_config(cfg)
    assert cfg["http_options"]["host"] == "127.0.0.1"  # loopback unless asked


def test_kuberay_rayservice():
    svc = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert svc["apiVersion"] == "ray.io/v1" and svc["kind"] == "RayService"
    spec = svc["spec"]
    assert set(spec) <= {"serveConfigV2", "rayClusterConfig", "upgradeStrategy"}, set(spec)
    assert spec["upgradeStrategy"]["type"] in ("NewCluster", "None")
    serve_cfg = yaml.safe_load(spec["serveConfigV2"])  # KubeRay takes it as a string
    _check_serve_config(serve_cfg)
    _check_ray_cluster_spec(spec["rayClusterConfig"])
    # The replica is pinned to the head by a custom resource the head (only) offers.
    (dep,) = serve_cfg["applications"][0]["deployments"]
    (res,) = dep["ray_actor_options"]["resources"]
    head = spec["rayClusterConfig"]["headGroupSpec"]
    # rayStartParams.resources is a quoted JSON string (KubeRay passes it to `ray start`).
    assert res in json.loads(json.loads(head["rayStartParams"]["resources"]))
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    grpc = yaml.safe_load((DEPLOY / "kuberay" / "grpc-service.yaml").read_text())
    assert {p["targetPort"] for p in grpc["spec"]["ports"]} <= ports
    assert "--port 50051" in serve_cfg["applications"][0]["args"]["serve_args"]
