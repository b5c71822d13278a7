"""Run import-linter (``lint-imports``) over the whole ``pagedserve`` package.

The repository maps ``pagedserve.<sub>`` onto top-level folders (``[tool.setuptools.
package-dir]`` in pyproject.toml) while ``pagedserve`` itself is the regular package in
``pagedserve/``; grimp walks one package's directory, so it is given a directory laid out
as installed: a temporary ``pagedserve/`` whose entries link to the repository's files
and folders (grimp follows links), first on ``PYTHONPATH``.

Usage (``make lint`` runs it)::

    .venv/bin/python tools/lint_imports.py
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def package_farm() -> Iterator[Path]:
    """A temporary directory holding ``pagedserve/`` laid out as installed: its entries
    link to the repository's files and folders (``package-dir`` in pyproject.toml)."""
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="pagedserve-lint-") as tmp:
        pkg = Path(tmp) / "pagedserve"
        pkg.mkdir()
        for f in (REPO / dirs["pagedserve"]).glob("*.py"):
            (pkg / f.name).symlink_to(f)
        for name, folder in dirs.items():
            if name.startswith("pagedserve."):
                (pkg / name.split(".", 1)[1]).symlink_to(REPO / folder, target_is_directory=True)
        yield Path(tmp)


def main() -> int:
    config = REPO / "pyproject.toml"
    lint = Path(sys.executable).with_name("lint-imports")
    with package_farm() as farm:
        env = dict(os.environ, PYTHONPATH=str(farm))
        return subprocess.call([str(lint), str(config), *sys.argv[1:]], cwd=farm, env=env)


if __name__ == "__main__":
    sys.exit(main())
