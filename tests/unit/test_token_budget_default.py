"""The step token budget's default: chosen by the workers' device (serving), set explicitly
everywhere else; a Scheduler refuses an unresolved one."""

from __future__ import annotations

import pytest

from pagedserve.cluster.cli import build_parser, serve_config
from pagedserve.scheduler.config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    SchedulerConfig,
    default_max_num_batched_tokens,
)
from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec


def test_default_by_device_kind() -> None:
    assert CPU_MAX_NUM_BATCHED_TOKENS == 1024 and MAX_NUM_BATCHED_TOKENS == 2048
    assert default_max_num_batched_tokens("cpu") == 1024
    assert default_max_num_batched_tokens("cuda:0") == 2048
    assert default_max_num_batched_tokens("cuda") == 2048


def test_serve_leaves_it_to_the_device_unless_told() -> None:
    args = build_parser().parse_args(["serve"])
    assert serve_config(args).scheduler.max_num_batched_tokens is None
    told = build_parser().parse_args(["serve", "--max-num-batched-tokens", "512"])
    assert serve_config(told).scheduler.max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_a_scheduler_needs_a_resolved_budget() -> None:
    spec = WorkerSpec(0, 8, 16, "float32", "float32")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be set"):
        Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=None), [spec])
    assert (
        Scheduler(SchedulerConfig(max_model_len=64), [spec]).config.max_num_batched_tokens == 2048
    )


def test_the_launcher_fills_in_the_workers_device_budget() -> None:
    from pagedserve.cluster.launcher import resolved_scheduler_config

    auto = SchedulerConfig(max_num_batched_tokens=None)
    cpu = resolved_scheduler_config(auto, 2048, ["cpu", "cpu"])
    assert cpu.max_num_batched_tokens == 1024 and cpu.max_model_len == 2048
    assert resolved_scheduler_config(auto, 512, ["cuda:0"]).max_num_batched_tokens == 2048
    told = SchedulerConfig(max_num_batched_tokens=300, max_num_seqs=7)
    kept = resolved_scheduler_config(told, 512, ["cpu"])
    assert kept.max_num_batched_tokens == 300 and kept.max_num_seqs == 7
