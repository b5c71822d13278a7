"""The prepared GPU check (``make gpu-check``): everything a first GPU session should measure.

Built for a bare CUDA image (Python 3.12, torch + triton, pytest, hypothesis,
transformers; no Ray, no gRPC, no network, no model files) and a budget of under 8
minutes. It does not need pagedserve installed: it puts the repository's ``pagedserve/kernels/``,
``worker/`` and ``scheduler/`` folders on the path as ``pagedserve.*`` (a temporary
directory of symlinks) and imports only modules that need none of Ray, gRPC or protobuf
(``pagedserve.kernels``, ``pagedserve.worker.{arch,model,kv_pool,model_runner,...}``,
``pagedserve.scheduler.{scheduler,outputs,...}``; ``scheduler.actor`` and ``cluster/``
are never imported). Phases, each bounded by a timeout and recorded even when it fails:

1. ``kernel_tests``: ``pytest tests/kernels`` (compiled Triton on the GPU; under the
   interpreter with ``--cpu-smoke``);
2. ``kernels``: ``benchmarks/kernels/kernels.py --quick``: decode attention GB/s vs the HBM peak
   (4.8 TB/s on an H200) over batch x context, each point cycled over enough copies of its
   tensors to read >= 2x L2 (50 MB on an H200) from one use of a copy to its next, and its error
   against the torch reference; prefill TFLOP/s vs torch SDPA. The phase fails unless the
   JSON holds decode and prefill points (no matplotlib on the image: no plot, same JSON);
   with ``--cpu-smoke`` the same script with ``--cpu-smoke`` (tiny shapes, interpreter);
3. ``decode_loop``: the :class:`ModelRunner` (no Ray) with random weights in Llama-3-8B
   shapes, bf16, driven by the real :class:`Scheduler` through the engine loop that serves
   (:class:`EngineLoop`, serial, over an :class:`InlineWorker`): for each batch size
   (1..256) prefill ``--prompt-len`` tokens per sequence, then time decode steps. Reports
   tokens/s, and from a ``torch.profiler`` trace of a few steps the share of the step's
   wall time spent in attention kernels, GEMM kernels, other kernels, and host overhead
   (wall time with no kernel running).

4. ``tensor_parallel``: with two or more GPUs, the tiny-model tensor-parallel tests at
   T = 2 on CUDA (NCCL, one GPU per rank; :func:`tensor_parallel`); skipped otherwise. With
   ``--cpu-smoke``, one of them on CPU over gloo.

Goals from the issue: decode attention >= 85% of HBM peak at long context; host
overhead <= 10% of a step at batch 64. Writes ``benchmarks/results/gpu_check.json`` (or
``gpu_check_cpu_smoke.json``).

``--cpu-smoke`` runs the same code paths on CPU with tiny shapes (kernels under
``TRITON_INTERPRET=1``, a 2-layer model, batches 1..4), to check on a machine without a
GPU that the real run will not fail on an import or a typo. The phases' subprocesses run
under the same import hook (:func:`hooked`), so Ray, gRPC, protobuf and matplotlib are
missing in them too. What only a GPU run covers: compiled Triton, the native bf16
``tl.dot`` (the interpreter upcasts bf16 to fp32 first; fp16 keeps its 16-bit dot there),
CUDA-event timing and the L2 rotation's effect.

Usage::

    python benchmarks/engine/gpu_check.py              # on the GPU machine (make gpu-check)
    python benchmarks/engine/gpu_check.py --cpu-smoke  # anywhere
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
# pagedserve.<name> -> its folder in the repository (package-dir of pyproject.toml)
PACKAGES = {"kernels": "pagedserve/kernels", "worker": "worker", "scheduler": "scheduler"}
FORBIDDEN = (
    "ray", "grpc", "google.protobuf", "matplotlib", "pagedserve.cluster", "pagedserve.v1",
)  # fmt: skip
# Runs a script or module (argv[1], "-m name" for a module) under ForbidImports, so the
# phases' subprocesses meet the bare image's missing packages too.
HOOKED = """
import importlib.util, runpy, sys
spec = importlib.util.spec_from_file_location("gpu_check_hook", {script!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.meta_path.insert(0, mod.ForbidImports())
if sys.argv[1] == "-m":
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""

# Llama-3-8B (Meta, 2024): config.json of meta-llama/Meta-Llama-3-8B.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
TINY = {
    **LLAMA3_8B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ATTENTION_KERNELS = re.compile(r"decode|prefill|store_kv|copy_blocks|attn|attention|paged", re.I)
GEMM_KERNELS = re.compile(r"gemm|gemv|cutlass|nvjet|xmma|cublas|splitk|aten::(mm|addmm|bmm)", re.I)


class ForbidImports(importlib.abc.MetaPathFinder):
    """An import hook that makes ``FORBIDDEN`` modules missing, as on the bare GPU image.

    Installed first on ``sys.meta_path`` by :func:`main`, so that a run in the project's
    full venv fails on the same imports the bare image would (a module-level ``import
    grpc`` reached from the model path, say) instead of passing here and failing on the
    one GPU try.
    """

    def __init__(self, forbidden: tuple[str, ...] = FORBIDDEN) -> None:
        self.forbidden = forbidden

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        """Raises ``ModuleNotFoundError`` for a forbidden module; ``None`` otherwise."""
        if any(fullname == f or fullname.startswith(f + ".") for f in self.forbidden):
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (not on the bare GPU image)", name=fullname
            )
        return None


def tensor_parallel(env: dict[str, str], smoke: bool, timeout_s: int) -> dict[str, Any]:
    """``pytest tests/e2e/test_tensor_parallel.py -k tiny``: T = 2 ranks (NCCL, one GPU
    each) give HF's and T = 1's greedy tokens; skipped with fewer than 2 GPUs. With
    ``--cpu-smoke`` the same tests on CPU over gloo (the Llama case only)."""
    import torch

    if not smoke and torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU(s): tensor parallelism needs 2"}
    args = hooked("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                  str(REPO / "tests" / "e2e" / "test_tensor_parallel.py"),
                  "-k", "Llama and tiny" if smoke else "tiny")  # fmt: skip
    run_env = dict(env, PAGEDSERVE_TP_TEST_DEVICE="cpu" if smoke else "cuda")
    proc = subprocess.run(
        args, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=timeout_s
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    print("\n".join(tail), flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exited {proc.returncode}: {tail[-1] if tail else ''}")
    return {"returncode": proc.returncode, "summary": tail[-1] if tail else ""}


def hooked(*argv: str) -> list[str]:
    """A command line running ``argv`` (a script path, or ``-m module``, and its arguments)
    in this python under :class:`ForbidImports`."""
    return [sys.executable, "-c", HOOKED.format(script=str(Path(__file__).resolve())), *argv]


def package_shim() -> Path:
    """A directory holding ``pagedserve/<pkg>`` symlinks to the repository folders."""
    root = Path(tempfile.mkdtemp(prefix="pagedserve-shim-"))
    (root / "pagedserve").mkdir()
    for pkg, folder in PACKAGES.items():
        (root / "pagedserve" / pkg).symlink_to(REPO / folder, target_is_directory=True)
    return root


def run_phase(name: str, fn: Callable[[], Any], report: dict[str, Any]) -> None:
    """Run one phase, recording its result or its error and its duration."""
    start = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        report[name] = {"ok": True, "result": fn()}
    except Exception as exc:
        traceback.print_exc()
        report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(f"== {name}: {'ok' if report[name]['ok'] else 'FAILED'} "
          f"in {report[name]['seconds']} s", flush=True)  # fmt: skip


def kernel_tests(env: dict[str, str], smoke: bool, timeout_s: int) -> dict[str, Any]:
    """``pytest tests/kernels`` in a subprocess; returns its summary line and exit code."""
    args = hooked("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                  str(REPO / "tests" / "kernels"))  # fmt: skip
    if smoke:  # the interpreter is slow: a few of each kernel's tests
        args += ["-k", "test_kernels_triton and (64 or block) and not 128", "--maxfail=1"]
    proc = subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    print("\n".join(tail), flush=True)
    if proc.returncode not in (0, 5):  # 5: nothing selected
        raise RuntimeError(f"pytest exited {proc.returncode}: {tail[-1] if tail else ''}")
    return {"returncode": proc.returncode, "summary": tail[-1] if tail else ""}


def kernel_bench(env: dict[str, str], out_dir: Path, smoke: bool, timeout_s: int) -> dict[str, Any]:
    """``benchmarks/kernels/kernels.py --quick --dtype bf16`` (``--cpu-smoke`` with ``smoke``)
    under :class:`ForbidImports`; returns the JSON it wrote.

    Raises:
        RuntimeError: it exited non-zero or wrote no decode or prefill point.
    """
    path = out_dir / "kernels.json"
    path.unlink(missing_ok=True)  # a stale file must not pass for this run's
    script = str(REPO / "benchmarks" / "kernels" / "kernels.py")
    argv = [script, "--quick", "--dtype", "bf16", "--out", str(out_dir)]
    proc = subprocess.run(
        hooked(*argv, *(["--cpu-smoke"] if smoke else [])),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    print((proc.stdout + proc.stderr)[-3000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks/kernels/kernels.py exited {proc.returncode}")
    results = json.loads(path.read_text()) if path.exists() else {}
    if not results.get("decode") or not results.get("prefill"):
        raise RuntimeError(f"benchmarks/kernels/kernels.py wrote no figures: {proc.stdout[-500:]}")
    return results


def random_runner(config: dict[str, Any], device: str, dtype: str, kv_bytes: int) -> Any:
    """A :class:`ModelRunner` on random weights in ``config``'s shapes (no model files).

    The config goes to a temporary ``config.json`` (what :class:`ModelArch` reads), and
    the runner's weight loader is swapped for one that builds the model on the device and
    fills it with N(0, 0.02) weights (ones for the norms), as an initialised model would be.
    """
    import torch

    import pagedserve.worker.model_runner as runner_mod
    from pagedserve.worker.arch import ModelArch
    from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
    from pagedserve.worker.model import LlamaForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    (folder / "config.json").write_text(json.dumps(config))
    # An empty safetensors file (8-byte header length, then "{}"): the weights come from
    # load_random below, but the worker's get_info hashes the folder's weight files.
    (folder / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")

    def load_random(
        _path: Any, arch: ModelArch, max_positions: int, dt: torch.dtype, dev: torch.device,
        backend: str,
    ) -> LlamaForCausalLM:  # fmt: skip
        with torch.device("meta"):
            model = LlamaForCausalLM(arch, max_positions, backend)
        model.to_empty(device=dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.data = param.data.to(dt)
                if name.endswith("norm.weight") or "layernorm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=gen)
        model.rotary_emb.reset_tables()
        return model.eval()

    runner_mod.resolve_model = lambda _cfg, **_kw: folder  # type: ignore[assignment]
    runner_mod.load_model = load_random  # type: ignore[assignment]
    wcfg = WorkerConfig(
        model=ModelConfig(
            model=str(folder),
            dtype=dtype,
            max_model_len=min(2048, config["max_position_embeddings"]),
        ),
        cache=CacheConfig(kv_cache_memory=kv_bytes),
        device=device,
    )
    return runner_mod.ModelRunner(wcfg)


def step_shares(prof: Any, wall_s: float, steps: int, cuda: bool) -> dict[str, float]:
    """Share of step wall time in attention / GEMM / other kernels and host overhead."""
    totals = {"attention": 0.0, "gemm": 0.0, "other_kernels": 0.0}
    for evt in prof.key_averages():
        if cuda:
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = getattr(evt, "self_cuda_time_total", 0.0)
            if not us or evt.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
                continue  # host-side op records (their kernels are counted by name)
        else:
            us = evt.self_cpu_time_total
            if not evt.key.startswith("aten::") or evt.key in ("aten::empty", "aten::view"):
                continue
        if ATTENTION_KERNELS.search(evt.key):
            totals["attention"] += us
        elif GEMM_KERNELS.search(evt.key):
            totals["gemm"] += us
        else:
            totals["other_kernels"] += us
    wall_us = wall_s * 1e6
    shares = {k: round(v / wall_us, 4) for k, v in totals.items()}
    shares["host_overhead"] = round(max(0.0, 1.0 - sum(totals.values()) / wall_us), 4)
    shares["step_ms"] = round(1e3 * wall_s / steps, 3)
    return shares


def decode_loop(smoke: bool, batches: list[int], prompt_len: int, steps: int) -> list[dict]:
    """The ModelRunner decode loop at each batch size (see the module docstring).

    The steps run through the engine loop that serves (:class:`EngineLoop`), serial, over
    an :class:`InlineWorker`: each step runs on this thread, so the profiler traces it and
    the timed window holds whole steps. ``run_until_idle(until=...)`` runs each phase
    (prefill, warm-up, timed decodes, profiled decodes) for a fixed number of steps.
    """
    import asyncio

    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.scheduler.config import SchedulerConfig
    from pagedserve.scheduler.engine_loop import EngineLoop, InlineWorker
    from pagedserve.scheduler.engine_messages import EngineRequest, SequenceOutput
    from pagedserve.scheduler.sampling_params import SamplingParams
    from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec

    cuda = torch.cuda.is_available() and not smoke
    config = TINY if smoke else LLAMA3_8B
    kv_bytes = (64 << 20) if smoke else (48 << 30)
    runner = random_runner(config, "cuda" if cuda else "cpu", "bfloat16", kv_bytes)
    info = runner.get_info()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    aio = asyncio.new_event_loop()
    rows = []
    for batch in batches:
        sched = Scheduler(
            SchedulerConfig(max_model_len=info.max_model_len, max_num_seqs=batch,
                            max_num_batched_tokens=max(8192, prompt_len),
                            async_scheduling=False),
            [WorkerSpec(0, info.num_blocks, info.block_size)],
        )  # fmt: skip
        gen = torch.Generator().manual_seed(batch)
        sampling = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(batch):
            prompt = torch.randint(3, info.vocab_size, (prompt_len,), generator=gen).tolist()
            sched.add_request(EngineRequest(f"b{batch}-{i}", prompt, sampling, info.eos_token_ids))
        count = {"steps": 0, "tokens": 0}

        def sink(outputs: list[SequenceOutput], count: dict[str, int] = count) -> None:
            count["tokens"] += sum(len(o.new_token_ids) for o in outputs)

        def stepped(*_: Any, count: dict[str, int] = count) -> None:
            count["steps"] += 1

        engine = EngineLoop(sched, {0: InlineWorker(runner.execute_model)}, sink, on_step=stepped)

        def run(until: Callable[[], bool] | None, engine: EngineLoop = engine) -> None:
            aio.run_until_complete(engine.run_until_idle(until))

        def run_steps(n: int, count: dict[str, int] = count) -> int:
            """``n`` more steps; returns the tokens they sampled."""
            stop, tokens = count["steps"] + n, count["tokens"]
            run(lambda: count["steps"] >= stop)
            return count["tokens"] - tokens

        def prefilled(sched: Scheduler = sched) -> bool:
            return all(s.num_computed_tokens >= prompt_len for s in sched.sequences.values())

        run(prefilled)  # prefill (chunked by the token budget)
        run_steps(2)  # warm-up decodes
        sync()
        start = time.perf_counter()
        tokens = run_steps(steps)
        sync()
        wall = time.perf_counter() - start
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof_steps = 3
        with profile(activities=activities) as prof:
            sync()
            p_start = time.perf_counter()
            run_steps(prof_steps)
            sync()
            p_wall = time.perf_counter() - p_start
        row = {
            "batch": batch,
            "tokens_per_s": round(tokens / wall, 1),
            "step_ms": round(1e3 * wall / steps, 3),
            "shares_of_profiled_step": step_shares(prof, p_wall, prof_steps, cuda),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        for rid in list(sched.requests):
            sched.abort_request(rid)
        run(None)  # one step: the worker forgets the aborted sequences
    aio.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--batches", default=None, help="comma list (default 1..256)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    smoke = args.cpu_smoke
    sys.meta_path.insert(0, ForbidImports())
    shim = package_shim()
    sys.path.insert(0, str(shim))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(shim), str(REPO / "tests"), env.get("PYTHONPATH", "")) if p
    )
    if smoke:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "mode": "cpu-smoke" if smoke else "gpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke to check this script on CPU", flush=True)
        return 2
    out_dir = RESULTS if args.out is None else Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.skip_tests:
        run_phase("kernel_tests", lambda: kernel_tests(env, smoke, 240 if smoke else 270),
                  report)  # fmt: skip
    run_phase("kernels", lambda: kernel_bench(env, out_dir, smoke, 150), report)
    batches = [int(b) for b in (args.batches or ("1,2,4" if smoke else
                                                  "1,8,32,64,128,256")).split(",")]  # fmt: skip
    prompt_len = args.prompt_len or (24 if smoke else 512)
    steps = args.steps or (3 if smoke else 16)
    run_phase("decode_loop", lambda: decode_loop(smoke, batches, prompt_len, steps), report)
    if not args.skip_tests:
        run_phase("tensor_parallel", lambda: tensor_parallel(env, smoke, 240), report)
    report["imported_forbidden"] = sorted(
        m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)
    )
    loop = report.get("decode_loop", {})
    if loop.get("ok") and not smoke:
        at64 = [r for r in loop["result"] if r["batch"] == 64]
        if at64:
            host = at64[0]["shares_of_profiled_step"]["host_overhead"]
            report["goal_host_overhead_at_64"] = {"value": host, "met": host <= 0.10}
    name = "gpu_check_cpu_smoke.json" if smoke else "gpu_check.json"
    out = Path(args.out) if args.out else out_dir / name
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}; forbidden modules imported: {report['imported_forbidden'] or 'none'}")
    failed = [k for k in ("kernel_tests", "kernels", "decode_loop", "tensor_parallel")
              if k in report and not report[k]["ok"]]  # fmt: skip
    return 1 if failed or report["imported_forbidden"] else 0


if __name__ == "__main__":
    sys.exit(main())
