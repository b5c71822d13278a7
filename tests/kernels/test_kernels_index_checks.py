"""Index values on the public kernel API: slots, block-table entries, seq_lens and
cu_seqlens_q that would take a kernel outside its buffers raise ValueError on every backend
(before a backend is chosen), and a step's CheckedIndices lets the per-layer calls skip the
repeat."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import _checks, cpu_native

BACKENDS = ["torch", "triton", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_native.available(), reason="CPU kernels not built"))]  # fmt: skip
NUM_BLOCKS, BLOCK_SIZE = 4, 16


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 16, generator=g)
    return kc, torch.randn(kc.shape, generator=g)


def _prefill_args(**changes: object) -> dict[str, object]:
    kc, vc = _caches()
    args: dict[str, object] = {
        "query": torch.randn(5, 4, 16),
        "key_cache": kc,
        "value_cache": vc,
        # Sequence 1 reads one block: its second entry is padding (out of range on purpose).
        "block_tables": torch.tensor([[0, 1], [2, 99], [3, 1]], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, 2, 3, 5], dtype=torch.int32),
        "seq_lens": torch.tensor([20, 1, 18], dtype=torch.int32),
        "scale": 0.25,
    }
    args.update(changes)
    return args


def _decode_args(**changes: object) -> dict[str, object]:
    args = _prefill_args(query=torch.randn(3, 4, 16))
    del args["cu_seqlens_q"]
    args.update(changes)
    return args


def _i32(values: list[object]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_valid_calls_with_padding_entries_pass(backend: str) -> None:
    if backend == "cpu" and not cpu_native.available():
        pytest.skip("CPU kernels not built")
    out = kernels.paged_prefill_attention(**_prefill_args(), backend=backend)
    assert out.shape == (5, 4, 16) and not out.isnan().any()
    out = kernels.paged_decode_attention(**_decode_args(), backend=backend)
    assert out.shape == (3, 4, 16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"cu_seqlens_q": _i32([1, 2, 3, 5])}, r"cu_seqlens_q\[0\] = 1"),
        ({"cu_seqlens_q": _i32([0, 3, 2, 5])}, r"cu_seqlens_q decreases: cu_seqlens_q\[2\] = 2"),
        ({"cu_seqlens_q": _i32([0, 2, 3, 9])}, r"cu_seqlens_q\[3\] = 9 != the 5 query rows"),
        ({"cu_seqlens_q": _i32([0, 2, 3, 4])}, r"cu_seqlens_q\[3\] = 4"),
        ({"cu_seqlens_q": torch.tensor([0, 2, 4, 5])}, r"chunk of 2 rows but seq_lens\[1\] = 1"),
        ({"block_tables": _i32([[0, 4], [2, 0], [3, 1]])}, r"block_tables\[0, 1\] = 4"),
        ({"block_tables": _i32([[0, 1], [-1, 0], [3, 1]])}, r"block_tables\[1, 0\] = -1"),
        ({"seq_lens": _i32([33, 1, 18])}, r"seq_lens\[0\] = 33 needs 3 blocks"),
    ],
)
def test_prefill_rejects_indices_outside_the_buffers(backend, changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        kernels.paged_prefill_attention(**_prefill_args(**changes), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"block_tables": _i32([[0, 1], [7, 0], [3, 1]])}, r"block_tables\[1, 0\] = 7"),
        ({"block_tables": torch.tensor([[0, 1], [2, 0], [3, -5]])}, r"block_tables\[2, 1\] = -5"),
        ({"seq_lens": _i32([20, -1, 18])}, r"seq_lens\[1\] = -1 is negative"),
        ({"seq_lens": _i32([20, 1, 40])}, r"seq_lens\[2\] = 40 needs 3 blocks"),
    ],
)
def test_decode_rejects_indices_outside_the_buffers(backend, changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        kernels.paged_decode_attention(**_decode_args(**changes), backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_rejects_slots_beyond_the_pool(backend: str) -> None:
    kc, vc = _caches()
    kv = torch.ones(3, 2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 64 is beyond the cache's 64 slots"):
        kernels.store_kv_cache(kv, kv, kc, vc, torch.tensor([0, 64, -1]), backend)
    kernels.store_kv_cache(kv, kv, kc, vc, torch.tensor([0, 63, -1]), "torch")  # -1: padding
    assert torch.equal(kc[3, 15], kv[1]) and torch.equal(kc[0, 0], kv[0])


def test_block_transfers_reject_ids_outside_the_pool() -> None:
    kcs = [torch.zeros(NUM_BLOCKS, 2, 1, 8) for _ in range(2)]
    vcs = [torch.zeros(NUM_BLOCKS, 2, 1, 8) for _ in range(2)]
    with pytest.raises(ValueError, match=r"block_ids\[1\] = 4 is outside"):
        kernels.gather_blocks(kcs, vcs, torch.tensor([0, 4]))
    packed = torch.zeros(2, 2, 2, 2, 1, 8)
    with pytest.raises(ValueError, match=r"block_ids\[0\] = -1 is outside"):
        kernels.scatter_blocks(kcs, vcs, torch.tensor([-1, 2]), packed)


def test_positions_beyond_the_rotary_table() -> None:
    kernels.check_positions(torch.tensor([0, 7]), 8, 2)
    with pytest.raises(ValueError, match=r"positions\[1\] = 8 is outside \[0, 8\)"):
        kernels.check_positions(torch.tensor([0, 8]), 8, 2)
    with pytest.raises(ValueError, match="positions has 2 entries for 3 tokens"):
        kernels.check_positions(torch.tensor([0, 1]), 8, 3)


def _step_indices(args: dict[str, object]) -> kernels.CheckedIndices:
    return kernels.check_indices(
        torch.arange(5), args["block_tables"], args["seq_lens"], args["cu_seqlens_q"],
        NUM_BLOCKS, BLOCK_SIZE, 5,
    )  # fmt: skip


def test_checked_indices_skip_the_repeat_for_the_same_tensors_only(monkeypatch) -> None:
    calls: list[str] = []
    for name in ("check_table_values", "check_query_starts", "check_slot_values"):
        original = getattr(_checks, name)

        def counted(*a, _name=name, _original=original, **k):
            calls.append(_name)
            return _original(*a, **k)

        monkeypatch.setattr(_checks, name, counted)
    args = _prefill_args()
    checked = _step_indices(args)
    assert calls == ["check_slot_values", "check_query_starts", "check_table_values"]
    calls.clear()
    ref = kernels.paged_prefill_attention(**args, backend="torch")
    assert calls == ["check_query_starts", "check_table_values"]
    calls.clear()
    out = kernels.paged_prefill_attention(**args, backend="torch", checked=checked)
    assert calls == [] and torch.equal(out, ref)
    # Other tensors (here with a bad entry), or a cache of another geometry: checked again.
    bad = _prefill_args(block_tables=torch.tensor([[0, 9], [2, 0], [3, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 9"):
        kernels.paged_prefill_attention(**bad, backend="torch", checked=checked)
    small = torch.zeros(2, BLOCK_SIZE, 2, 16)
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 2 is outside .*\[0, 2\)"):
        kernels.paged_decode_attention(
            **_decode_args(key_cache=small, value_cache=small, seq_lens=args["seq_lens"],
                           block_tables=args["block_tables"]),
            backend="torch", checked=checked,
        )  # fmt: skip


def test_step_check_names_the_argument() -> None:
    args = _prefill_args()
    with pytest.raises(ValueError, match="slot_mapping has 4 entries for 5 tokens"):
        kernels.check_indices(
            torch.arange(4), args["block_tables"], args["seq_lens"], args["cu_seqlens_q"],
            NUM_BLOCKS, BLOCK_SIZE, 5,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"slot_mapping\[4\] = 64"):
        kernels.check_indices(
            torch.tensor([0, 1, 2, 3, 64]), args["block_tables"], args["seq_lens"],
            args["cu_seqlens_q"], NUM_BLOCKS, BLOCK_SIZE, 5,
        )  # fmt: skip


def test_checks_survive_python_dash_o() -> None:
    code = (
        "import torch\n"
        "from pagedserve import kernels\n"
        "kc = torch.zeros(2, 4, 1, 16)\n"
        "try:\n"
        "    kernels.paged_prefill_attention(torch.ones(3, 2, 16), kc, kc.clone(),\n"
        "        torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32),\n"
        "        torch.tensor([3], dtype=torch.int32), 0.25)\n"
        "except ValueError as exc:\n"
        "    assert 'cu_seqlens_q[1] = 7' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no ValueError under -O')\n"
    )
    result = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr + result.stdout
