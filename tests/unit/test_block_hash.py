"""Chained block hashes: stability, chaining, extra keys, collision resistance."""

from __future__ import annotations

import struct

import pytest

from pagedserve.scheduler.block_hash import (
    extra_keys_for_block,
    hash_block_tokens,
    hash_full_blocks,
)


def weak_poly_hash(tokens: list[int]) -> int:
    """The kind of hash not to use: base-31 polynomial, sum(t_j * 31**j)."""
    return sum(t * 31**j for j, t in enumerate(tokens))


def test_digest_is_stable_across_processes():
    # Fixed vectors: the encoding must never depend on the process (unlike hash()).
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0.hex() == "0b10f88842d1a4dd6271aaa49ff3b3f0ff0337c01e93047ea08d8f4f39b58b62"
    h1 = hash_block_tokens(h0, [5, 6, 7, 8], ("salt",))
    assert h1.hex() == "7e943da6aced505e6a8d5ff2006fb51f206f8db91cd46f72cffd970ed5c332cf"
    assert len(h0) == 32


def test_sequence_and_tuple_hash_alike():
    assert hash_block_tokens(None, [1, 2, 3]) == hash_block_tokens(None, (1, 2, 3))


def test_parent_changes_hash():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(a, [9, 9]) != hash_block_tokens(b, [9, 9])
    assert hash_block_tokens(None, [9, 9]) != hash_block_tokens(a, [9, 9])


def test_extra_keys_change_hash():
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("a",)) != base
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], ("b",))
    # length-prefixed: ("ab",) and ("a", "b") differ
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))


def test_token_boundaries_are_unambiguous():
    # int64 per token and a length prefix: no two token lists share an encoding
    assert hash_block_tokens(None, [1, 0]) != hash_block_tokens(None, [1])
    assert hash_block_tokens(None, [256]) != hash_block_tokens(None, [1, 0])


def test_weak_polynomial_collision_does_not_collide_here():
    a = [5, 100, 7, 8]
    b = list(a)
    b[1] += 31  # token[j] + 31 ...
    b[2] -= 1  # ... and token[j+1] - 1: same sum(t_j * 31**j)
    assert a != b
    assert weak_poly_hash(a) == weak_poly_hash(b)
    assert hash_block_tokens(None, a) != hash_block_tokens(None, b)


def test_extra_keys_only_on_first_block():
    assert extra_keys_for_block(0, "s") == ("s",)
    assert extra_keys_for_block(1, "s") == ()
    assert extra_keys_for_block(0, None) == ()


def test_hash_full_blocks_matches_manual_chain():
    tokens = list(range(10))
    hs = hash_full_blocks(tokens, 4, 2, cache_salt="x")
    h0 = hash_block_tokens(None, [0, 1, 2, 3], ("x",))
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert hs == [h0, h1]
    assert hash_full_blocks(tokens, 4, 2, "x", start_block=1, parent_hash=h0) == [h1]
    assert hash_full_blocks(tokens, 4, 0) == []


def test_out_of_range_token_raises():
    with pytest.raises(struct.error):
        hash_block_tokens(None, [2**63])


def test_kv_cache_dtype_enters_the_first_block_ahead_of_the_salt():
    assert extra_keys_for_block(0, None, "bfloat16") == ("kv_dtype=bfloat16",)
    assert extra_keys_for_block(0, "s", "float32") == ("kv_dtype=float32", "s")
    assert extra_keys_for_block(0, "s") == ("s",)
    assert extra_keys_for_block(1, "s", "float32") == ()
    tokens = list(range(12))
    fp32 = hash_full_blocks(tokens, 4, 3, kv_cache_dtype="float32")
    bf16 = hash_full_blocks(tokens, 4, 3, kv_cache_dtype="bfloat16")
    plain = hash_full_blocks(tokens, 4, 3)
    # The chain carries block 0's key: no block of one dtype hashes like the other's.
    assert not set(fp32) & set(bf16) and not set(fp32) & set(plain)
    assert fp32[0] == hash_block_tokens(None, tokens[:4], ("kv_dtype=float32",))
    fp8 = hash_full_blocks(tokens, 4, 3, kv_cache_dtype="float8_e4m3fn")
    assert not set(fp8) & (set(fp32) | set(bf16) | set(plain))
    i8 = hash_full_blocks(tokens, 4, 3, kv_cache_dtype="int8")
    assert not set(i8) & (set(fp8) | set(fp32) | set(bf16) | set(plain))
    assert i8[0] == hash_block_tokens(None, tokens[:4], ("kv_dtype=int8",))
