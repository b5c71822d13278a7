"""A draft model cut from the target: its first ``N`` decoder layers, its final norm and
LM head (an untrained early exit, the draft of self-speculative decoding: Zhang et al.,
2023, "Draft & Verify", with a contiguous prefix of layers in place of searched ones).

SmolLM2-135M is the smallest model of its tokenizer in this repository's cache, so the
speculative benchmarks draft with a cut of it. Usage::

    .venv/bin/python benchmarks/common/layer_draft.py --layers 4 --out /tmp/smollm2-4l
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from pagedserve.worker.model_store import resolve_model

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def make_layer_draft(src: Path, dst: Path, num_layers: int) -> Path:
    """Write the draft folder ``dst`` (config, weights, tokenizer files) and return it.

    Raises:
        ValueError: ``num_layers`` outside ``[1, the target's layers]``.
    """
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}]")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name != "config.json"
            and f.name[0] != "."
        ):
            shutil.copy(f, dst / f.name)
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    weights: dict = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < num_layers:
                weights[name] = t.contiguous()
    save_file(weights, dst / "model.safetensors")
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(make_layer_draft(resolve_model(args.model), args.out, args.layers))


if __name__ == "__main__":
    main()
