"""``--omp-spin-count``: GOMP_SPINCOUNT of CPU workers' processes, through Ray's
runtime_env (the process environment itself is checked in
tests/cluster/test_grpc_e2e.py::test_cpu_worker_process_has_the_omp_spin_count)."""

from __future__ import annotations

import pytest

from pagedserve.cluster.cli import build_parser, serve_config
from pagedserve.cluster.config import DEFAULT_OMP_SPIN_COUNT, ClusterConfig


def test_cpu_workers_get_the_spin_count_and_gpu_workers_nothing():
    assert DEFAULT_OMP_SPIN_COUNT == 1000
    assert ClusterConfig().worker_env("cpu") == {"GOMP_SPINCOUNT": "1000"}
    assert ClusterConfig(omp_spin_count=0).worker_env("cpu") == {"GOMP_SPINCOUNT": "0"}
    assert ClusterConfig().worker_env("cuda") == {}
    assert ClusterConfig(omp_spin_count=None).worker_env("cpu") == {}
    with pytest.raises(ValueError, match="omp_spin_count"):
        ClusterConfig(omp_spin_count=-5)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], 1000), (["--omp-spin-count", "50000"], 50000), (["--omp-spin-count", "-1"], None)],
)
def test_the_flag_reaches_the_config(flags, expected):
    args = build_parser().parse_args(["serve", "--model", "default", *flags])
    assert serve_config(args).omp_spin_count == expected
