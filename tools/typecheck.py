"""Run mypy over the whole ``pagedserve`` package, laid out as installed.

``pagedserve.<sub>`` maps onto top-level folders (``[tool.setuptools.package-dir]`` in
pyproject.toml) and the editable install resolves them with an import hook mypy cannot
follow: run on the folders, mypy would see every ``pagedserve.*`` import as ``Any`` and
check no call across modules. This runs it on the link farm of
:func:`lint_imports.package_farm` instead, so every cross-module call is checked.

Usage (``make lint`` runs it)::

    .venv/bin/python tools/typecheck.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lint_imports import REPO, package_farm


def main() -> int:
    mypy = Path(sys.executable).with_name("mypy")
    with package_farm() as farm:
        cmd = [str(mypy), "--config-file", str(REPO / "pyproject.toml"), "-p", "pagedserve"]
        cmd += ["--cache-dir", str(REPO / ".mypy_cache")]
        return subprocess.call(
            [*cmd, *sys.argv[1:]], cwd=farm, env=dict(os.environ, MYPYPATH=str(farm))
        )


if __name__ == "__main__":
    sys.exit(main())
