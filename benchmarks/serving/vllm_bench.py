"""pagedserve against vLLM's CPU build through HTTP, driven by vLLM's own ``vllm bench serve``.

Systems (each an OpenAI-compatible HTTP server in its own process, one up at a time):

* ``pagedserve-<dtype>``: ``pagedserve serve`` with its default flags and ``--dtype``
  (``--pagedserve-dtypes auto,float32`` runs both);
* ``vllm-auto-*``: vLLM's CPU build (:data:`VLLM_SPEC`, in the venv of ``vllm_venv.py``)
  with ``--dtype auto``, its default: an fp32 checkpoint runs in bf16 on a CPU with native
  bf16 (the dtype vLLM resolved is read from its log and reported);
* ``vllm-fp32-*``: the matched precision, ``--dtype float32``;
* ``*-default``: vLLM reserves one core for its engine-core process; ``*-both-cores``:
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` gives the model every core.

Every server gets the same model folder (``--model``, resolved as ``make model`` does), the
same KV memory (``--kv-cache-memory`` / ``VLLM_CPU_KVCACHE_SPACE``, ``--kv-cache-gib``),
the same ``--max-model-len`` and prefix caching on. vLLM's server is started from a
temporary folder: ``python -m`` puts the working folder on ``sys.path``, and none of
the repository's folders should be importable there.

Client: ``vllm.benchmarks.serve`` (the code behind ``vllm bench serve``; the ``vllm``
command itself fails in the vllm-cpu venv) in the vLLM venv, ``--backend openai``
(``/v1/completions``; ``--backend openai-chat`` for chat), greedy, ``--ignore-eos`` so every
system generates the same tokens, ``--save-result``. Workloads (:func:`workloads`):
ShareGPT (``sharegpt.py`` prepares the data), random 512 in / 128 out, ``prefix_repetition``
and a Poisson arrival stream. ``--rounds`` rounds: round r starts every system once, the
order rotated by r, and runs every workload against it; each figure is the median over
rounds. Ratios are pagedserve over vLLM for every metric (below 1 is better for latencies,
above 1 for throughput) against each vLLM configuration, the better one overall and the
better one in its default precision.

Usage::

    .venv/bin/python benchmarks/serving/vllm_bench.py          # the full run, idle machine
    .venv/bin/python benchmarks/serving/vllm_bench.py --quick \
        --systems pagedserve-auto,vllm-auto-default             # smoke run, a few minutes

Writes ``benchmarks/results/vllm_bench.json`` and, where matplotlib imports,
``vllm_bench.png`` (``--quick``: ``benchmarks/.data/vllm_bench_quick.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vllm_bench_report
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the rest
from server_process import free_port, start_server, stop_server, wait_healthy
from sharegpt import DATA_DIR, ensure_sharegpt
from vllm_bench_report import markdown, plot, summarize
from vllm_venv import VLLM_SPEC, ensure_vllm_venv

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent  # benchmarks/
ROOT = BENCH.parent
RESULTS = BENCH / "results"

SERVED_NAME = "smollm2"
DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# Run inside the vLLM venv: vllm.benchmarks.serve's own parser and main (`vllm bench serve`).
CLIENT_CODE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class System:
    """One server configuration.

    Attributes:
        name: its name in the report (``pagedserve-auto``, ``vllm-auto-default``, ...).
        kind: ``"pagedserve"`` or ``"vllm"``.
        dtype: the ``--dtype`` it is started with.
        both_cores: vLLM only: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (no core reserved for
            its engine-core process).
    """

    name: str
    kind: str
    dtype: str
    both_cores: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("pagedserve", "vllm"):
            raise ValueError(f"System.kind must be 'pagedserve' or 'vllm', got {self.kind!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"System.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.both_cores and self.kind != "vllm":
            raise ValueError("System.both_cores applies to vLLM only")


@dataclass(frozen=True)
class Workload:
    """One ``vllm bench serve`` run: its dataset flags and its load.

    Attributes:
        name: its name in the report.
        dataset_args: the ``--dataset-name`` flags.
        num_prompts: requests sent.
        max_concurrency: requests in flight at most (None: no limit).
        request_rate: Poisson arrivals per second (None: all at once).
    """

    name: str
    dataset_args: tuple[str, ...]
    num_prompts: int
    max_concurrency: int | None = None
    request_rate: float | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"Workload.num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"Workload.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"Workload.request_rate must be > 0, got {self.request_rate}")


def default_systems(pagedserve_dtypes: list[str]) -> list[System]:
    """pagedserve in each of ``pagedserve_dtypes``, then vLLM in its default precision and
    in fp32, each with one core reserved for its engine core and with both cores."""
    out = [System(f"pagedserve-{d}", "pagedserve", d) for d in pagedserve_dtypes]
    for dtype, tag in (("auto", "auto"), ("float32", "fp32")):
        out.append(System(f"vllm-{tag}-default", "vllm", dtype))
        out.append(System(f"vllm-{tag}-both-cores", "vllm", dtype, both_cores=True))
    return out


def workloads(sharegpt_path: str, quick: bool = False) -> list[Workload]:
    """The workloads of the comparison (``quick``: one small random workload)."""
    if quick:
        rnd = ("--dataset-name", "random", "--random-input-len", "128")
        return [Workload("random-128-32", (*rnd, "--random-output-len", "32"), 8, 8)]
    return [
        Workload("sharegpt", ("--dataset-name", "sharegpt", "--dataset-path", sharegpt_path),
                 128, max_concurrency=64),
        Workload("random-512-128", ("--dataset-name", "random", "--random-input-len", "512",
                                    "--random-output-len", "128"), 64, max_concurrency=64),
        Workload("prefix-4x512", ("--dataset-name", "prefix_repetition",
                                  "--prefix-repetition-num-prefixes", "4",
                                  "--prefix-repetition-prefix-len", "512",
                                  "--prefix-repetition-suffix-len", "64",
                                  "--prefix-repetition-output-len", "128"), 64, max_concurrency=16),
        Workload("poisson-2rps-256-64", ("--dataset-name", "random", "--random-input-len", "256",
                                         "--random-output-len", "64"), 64, request_rate=2.0),
        # the "32 x 64 all at once": 32 chat-length prompts, 64 tokens each, one burst
        Workload("burst-32x64", ("--dataset-name", "random", "--random-input-len", "128",
                                 "--random-output-len", "64"), 32, max_concurrency=32),
    ]  # fmt: skip


def rotated(systems: list[System], rnd: int) -> list[System]:
    """The order of round ``rnd``: ``systems`` rotated left by ``rnd``."""
    k = rnd % len(systems)
    return systems[k:] + systems[:k]


# ---------------------------------------------------------------------- command lines
def server_command(
    system: System,
    *,
    model_dir: str,
    port: int,
    kv_cache_gib: int,
    max_model_len: int,
    vllm_python: str | None,
    pagedserve_args: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command line and the extra environment that start ``system`` on ``port``
    (``pagedserve_args``: appended to a pagedserve system's command line).

    Raises:
        ValueError: for a vLLM system without ``vllm_python``.
    """
    common = ["--host", "127.0.0.1", "--max-model-len", str(max_model_len), "--dtype",
              system.dtype, "--served-model-name", SERVED_NAME]  # fmt: skip
    if system.kind == "pagedserve":
        cli = str(Path(sys.executable).with_name("pagedserve"))
        cmd = [cli, "serve", "--model", model_dir, "--http-port", str(port),
               "--port", str(free_port()), "--kv-cache-memory", f"{kv_cache_gib}G", *common,
               *pagedserve_args]  # fmt: skip
        return cmd, {}  # prefix caching is on by default (--no-prefix-caching turns it off)
    if vllm_python is None:
        raise ValueError(f"{system.name} needs the vLLM venv's python")
    cmd = [vllm_python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model",
           model_dir, "--port", str(port), "--enable-prefix-caching", "--seed", "0", *common]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    if system.both_cores:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return cmd, env


def client_args(
    workload: Workload,
    *,
    base_url: str,
    model_dir: str,
    backend: str,
    result_dir: str,
    result_filename: str,
    seed: int,
) -> list[str]:
    """The ``vllm bench serve`` arguments of one workload against ``base_url``.

    Raises:
        ValueError: for a backend other than those of :data:`BACKENDS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    args = [
        "--backend", backend, "--base-url", base_url, "--endpoint", BACKENDS[backend],
        "--model", model_dir, "--tokenizer", model_dir, "--served-model-name", SERVED_NAME,
        *workload.dataset_args, "--num-prompts", str(workload.num_prompts),
        "--seed", str(seed), "--temperature", "0", "--ignore-eos", "--num-warmups", "1",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", result_dir, "--result-filename", result_filename,
        "--disable-tqdm",
    ]  # fmt: skip
    if workload.max_concurrency is not None:
        args += ["--max-concurrency", str(workload.max_concurrency)]
    if workload.request_rate is not None:
        args += ["--request-rate", f"{workload.request_rate:g}"]
    return args


def resolved_vllm_dtype(log: str) -> str | None:
    """The dtype vLLM's engine-config log line names (``dtype=torch.bfloat16``), if any."""
    m = re.search(r"dtype=torch\.(\w+)", log)
    return m.group(1) if m else None


# ---------------------------------------------------------------------- running
def run_system(
    system: System, loads: list[Workload], args: argparse.Namespace, ctx: dict[str, Any]
) -> dict[str, Any]:
    """Start ``system``, run every workload of ``loads`` against it, stop it.

    Returns ``{"results": {workload: vllm result dict or None}, "startup_s", ...}``; a
    server that does not come up yields ``{"error": ...}`` with its log's tail.
    """
    port = free_port()
    cmd, extra_env = server_command(
        system, model_dir=ctx["model_dir"], port=port, kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len, vllm_python=ctx["vllm_python"],
        pagedserve_args=tuple(shlex.split(args.pagedserve_args)),
    )  # fmt: skip
    run_dir = Path(ctx["run_dir"]) / f"round{ctx['round']}-{system.name}"
    log_path = run_dir / "server.log"
    with tempfile.TemporaryDirectory() as cwd:  # never the repository root (see above)
        proc = start_server(cmd, {**os.environ, **extra_env}, Path(cwd), log_path)
        out: dict[str, Any] = {"results": {}, "server_log": str(log_path)}
        try:
            out["startup_s"] = round(
                wait_healthy(proc, f"http://127.0.0.1:{port}/health", args.startup_timeout), 1
            )
            for wl in loads:
                out["results"][wl.name] = run_client(wl, port, run_dir, args, ctx, cwd)
        except (RuntimeError, TimeoutError) as exc:
            tail = log_path.read_text(errors="replace")[-3000:]
            print(f"{system.name}: {exc}\n{tail}", flush=True)
            out.update(error=str(exc), log_tail=tail)
        finally:
            out["server_rc"] = stop_server(proc)
    if system.kind == "vllm":
        out["resolved_dtype"] = resolved_vllm_dtype(log_path.read_text(errors="replace"))
    return out


def run_client(
    wl: Workload,
    port: int,
    run_dir: Path,
    args: argparse.Namespace,
    ctx: dict[str, Any],
    cwd: str,
) -> dict[str, Any] | None:
    """One ``vllm bench serve`` run; its saved result, or None when it failed."""
    name = f"{wl.name}.json"
    cargs = client_args(
        wl, base_url=f"http://127.0.0.1:{port}", model_dir=ctx["model_dir"],
        backend=args.backend, result_dir=str(run_dir), result_filename=name, seed=args.seed,
    )  # fmt: skip
    t0 = time.perf_counter()
    with open(run_dir / f"{wl.name}.client.log", "wb") as log:
        try:
            rc = subprocess.run(
                [ctx["vllm_python"], "-c", CLIENT_CODE, *cargs], cwd=cwd, stdout=log,
                stderr=subprocess.STDOUT, timeout=args.client_timeout, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = -1
    path = run_dir / name
    if rc != 0 or not path.exists():
        print(f"  {wl.name}: client failed (rc {rc}); see {run_dir / (wl.name + '.client.log')}")
        return None
    res = json.loads(path.read_text())
    print(
        f"  {wl.name}: {res['output_throughput']:.1f} tok/s, TTFT mean "
        f"{res['mean_ttft_ms']:.0f} ms, TPOT mean {res['mean_tpot_ms']:.1f} ms, "
        f"{res['completed']}/{wl.num_prompts} done ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return res


# ---------------------------------------------------------------------- main
def code_version() -> str:
    """The short commit of the repository, with ``+dirty`` when tracked files differ."""

    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="as `pagedserve serve --model`")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 small random prompts, 1 round")  # fmt: skip
    ap.add_argument("--systems", default=None,
                    help="comma-separated system names (default: all)")  # fmt: skip
    ap.add_argument("--pagedserve-dtypes", default="auto",
                    help="comma-separated `pagedserve serve --dtype` values, one system each")  # fmt: skip
    ap.add_argument("--workloads", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="openai")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="KV memory of every server")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=1800,
        help="seconds for /health (vLLM compiles its model at its first start)",
    )
    ap.add_argument("--client-timeout", type=float, default=3600, help="seconds per workload")
    ap.add_argument(
        "--pagedserve-args",
        default="",
        help="extra `pagedserve serve` flags, e.g. '--max-num-batched-tokens 1024'",
    )
    ap.add_argument("--out", default=None, help="the JSON (the plot goes next to it)")
    return ap


def select(args: argparse.Namespace, sharegpt_path: str) -> tuple[list[System], list[Workload]]:
    """The systems and workloads the parsed ``args`` name.

    Raises:
        ValueError: for an unknown system or workload name, or no system.
    """
    systems = default_systems(args.pagedserve_dtypes.split(","))
    if args.systems:
        wanted = args.systems.split(",")
        unknown = set(wanted) - {s.name for s in systems}
        if unknown:
            raise ValueError(
                f"unknown systems {sorted(unknown)}; known: {[s.name for s in systems]}"
            )
        systems = [s for s in systems if s.name in wanted]
    loads = workloads(sharegpt_path, args.quick)
    if args.workloads:
        wanted = args.workloads.split(",")
        unknown = set(wanted) - {w.name for w in loads}
        if unknown:
            raise ValueError(
                f"unknown workloads {sorted(unknown)}; known: {[w.name for w in loads]}"
            )
        loads = [w for w in loads if w.name in wanted]
    if not systems or not loads:
        raise ValueError("no system or no workload selected")
    return systems, loads


def main(argv: list[str] | None = None) -> None:
    """Run the comparison and write its JSON and plot."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds = 1
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: servers are stopped
    need_sharegpt = not args.quick and (not args.workloads or "sharegpt" in args.workloads)
    sharegpt_path = str(ensure_sharegpt()) if need_sharegpt else ""
    systems, loads = select(args, sharegpt_path)

    from pagedserve.worker.model_store import resolve_model

    commit = code_version()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    ctx: dict[str, Any] = {
        "model_dir": str(resolve_model(args.model, progress=True)),
        "vllm_python": str(ensure_vllm_venv()),  # vLLM's servers and the client, always
        "run_dir": str(DATA_DIR / "vllm_bench_runs" / stamp),
    }
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    for rnd in range(args.rounds):
        ctx["round"] = rnd + 1
        for system in rotated(systems, rnd):
            print(f"round {rnd + 1}/{args.rounds}: {system.name}", flush=True)
            runs[system.name].append(run_system(system, loads, args, ctx))

    summary = summarize(runs, [w.name for w in loads], [s.name for s in systems])
    machine = (
        f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"cores, load avg {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    )
    command = " ".join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)])
    md = markdown(summary, f"{time.strftime('%Y-%m-%d')}, {machine}, code {commit}: `{command}`")
    print("\n" + md)
    out = Path(args.out) if args.out else (
        DATA_DIR / "vllm_bench_quick.json" if args.quick else RESULTS / "vllm_bench.json"
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine,
        "command": command,
        "commit": commit,
        "vllm": VLLM_SPEC,
        "model": ctx["model_dir"],
        "kv_cache_gib": args.kv_cache_gib,
        "max_model_len": args.max_model_len,
        "backend": args.backend,
        "rounds": args.rounds,
        "systems": [vars(s) for s in systems],
        "workloads": [vars(w) | {"dataset_args": list(w.dataset_args)} for w in loads],
        "raw_results_dir": ctx["run_dir"],
        "servers": {  # per system, one entry per round: start-up, resolved dtype, errors
            name: [{k: v for k, v in r.items() if k != "results"} for r in rs]
            for name, rs in runs.items()
        },
        **summary,
        "markdown": md,
    }
    out.write_text(json.dumps(meta, indent=2))
    png = out.with_suffix(".png")
    if plot(summary, png):
        print(f"wrote {out} and {png}")
    else:
        print(f"wrote {out} (no plot: no run counted, or no matplotlib)")


if __name__ == "__main__":
    main()
