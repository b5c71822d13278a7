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

from pagedserve.cluster.cli import build_parser
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
    assert spec["entrypoint"].startswith("python -m pagedserve.cluster.job bench ")
    # The rest are the job's bench flags and `pagedserve serve` options.
    argv = spec["entrypoint"].split()[4:]
    args, job_flags = build_parser().parse_known_args(["serve", *argv])
    assert job_flags[::2] == ["--concurrency", "--requests", "--max-tokens"]
    assert args.device == "cuda"  # GPU workers, or a clear error; never CPU ones by default
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
    deps = {d.name: d.num_replicas for d in application.deployments}
    # One cluster replica (the scheduler owns all block metadata); HTTP frontends scale.
    assert deps["PagedServeCluster"] == 1 and deps["PagedServeDeployment"] >= 1, deps


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
    # The replicas are pinned to the head by a custom resource the head (only) offers, with
    # room for all of them.
    deps = serve_cfg["applications"][0]["deployments"]
    head = spec["rayClusterConfig"]["headGroupSpec"]
    # rayStartParams.resources is a quoted JSON string (KubeRay passes it to `ray start`).
    offered = json.loads(json.loads(head["rayStartParams"]["resources"]))
    (res,) = {r for d in deps for r in d["ray_actor_options"]["resources"]}
    wanted = sum(d["num_replicas"] * d["ray_actor_options"]["resources"][res] for d in deps)
    assert offered[res] >= wanted, (offered, wanted)
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    front = yaml.safe_load((DEPLOY / "kuberay" / "frontend-service.yaml").read_text())
    # gRPC and HTTP both from the head: the GPU pods are Ready but run no Serve proxy.
    assert front["spec"]["selector"] == {"ray.io/node-type": "head", "ray.io/serve": "true"}
    assert {p["targetPort"] for p in front["spec"]["ports"]} == {50051, 8000} <= ports
    args = serve_cfg["applications"][0]["args"]["serve_args"]
    assert "--port 50051" in args
    assert serve_cfg["http_options"]["port"] == 8000


def _rayservice() -> dict:
    return yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())


def _cluster_specs() -> dict[str, dict]:
    """The RayClusterSpec of each KubeRay manifest, by file name."""
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    return {
        "rayservice.yaml": _rayservice()["spec"]["rayClusterConfig"],
        "rayjob.yaml": job["spec"]["rayClusterSpec"],
    }


def _pod_templates() -> list[tuple[str, dict]]:
    """(where, pod template) of every Ray pod the manifests create."""
    out = []
    for name, spec in _cluster_specs().items():
        out.append((f"{name} head", spec["headGroupSpec"]["template"]))
        out += [(f"{name} {g['groupName']}", g["template"]) for g in spec["workerGroupSpecs"]]
    return out


def _serve_config() -> dict:
    return yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])


def test_rayservice_gpu_pods_become_ready():
    # Serve starts a proxy only on the head and on nodes with a Serve replica; the GPU pods
    # host none, so KubeRay's default worker probe (raylet and a local proxy on 8000) would
    # never pass. The override checks the raylet only.
    assert _serve_config()["proxy_location"] == "EveryNode"
    for group in _rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        probe = " ".join(container["readinessProbe"]["exec"]["command"])
        assert "localhost:52365/api/local_raylet_healthz" in probe
        assert ":8000" not in probe and "healthz | grep success" in probe


def test_gpu_groups_tolerate_the_gpu_taint_and_ask_for_gpus():
    for name, spec in _cluster_specs().items():
        for group in spec["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            (container,) = pod["containers"]
            res = container["resources"]
            assert int(res["limits"]["nvidia.com/gpu"]) >= 1, name
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"], name
            tol = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            assert tol in pod["tolerations"], name
        # The head needs no GPU (and so no toleration): it schedules anywhere.
        head = spec["headGroupSpec"]["template"]["spec"]
        assert "nvidia.com/gpu" not in head["containers"][0]["resources"]["limits"]


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]]


def test_every_ray_pod_mounts_a_memory_backed_dev_shm():
    for where, tmpl in _pod_templates():
        pod = tmpl["spec"]
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert vol["emptyDir"]["medium"] == "Memory", where
        # Memory-backed: it counts against the container's limit, so it must leave room.
        shm, limit = (
            _bytes(vol["emptyDir"]["sizeLimit"]),
            _bytes(container["resources"]["limits"]["memory"]),
        )
        assert 1 << 30 <= shm <= limit // 4, where


def test_rayservice_api_key_comes_from_a_secret():
    from pagedserve.cluster.auth import API_KEY_ENV

    head = _rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    (env,) = [e for e in head["containers"][0]["env"] if e["name"] == API_KEY_ENV]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "pagedserve-api-key", "key": "api-key"}
    assert "value" not in env
    serve_args = _serve_config()["applications"][0]["args"]["serve_args"]
    assert "--api-key" not in serve_args  # a flag would put the key in the manifest


def test_rayservice_serves_on_cuda_with_the_sized_kv_cache():
    from pagedserve.cluster.serve_app import cluster_config_from_args

    serve_args = _serve_config()["applications"][0]["args"]["serve_args"]
    config = cluster_config_from_args(serve_args)
    assert config.device == "cuda"
    assert config.cache.kv_cache_memory == 18 << 30  # the table's L4 row for SmolLM2


def test_rayservice_kv_sizing_table_adds_up():
    # Rows "GPU (M GiB)  M-w-1-a-r = KV: NG ...": each difference and its floor as given.
    text = (DEPLOY / "kuberay" / "rayservice.yaml").read_text()
    sums = re.findall(r"([\d.]+(?:-[\d.]+){4}) = ([\d.]+): (\d+)G", text)
    assert len(sums) == 8  # 4 GPUs x 2 models
    for expr, result, kv in sums:
        total, *minus = (float(x) for x in expr.split("-"))
        assert abs(total - sum(minus) - float(result)) < 0.06, expr
        assert int(kv) == int(float(result)), expr
        assert minus[-1] == pytest.approx(total / 10, abs=0.01), expr  # the 10% margin


def test_pod_templates_validate_against_the_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    version = kv.latest_version()
    for where, tmpl in _pod_templates():
        doc = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": tmpl,
        }
        try:
            kv.validate(doc, version, strict=True)  # strict: unknown fields fail too
        except kv.ValidationError as e:
            pytest.fail(f"{where}: {e}")
    front = yaml.safe_load((DEPLOY / "kuberay" / "frontend-service.yaml").read_text())
    kv.validate(front, version, strict=True)
    # A pod-level field put on the container is caught.
    broken = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
              "template": {"spec": {"containers": [{"name": "c", "tolerations": []}]}}}  # fmt: skip
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, version, strict=True)
