"""The draft model of speculative decoding: a small model that proposes on the worker.

With ``SpeculativeConfig(method="draft")`` the scheduler plans a decode of ``1 + k`` tokens
(``CachedSequenceData.num_draft_tokens`` = k) and reserves their slots; the worker's
:class:`DraftModel` then proposes the ``k`` tokens by greedy decoding in its own model and
KV pool, and the target verifies them in the same step exactly as it verifies n-gram
proposals (:mod:`pagedserve.worker.spec_decode`). A proposal only decides what the target
checks: the output is the target's, token for token, whatever the draft says.

Paged KV. The draft's pool has the target's ``num_blocks`` and ``block_size`` and is
indexed by the target's block tables, so the scheduler's one
:class:`~pagedserve.scheduler.kv_cache_manager.KVCacheManager` (allocation, copy-on-write,
rollback, freeing) serves both pools: a block id names the same tokens in each. The worker
applies ``blocks_to_copy`` to both. Swap moves the target's blocks only: a sequence that
arrives in ``new_seqs`` (admission, recompute, swap-in, fork, migration) starts with no
draft KV, and the draft recomputes its tokens the first time it proposes for it (prefix
cache hits included: the draft's cost of a prompt is not cut by the cache).

Per sequence the draft remembers how many of its tokens have draft KV (``computed``). A
step that drafts runs (vLLM's ``EagleProposer.propose`` runs the same loop on the GPU):

1. one batched draft forward over every scheduled sequence: its tokens from
   ``computed`` up to where the target's chunk ends this step (a prefill chunk: the draft
   prefills alongside the target), or up to its last known token for a sequence that
   drafts, whose last row's argmax is its first proposal;
2. ``k - 1`` batched single-token decodes of the sequences that draft, each feeding the
   previous proposal.

The proposals are appended to the sequence's tokens as ``num_spec_tokens`` (what
``spec_token_ids`` do). After verification ``computed`` drops to the target's computed
length: the draft's KV of rejected proposals is stale (the draft of a fully accepted run
lacks the last proposal's KV, computed at the next drafting step). A step that drafts
nothing (speculation off for a large batch) runs no draft at all; the sequences catch up
at their next drafting step.

NOTE: blocks shared through the prefix cache hold both pools' KV; the draft of a sequence
that shares a block recomputes the draft KV of its tokens, writing values equal up to
float rounding into it. Only proposals can change from it, never the output.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from pagedserve import kernels
from pagedserve.kernels import cpu_native
from pagedserve.worker.arch import ModelArch
from pagedserve.worker.config import CacheConfig, ModelConfig
from pagedserve.worker.cpu_forward import cpu_kernels_apply
from pagedserve.worker.forward import select_forward
from pagedserve.worker.input_batch import SequenceState, prepare_inputs
from pagedserve.worker.kv_pool import KVPool, bytes_per_block
from pagedserve.worker.model import LlamaForCausalLM
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.weights import load_model


def check_same_vocabulary(
    target_dir: Path, target: ModelArch, draft_dir: Path, draft: ModelArch
) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's.

    The LM heads must have the same number of rows, and where both folders hold a
    ``tokenizer.json``, the same vocabulary and added tokens (id for id).

    Raises:
        ValueError: the vocabularies differ (the message names both models).
    """
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft_dir} has a vocabulary of {draft.vocab_size} tokens, the "
            f"target {target_dir} {target.vocab_size}: speculative decoding needs a draft "
            "with the target's tokenizer"
        )
    vocabs = [_tokenizer_vocab(d) for d in (target_dir, draft_dir)]
    if None not in vocabs and vocabs[0] != vocabs[1]:
        raise ValueError(
            f"draft model {draft_dir} has another tokenizer than the target {target_dir} "
            "(tokenizer.json vocabularies differ): speculative decoding needs a draft with "
            "the target's tokenizer"
        )


def _tokenizer_vocab(model_dir: Path) -> tuple[object, object] | None:
    """``(model.vocab, added_tokens)`` of ``model_dir/tokenizer.json``; None without one."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
    return data.get("model", {}).get("vocab"), added


def shared_cache(
    cache: CacheConfig, target: ModelArch, draft: ModelArch, kv_dtype: torch.dtype
) -> CacheConfig:
    """``cache`` with ``num_blocks`` fixed for two pools of one block count: the target's
    and the draft's blocks together fit ``kv_cache_memory`` (bytes).

    Raises:
        ValueError: not one block of each fits.
    """
    if cache.num_blocks is not None:
        return cache
    per_block = bytes_per_block(target, cache.block_size, kv_dtype) + bytes_per_block(
        draft, cache.block_size, kv_dtype
    )
    n = cache.kv_cache_memory // per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_memory={cache.kv_cache_memory} bytes holds no block of the target "
            f"and draft KV pools ({per_block} bytes per block of {cache.block_size} tokens)"
        )
    return dataclasses.replace(cache, num_blocks=n)


def resolve_draft(config: ModelConfig, max_model_len: int) -> tuple[Path, ModelArch]:
    """The draft's folder and architecture.

    Raises:
        ValueError: an unsupported architecture, or a context shorter than the target's
            ``max_model_len`` (tokens).
        ModelStoreError: the draft model cannot be resolved.
    """
    path = resolve_model(config)
    arch = ModelArch.from_pretrained(path, max_model_len)
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(
            f"draft model {path} holds {arch.max_position_embeddings} positions, fewer than "
            f"the target's max_model_len {max_model_len}"
        )
    return path, arch


class DraftModel:
    """The draft model, its KV pool and how far each sequence's draft KV goes.

    Args:
        model: the loaded draft model (weights final, forward installed).
        kv_pool: its pool, the target pool's ``num_blocks`` and ``block_size``.
        device: where the step tensors go.
    """

    def __init__(self, model: LlamaForCausalLM, kv_pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.computed: dict[str, int] = {}

    @classmethod
    def load(
        cls,
        path: Path,
        arch: ModelArch,
        cache: CacheConfig,
        max_model_len: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
        backend: str,
    ) -> DraftModel:
        """Load the draft in the target's ``dtype`` with a pool of ``cache.num_blocks``
        blocks of ``kv_dtype``, on the packed CPU GEMM where the target's rules allow it.

        Raises:
            ValueError: ``cache.num_blocks`` unset, or from :func:`load_model`.
        """
        if cache.num_blocks is None:
            raise ValueError("the draft's KV pool needs the target pool's num_blocks")
        model = load_model(path, arch, max_model_len, dtype, device, backend)
        packable = dtype != torch.bfloat16 or kv_dtype in cpu_native.KV_DTYPES
        if packable and cpu_kernels_apply(model) and cpu_native.gemm_available():
            model.pack_weights()
        pool = KVPool.allocate(cache, arch, kv_dtype, device)
        model.use_forward(select_forward(model, pool.layer_caches()))
        return cls(model, pool, device)

    def forget(self, seq_id: str) -> None:
        """Drop a sequence's draft KV length (finished, preempted, or arriving anew)."""
        self.computed.pop(seq_id, None)

    def copy_blocks(self, mapping: torch.Tensor, backend: str) -> None:
        """Copy-on-write in the draft pool: int64 ``[N, 2]`` (src, dst) block ids."""
        kernels.copy_blocks(self.kv_pool.key_caches, self.kv_pool.value_caches, mapping, backend)

    def verified(self, seq_id: str, num_computed_tokens: int) -> None:
        """After a step: the draft's KV stands for no more tokens than the target's."""
        done = self.computed.get(seq_id)
        if done is not None and done > num_computed_tokens:
            self.computed[seq_id] = num_computed_tokens

    @torch.inference_mode()
    def propose(
        self, scheduled: Sequence[tuple[SequenceState, int]], num_drafts: Mapping[str, int]
    ) -> None:
        """Propose for this step (the loop of the module docstring).

        Args:
            scheduled: the target's ``(state, chunk length)`` pairs, in batch order, before
                any proposal is appended.
            num_drafts: seq_id -> proposals to make (>= 1) for the sequences that draft;
                their chunk is their last known token.

        Effects:
            Appends each drafting sequence's proposals to its ``token_ids`` and sets its
            ``num_spec_tokens``; writes draft KV for the tokens it ran.

        Raises:
            ValueError: from :func:`prepare_inputs` (a table too short for a chunk).
        """
        computed = self.computed
        batch: list[tuple[SequenceState, int]] = []
        views: dict[str, SequenceState] = {}
        for state, n in scheduled:
            seq_id = state.seq_id
            done = computed.get(seq_id, 0)
            draft = num_drafts.get(seq_id, 0)
            end = len(state.token_ids) if draft else state.num_computed_tokens + n
            if end <= done:
                continue
            # A view with the draft's computed length sharing the sequence's token list
            # and block table: the proposals are appended to the sequence's own tokens.
            view = dataclasses.replace(state, num_computed_tokens=done, num_spec_tokens=0)
            batch.append((view, end - done))
            if draft:
                views[seq_id] = view
        made = dict.fromkeys(views, 0)  # proposals appended so far
        pool, block_size = self.kv_pool, self.kv_pool.block_size
        while batch:
            inputs = prepare_inputs(batch, block_size, pool.num_blocks, self.device)
            logits = self.model(
                inputs.input_ids,
                inputs.positions,
                pool.layer_caches(),
                inputs.attn_metadata,
                inputs.logits_indices,
            )
            for view, n in batch:
                view.num_computed_tokens += n
                computed[view.seq_id] = view.num_computed_tokens
            nxt: list[tuple[SequenceState, int]] = []
            for seq_id, token in zip(inputs.sample_seq_ids, logits.argmax(dim=-1).tolist()):
                drafting = views.get(seq_id)
                if drafting is None:
                    continue  # a prefill's last chunk: sampled by the target alone
                drafting.token_ids.append(token)
                made[seq_id] += 1
                if made[seq_id] < num_drafts[seq_id]:
                    nxt.append((drafting, 1))
            batch = nxt
        for state, _ in scheduled:
            if state.seq_id in made:
                state.num_spec_tokens = made[state.seq_id]
