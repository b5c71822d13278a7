"""Greedy continuations of prompt ids through vLLM's offline ``LLM`` (run in vLLM's venv).

``bf16_agreement.py`` starts it as a subprocess with the interpreter of
``benchmarks/.venv-vllm`` and a working folder outside the repository (so none of the
repository's folders is on its ``sys.path``). It reads a JSON spec::

    {"model_dir": str, "dtype": "auto" | "bfloat16" | "float32", "max_tokens": int,
     "max_model_len": int, "enforce_eager": bool, "prompt_ids": [[int, ...], ...]}

and writes ``{"dtype": <the dtype vLLM ran in>, "tokens": [[int, ...], ...], "seconds": float}``
to the output path: ``temperature=0``, ``ignore_eos=True``, all prompts in one
``LLM.generate`` call (vLLM batches them as it schedules).

    benchmarks/.venv-vllm/bin/python benchmarks/quality/vllm_greedy.py SPEC.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enforce_eager=spec["enforce_eager"],
        seed=0,
    )
    ran_in = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompt_ids"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    out = {"dtype": ran_in, "tokens": tokens, "seconds": round(time.perf_counter() - t0, 1)}
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
