"""Greedy agreement with HF transformers (bf16 and fp32) of pagedserve and vLLM's CPU build.

SmolLM2-135M-Instruct (the tests' default model, an fp32 checkpoint) on :data:`SHORT_CHATS`
and :data:`LONG_CHATS` through its chat template and :data:`SHORT_TEXTS` and
:data:`LONG_TEXTS` as plain text (the long ones ~200 tokens). The prompt ids are computed
once with the HF tokenizer and fed as ids to every system; greedy (temperature 0), EOS
ignored, ``--max-tokens`` new tokens each.

Systems: HF transformers in bf16 and fp32 (eager attention, batch 1, ``generate``; the two
references, with their logits at every step), pagedserve's offline ``LLM`` API with
``dtype="auto"`` (bf16 on a CPU with native bf16) and ``"float32"``, and vLLM's CPU build
(``benchmarks/.venv-vllm``, :mod:`vllm_greedy` as a subprocess) with ``dtype="auto"`` and
``"float32"``. Each system's continuations are compared with each reference's: sequences
fully equal, mean tokens until the first difference, and at each first difference the
reference's top-1/top-2 logit margin in bf16 ulps of its top logit (:func:`margin_ulps`),
so that flips at near-ties are told from real disagreements. Prints a Markdown table
and writes JSON.

    .venv/bin/python benchmarks/quality/bf16_agreement.py
    .venv/bin/python benchmarks/quality/bf16_agreement.py --systems pagedserve-auto,\
pagedserve-float32 --previous benchmarks/results/bf16_agreement.json   # rerun ours only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks" / "common"))  # vllm_venv

SHORT_CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences what a hash table is.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "How do vaccines work?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?",
]
SHORT_TEXTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The capital of France is",
    "List three prime numbers greater than 100:",
    "Translate to German: The cat sleeps on the mat.",
    "import numpy as np\n\n# Compute the mean of each row\n",
    "The three laws of thermodynamics are",
]
_PASSAGE_A = (
    "The printing press, developed by Johannes Gutenberg around 1440, changed how knowledge "
    "moved through Europe. Before it, books were copied by hand, usually by monks working in "
    "monasteries, and a single volume could take months to finish. Books were rare and "
    "expensive, and few people outside the clergy and the nobility could read. Gutenberg "
    "combined several existing technologies: movable metal type, oil-based ink, and a screw "
    "press adapted from those used to make wine and olive oil. His workshop in Mainz produced "
    "the famous Gutenberg Bible, of which about forty-nine copies survive today. Within fifty "
    "years, printing presses were operating in more than two hundred cities, and millions of "
    "books had been printed. Prices fell, literacy rose, and ideas spread faster than any "
    "authority could control. Historians link the press to the Reformation, the Scientific "
    "Revolution, and the rise of newspapers."
)
_PASSAGE_B = (
    "Photosynthesis is the process by which green plants, algae, and some bacteria turn light "
    "into chemical energy. It takes place mainly in the leaves, inside small structures called "
    "chloroplasts, which contain the green pigment chlorophyll. In the light-dependent "
    "reactions, chlorophyll absorbs sunlight and uses its energy to split water molecules, "
    "releasing oxygen as a by-product and producing two energy carriers, ATP and NADPH. In the "
    "second stage, known as the Calvin cycle, the plant uses that ATP and NADPH to fix carbon "
    "dioxide from the air into sugars such as glucose. These sugars feed the plant's growth "
    "and are stored as starch for later use. Nearly all life on Earth depends on "
    "photosynthesis, directly or indirectly: it supplies the oxygen we breathe and the food "
    "at the base of almost every food chain, and over millions of years it built the fossil "
    "fuels we burn today."
)
LONG_CHATS = [
    f"Read this passage and answer: what changed after the printing press?\n\n{_PASSAGE_A}",
    f"Explain the following text to a ten-year-old.\n\n{_PASSAGE_B}",
]
LONG_TEXTS = [
    f"{_PASSAGE_B}\n\nIn summary, the two stages of photosynthesis are",
    f"{_PASSAGE_A}\n\nThe most important consequence of the printing press was",
]
REFERENCES = ("hf-bfloat16", "hf-float32")
SYSTEMS = (*REFERENCES, "pagedserve-auto", "pagedserve-float32", "vllm-auto", "vllm-float32")


# ------------------------------------------------------------------ pure helpers
def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at magnitude ``x`` (8 significant bits); that of the
    smallest normal bf16 for ``x == 0``."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-126))) - 7)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ, ``None`` when they are equal; where one
    is a prefix of the other, the shorter one's length."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def margin_ulps(logits: list[float] | Any, token: int | None = None) -> float:
    """The top-1 minus top-2 logit of one step's ``logits`` ([vocab], any float), in bf16
    ulps of the top-1 logit; with ``token``: top-1 minus that token's logit instead (0 when
    ``token`` is the top one)."""
    values = [float(v) for v in (logits.tolist() if hasattr(logits, "tolist") else logits)]
    order = sorted(range(len(values)), key=values.__getitem__, reverse=True)
    top = values[order[0]]
    other = values[token] if token is not None else values[order[1]]
    return (top - other) / bf16_ulp(top)


@dataclass(frozen=True)
class Difference:
    """One system's continuation of one prompt against a reference's.

    Attributes:
        agreed: tokens equal before the first difference (all of them when equal).
        first_diff: index of the first differing token, ``None`` when equal.
        margin_ulps: the reference's top-1/top-2 margin at ``first_diff`` (bf16 ulps of its
            top logit; ``None`` when equal).
        chosen_gap_ulps: the reference's top-1 logit minus its logit of the token the system
            chose there, same unit (``None`` when equal).
    """

    agreed: int
    first_diff: int | None
    margin_ulps: float | None
    chosen_gap_ulps: float | None


def compare(tokens: list[int], ref_tokens: list[int], ref_logits: list[Any]) -> Difference:
    """``tokens`` against ``ref_tokens``; ``ref_logits[i]`` ([vocab]) are the reference's
    logits for its token ``i`` (same context as the system's up to the first difference)."""
    d = first_difference(tokens, ref_tokens)
    if d is None:
        return Difference(len(ref_tokens), None, None, None)
    if d >= min(len(tokens), len(ref_tokens)):  # one stopped early: no token to judge
        return Difference(d, d, None, None)
    row = ref_logits[d]
    return Difference(d, d, margin_ulps(row), margin_ulps(row, tokens[d]))


def summarize(diffs: list[Difference], max_tokens: int) -> dict[str, Any]:
    """Per system and reference: ``equal`` (sequences fully equal), ``mean_agreed``
    (mean tokens until the first difference), ``agreement`` (their share of all tokens),
    the margins at the first differences and how many exceed 2 ulps (not near-ties)."""
    margins = [d.margin_ulps for d in diffs if d.margin_ulps is not None]
    return {
        "equal": sum(d.first_diff is None for d in diffs),
        "prompts": len(diffs),
        "mean_agreed": round(sum(d.agreed for d in diffs) / len(diffs), 2),
        "agreement": round(sum(d.agreed for d in diffs) / (len(diffs) * max_tokens), 3),
        "first_diffs": [d.first_diff for d in diffs],
        "margins_ulps": [None if d.margin_ulps is None else round(d.margin_ulps, 2) for d in diffs],
        "chosen_gap_ulps": [
            None if d.chosen_gap_ulps is None else round(d.chosen_gap_ulps, 2) for d in diffs
        ],
        "median_margin_ulps": None if not margins else round(sorted(margins)[len(margins) // 2], 2),
        "first_diffs_over_2_ulps": sum(m > 2 for m in margins),
    }


# ------------------------------------------------------------------ systems
def prompt_ids(model_dir: str) -> tuple[list[str], list[list[int]]]:
    """Labels (``chat``/``text`` + index) and ids of every prompt, HF tokenizer, once."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    labels, ids = [], []
    for i, c in enumerate((*SHORT_CHATS, *LONG_CHATS)):
        chat = [{"role": "user", "content": c}]
        labels.append(f"chat{i}")
        ids.append(
            list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                         return_dict=False))
        )  # fmt: skip
    for i, t in enumerate((*SHORT_TEXTS, *LONG_TEXTS)):
        labels.append(f"text{i}")
        ids.append(list(tok(t).input_ids))
    return labels, ids


def run_hf(model_dir: str, dtype: str, prompts: list[list[int]], n: int) -> tuple[Any, Any]:
    """HF ``generate`` greedy, batch 1, eager attention, EOS ignored: the tokens and the
    fp32 copy of its logits ([vocab] per step) of every prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
    ).eval()
    tokens, logits = [], []
    threads = torch.get_num_threads()
    # Batch 1 is latency-bound: one thread; on a loaded machine two spin-waiting OpenMP
    # threads ran a step 7x slower (2.6 s against 0.36 s, 2 cores, load average ~15).
    torch.set_num_threads(1)
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=0,
                do_sample=False, eos_token_id=None, pad_token_id=0,
                return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
            tokens.append(out.sequences[0, len(p) :].tolist())
            logits.append([x[0].float() for x in out.logits])
    torch.set_num_threads(threads)
    return tokens, logits


def references(
    model_dir: str, ref: str, prompts: list[list[int]], n: int, cache: str | None
) -> tuple[dict[str, Any], list[Any]]:
    """:func:`run_hf` for reference ``ref`` (``hf-<dtype>``): its run record and logits,
    loaded from ``<cache>.<ref>.pt`` when that holds the same prompts and ``n`` (else
    computed and saved there; no cache when ``cache`` is None)."""
    import torch

    path = Path(f"{cache}.{ref}.pt") if cache else None
    if path is not None and path.exists():
        saved = torch.load(path)
        if saved["prompts"] == prompts and saved["n"] == n:
            return saved["run"], saved["logits"]
    t0 = time.perf_counter()
    tokens, logits = run_hf(model_dir, ref.removeprefix("hf-"), prompts, n)
    run = {"tokens": tokens, "info": {"dtype": ref.removeprefix("hf-"),
                                      "seconds": round(time.perf_counter() - t0, 1)}}  # fmt: skip
    if path is not None:
        part = path.with_suffix(".part")
        torch.save({"prompts": prompts, "n": n, "run": run, "logits": logits}, part)
        part.replace(path)  # whole or absent, for a concurrent run
    return run, logits


def run_pagedserve(
    dtype: str, prompts: list[list[int]], n: int, kv_cache_memory: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """pagedserve's offline ``LLM`` API (CPU, in process): tokens and what it ran in."""
    from pagedserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM("default", dtype=dtype, kv_cache_memory=kv_cache_memory, device="cpu") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        info = {"dtype": llm.info.dtype, "kv_cache_dtype": llm.info.kv_cache_dtype}
    return [list(o.outputs[0].token_ids) for o in outs], info


def run_vllm(
    python: str, model_dir: str, dtype: str, prompts: list[list[int]], n: int, eager: bool
) -> tuple[list[list[int]], dict[str, Any]]:
    """vLLM's offline ``LLM`` through :mod:`vllm_greedy` in its venv, from a temporary
    working folder (not the repository root). Raises ``RuntimeError`` with its log's tail
    when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({
            "model_dir": model_dir, "dtype": dtype, "max_tokens": n, "max_model_len": 1024,
            "enforce_eager": eager, "prompt_ids": prompts,
        }))  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        proc = subprocess.run(
            [python, str(HERE / "vllm_greedy.py"), str(spec), str(out)],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM {dtype} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        res = json.loads(out.read_text())
    return res["tokens"], {"dtype": res["dtype"], "enforce_eager": eager,
                           "seconds": res["seconds"]}  # fmt: skip


# ------------------------------------------------------------------ report
def table(runs: dict[str, Any], summary: dict[str, Any], n: int) -> list[str]:
    """Markdown rows: one per system, both references side by side."""
    head = (
        "| system | ran in | = HF bf16 | mean tokens to 1st diff (bf16) | median margin, ulps "
        "(bf16) | diffs > 2 ulps (bf16) | = HF fp32 | mean tokens to 1st diff (fp32) | "
        "median margin, ulps (fp32) |"
    )
    lines = [head, "|" + "---|" * 9]
    for name, run in runs.items():
        cells = [name, run["info"].get("dtype", "")]
        for ref in REFERENCES:
            s = summary[name].get(ref)
            if s is None:
                cells += ["(reference)", "", ""] + ([""] if ref == REFERENCES[0] else [])
                continue
            cells += [f"{s['equal']}/{s['prompts']}", f"{s['mean_agreed']} / {n}",
                      str(s["median_margin_ulps"])]  # fmt: skip
            if ref == REFERENCES[0]:
                cells.append(str(s["first_diffs_over_2_ulps"]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--systems", default=",".join(SYSTEMS[2:]),
                    help="pagedserve-/vllm- auto|float32, comma-separated")  # fmt: skip
    ap.add_argument("--previous", nargs="*", default=[],
                    help="JSON of earlier runs: systems not run now come from them")  # fmt: skip
    ap.add_argument("--vllm-python", help="vLLM's interpreter (default: benchmarks/.venv-vllm)")
    ap.add_argument("--vllm-eager", action="store_true",
                    help="vLLM with enforce_eager (default: compiled, as vLLM runs by default)")  # fmt: skip
    ap.add_argument("--systems-only", action="store_true",
                    help="write the systems' tokens without comparing (for --previous)")  # fmt: skip
    ap.add_argument("--hf-cache", help="path prefix: keep HF's references (and logits) there")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--out", default=str(RESULTS / "bf16_agreement.json"))
    args = ap.parse_args()
    wanted = [s for s in args.systems.split(",") if s]
    if bad := [s for s in wanted if s not in SYSTEMS[2:]]:
        raise ValueError(f"unknown systems {bad}; choose from {SYSTEMS[2:]}")
    n = args.max_tokens
    from pagedserve.worker.model_store import resolve_model

    model_dir = str(resolve_model("default", progress=False))
    labels, prompts = prompt_ids(model_dir)
    runs: dict[str, Any] = {}
    logits: dict[str, Any] = {}
    for previous in args.previous:
        prev = json.loads(Path(previous).read_text())
        if prev["prompt_ids"] != prompts or prev["max_tokens"] != n:
            raise ValueError(f"{previous} ran other prompts or --max-tokens")
        for name, run in prev["runs"].items():
            if name not in REFERENCES and name not in wanted:
                runs[name] = {**run, "from": run.get("from", prev["commit"])}
    vllm_py = None
    for name in wanted:
        t0 = time.perf_counter()
        system, dtype = name.split("-", 1)
        if system == "pagedserve":
            tokens, info = run_pagedserve(dtype, prompts, n, args.kv_cache_memory)
        else:
            if vllm_py is None:
                from vllm_venv import ensure_vllm_venv

                vllm_py = args.vllm_python or str(ensure_vllm_venv())
            tokens, info = run_vllm(vllm_py, model_dir, dtype, prompts, n, args.vllm_eager)
        info["seconds"] = round(time.perf_counter() - t0, 1)
        runs[name] = {"tokens": tokens, "info": info}
        print(f"{name}: ran in {info['dtype']}, {info['seconds']} s", flush=True)
    for ref in () if args.systems_only else REFERENCES:
        runs[ref], logits[ref] = references(model_dir, ref, prompts, n, args.hf_cache)
        print(f"{ref}: {runs[ref]['info']['seconds']} s", flush=True)
    order = [s for s in SYSTEMS if s in runs]
    runs = {s: runs[s] for s in order}
    summary: dict[str, Any] = {}
    for name, run in runs.items():
        summary[name] = {}
        for ref in REFERENCES:
            if ref != name and ref in runs:
                pairs = zip(run["tokens"], runs[ref]["tokens"], logits[ref])
                summary[name][ref] = summarize([compare(t, r, lg) for t, r, lg in pairs], n)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    lines = [] if args.systems_only else table(runs, summary, n)
    print("\n".join(lines))
    payload = {
        "date": time.strftime("%Y-%m-%d"), "commit": commit,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "model_dir": model_dir,
        "max_tokens": n, "labels": labels, "prompt_ids": prompts,
        "prompt_lengths": [len(p) for p in prompts], "runs": runs, "summary": summary,
        "table": lines,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
