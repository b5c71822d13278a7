"""ShardPlan: which heads, KV heads, MLP columns and vocabulary rows each rank holds."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.worker.arch import ModelArch
from pagedserve.worker.config import ParallelConfig
from pagedserve.worker.sharding import ShardPlan

ARCH = ModelArch(
    architecture="LlamaForCausalLM",
    vocab_size=125,
    hidden_size=96,
    intermediate_size=192,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=12,
    rms_norm_eps=1e-5,
    rope_parameters=(("rope_theta", 10000.0), ("rope_type", "default")),
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def test_heads_kv_heads_and_mlp_split_by_rank() -> None:
    plans = [ShardPlan(ARCH, r, 2) for r in range(2)]
    assert [p.heads for p in plans] == [range(0, 4), range(4, 8)]
    assert [p.kv_heads for p in plans] == [range(0, 1), range(1, 2)]
    assert plans[1].rows("self_attn", "q") == (0, slice(48, 96))
    assert plans[1].rows("self_attn", "k") == (0, slice(12, 24))
    assert plans[1].rows("self_attn", "o") == (1, slice(48, 96))
    assert plans[1].rows("mlp", "up") == (0, slice(96, 192))
    assert plans[1].rows("mlp", "down") == (1, slice(96, 192))
    local = plans[0].local_arch
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 1, 96)


def test_kv_heads_replicated_when_t_exceeds_them() -> None:
    plans = [ShardPlan(ARCH, r, 4) for r in range(4)]
    # Query heads 2r, 2r+1 of rank r use KV head (2r) // 4 = r // 2.
    assert [p.kv_heads for p in plans] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    for p in plans:
        assert all(h // 4 == p.kv_heads.start for h in p.heads)


def test_vocabulary_rows_padded_on_the_last_rank() -> None:
    plans = [ShardPlan(ARCH, r, 2) for r in range(2)]
    assert [p.vocab_rows for p in plans] == [63, 63]
    assert [p.vocab_range for p in plans] == [range(0, 63), range(63, 125)]


def test_sizes_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="must divide the model's 8 attention heads"):
        ShardPlan(ARCH, 0, 3)
    with pytest.raises(ValueError, match="KV heads"):
        ShardPlan(dataclasses.replace(ARCH, num_heads=12, num_kv_heads=3), 0, 2)
    with pytest.raises(ValueError, match="MLP width"):
        ShardPlan(dataclasses.replace(ARCH, intermediate_size=190), 0, 4)


def test_parallel_config_is_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match="rank must be in"):
        ParallelConfig(2, 2, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="init_method is required"):
        ParallelConfig(2, 1)


def test_cluster_config_refuses_what_does_not_shard() -> None:
    from pagedserve.cluster.config import ClusterConfig, SchedulerConfig
    from pagedserve.scheduler.config import SpeculativeConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ClusterConfig(tensor_parallel_size=0)
    assert ClusterConfig(tensor_parallel_size=2, swap_space=1 << 20).swap_space == 1 << 20
    spec = SchedulerConfig(speculative_config=SpeculativeConfig())
    with pytest.raises(ValueError, match="speculative decoding needs tensor_parallel_size 1"):
        ClusterConfig(tensor_parallel_size=2, scheduler=spec)
    assert ClusterConfig(tensor_parallel_size=2).tensor_parallel_size == 2
