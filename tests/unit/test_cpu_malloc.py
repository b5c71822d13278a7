"""glibc malloc settings of a CPU worker (``worker/cpu_malloc.py``): a freed large
activation is reused by the next step instead of being unmapped and faulted in again."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from pagedserve.worker import cpu_malloc

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# A 64 MiB tensor allocated, touched and freed, then the same again: the page faults of the
# second one (minor faults, from getrusage). The settings are process-wide, so each case
# runs in a child process.
PROBE = """
import resource, sys
import torch
from pagedserve.worker.cpu_malloc import keep_freed_memory
applied = keep_freed_memory()
x = torch.ones(64 << 18)
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = torch.ones(64 << 18)
print(int(applied), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(keep: str) -> tuple[bool, int]:
    env = dict(os.environ, PAGEDSERVE_MALLOC_KEEP=keep)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    applied, faults = out.stdout.split()
    return applied == "1", int(faults)


def test_a_freed_activation_is_reused_without_page_faults():
    applied, faults = _probe("1")
    assert applied
    assert faults < 100, faults  # none expected; a few for allocator bookkeeping at most


def test_disabled_leaves_glibc_unmapping_large_blocks():
    applied, faults = _probe("0")
    assert not applied
    assert faults >= (64 << 20) // 4096 // 2, faults  # every 4 KiB page (or most) again


@pytest.mark.parametrize("value", ["0", "false", "Off", " no ", ""])
def test_falsy_values_disable(monkeypatch, value):
    monkeypatch.setenv("PAGEDSERVE_MALLOC_KEEP", value)
    assert not cpu_malloc.enabled()
    assert not cpu_malloc.keep_freed_memory()


def test_on_by_default(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_MALLOC_KEEP", raising=False)
    assert cpu_malloc.enabled()
