"""The model runner: executes one :class:`SchedulerOutput` on the worker's model and KV pool.

Each step (vLLM v1's ``GPUModelRunner.execute_model`` follows the same order):

1. forget ``finished_seq_ids`` (finished, aborted or preempted);
2. add ``new_seqs`` with their full token lists and block tables;
3. apply ``cached_seqs`` deltas (appended block ids, num_computed_tokens);
4. run ``blocks_to_copy`` (copy-on-write) before anything reads or writes the cache;
   with speculative decoding by a draft model, the draft proposes the
   ``num_draft_tokens`` of each sequence (:mod:`pagedserve.worker.draft_model`);
5. flatten the chunks ``[num_computed, num_computed + n)`` of the sequences in
   ``num_scheduled_tokens`` order into model inputs and run the model;
6. apply penalties and ``min_tokens`` masks (:mod:`pagedserve.worker.logits`), then the
   structured-output bitmask of the constrained rows (filled on a thread while step 5 ran,
   :mod:`pagedserve.worker.structured`), sample
   for the sequences whose known tokens are all computed after the step (logprobs from
   the raw logits for those that ask), append
   the sampled token to the worker's copy of their token list, advance
   ``num_computed_tokens`` by the chunk, and return the tokens.

Because the worker appends what it samples, the scheduler never has to send a decode
token back; it only sends block-table deltas.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve import kernels
from pagedserve.kernels import cpu_native
from pagedserve.scheduler.beam_search import num_beam_candidates
from pagedserve.scheduler.outputs import (
    NewSequenceData,
    RunnerOutput,
    SampleLogprobs,
    SchedulerOutput,
    SwapResult,
)
from pagedserve.scheduler.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from pagedserve.worker import precision
from pagedserve.worker.arch import ModelArch
from pagedserve.worker.batch_invariant import make_batch_invariant
from pagedserve.worker.config import WorkerConfig
from pagedserve.worker.cpu_forward import bf16_cpu_path_available, cpu_kernels_apply
from pagedserve.worker.cpu_threads import ThreadGovernor
from pagedserve.worker.draft_model import (
    DraftModel,
    check_same_vocabulary,
    resolve_draft,
    shared_cache,
)
from pagedserve.worker.forward import select_forward
from pagedserve.worker.input_batch import BlockTableRow, SequenceState, prepare_inputs
from pagedserve.worker.kv_pool import KVPool, bytes_per_block, num_blocks_for
from pagedserve.worker.kv_swap import KVSwapper, SwapError
from pagedserve.worker.logits import compute_logprobs, process_logits
from pagedserve.worker.model_store import resolve_model, weights_digest
from pagedserve.worker.parallel import TensorParallelGroup
from pagedserve.worker.sampler import Sampler
from pagedserve.worker.sharding import ShardPlan, load_sharded_model
from pagedserve.worker.spec_decode import accept, expand_rows
from pagedserve.worker.structured import StructuredOutputsRunner
from pagedserve.worker.weights import load_model

if TYPE_CHECKING:  # grpc only where a store is connected
    from pagedserve.worker.swap_client import HostStoreClient

log = logging.getLogger(__name__)

# NOTE: a pull from another node's store fails fast (then recompute) rather than stall
# the step for the local store's 60 s deadline when that node is gone or cut off.
REMOTE_STORE_TIMEOUT_S = 10.0
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}


@dataclass(frozen=True)
class WorkerInfo:
    """What the scheduler needs to know about a worker once it has started.

    Attributes:
        worker_id: index of the worker.
        num_blocks: blocks in its KV pool.
        block_size: tokens per block.
        max_model_len: longest sequence (prompt + outputs) it accepts, tokens.
        vocab_size: rows of the LM head.
        eos_token_ids: end-of-sequence ids of the model.
        device: ``"cpu"`` or ``"cuda:N"``.
        dtype: the model's dtype name, e.g. ``"float32"``.
        model_path: the resolved Hugging Face folder.
        block_bytes: bytes of one KV block, all layers, K and V (of this rank's KV heads
            under tensor parallelism).
        kv_cache_dtype: the KV pool's dtype name (the model's unless ``kv_cache_dtype`` says).
        node_id: the Ray node id (hex) of the worker's process; ``""`` outside Ray. The
            launcher starts one host block store per node id.
        weights_digest: sha256 hex of the weight files
            (:func:`~pagedserve.worker.model_store.weights_digest`); workers of one cluster
            must agree on it.
        tensor_parallel_size: ranks of the logical worker (1: not sharded).
    """

    worker_id: int
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    model_path: str
    block_bytes: int = 0
    kv_cache_dtype: str = "float32"
    node_id: str = ""
    weights_digest: str = ""
    tensor_parallel_size: int = 1


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA when visible, else CPU. Raises ValueError for CUDA without one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtypes(
    config: WorkerConfig, model_path: str, device: torch.device
) -> tuple[torch.dtype, torch.dtype]:
    """``(model dtype, KV cache dtype)`` for ``config`` on ``device``, by the rules of
    :mod:`pagedserve.worker.precision` (``auto``: the checkpoint's 16-bit dtype where the
    device's forward runs it fast; bf16 for an fp32 checkpoint on CUDA and on CPUs with
    native bf16 where the bf16 GEMM is built; fp32 on other CPUs)."""
    if device.type == "cuda":
        native = precision.native_dtypes(
            "cuda", frozenset(), cuda_bf16=torch.cuda.is_bf16_supported()
        )
    else:
        native = precision.native_dtypes(
            device.type,
            precision.read_cpu_flags(),
            # Batch invariance holds on the fp32 kernels only: auto stays fp32 for it.
            cpu_bf16_kernels=bf16_cpu_path_available() and not config.model.batch_invariant,
        )
    model = precision.resolve_model_dtype(
        config.model.dtype, precision.checkpoint_dtype(model_path), native
    )
    kv = precision.resolve_kv_cache_dtype(config.cache.kv_cache_dtype, model)
    return _DTYPES[model], _DTYPES[kv]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class ModelRunner:
    """Holds the model, the KV pool and per-sequence state of one worker.

    Args:
        config: the worker's configuration (model, cache, device, threads, backend).

    Raises:
        ValueError: unsupported model, unusable device, ``max_model_len`` beyond the
            model's context, or a KV budget too small for one block.
        ModelStoreError: when the model cannot be resolved.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.thread_governor: ThreadGovernor | None = None
        if config.adaptive_threads and config.num_threads > 0 and self.device.type == "cpu":
            self.thread_governor = ThreadGovernor(config.num_threads, torch.set_num_threads)
        self.model_path = resolve_model(config.model)
        self.dtype, self.kv_cache_dtype = resolve_dtypes(config, str(self.model_path), self.device)
        self.arch = ModelArch.from_pretrained(self.model_path, config.model.max_model_len)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.arch.max_position_embeddings}"
            )
        self.backend = config.attention_backend
        self.group = TensorParallelGroup.join(config.parallel, self.device)
        self.device = self.group.device if self.group.size > 1 else self.device
        # The shapes of this rank's KV heads (the whole model's when not sharded).
        self.kv_arch = self.arch
        self.packed_gemm = False
        self.draft: DraftModel | None = None
        if self.group.size > 1:
            self._load_shard()
        else:
            self.model = load_model(
                self.model_path, self.arch, self.max_model_len, self.dtype, self.device,
                self.backend,
            )  # fmt: skip
            if config.model.batch_invariant:
                self._make_batch_invariant()
            else:
                self._pack_weights()
            cache = config.cache
            if config.draft_model is not None:
                draft_path, draft_arch = resolve_draft(config.draft_model, self.max_model_len)
                check_same_vocabulary(self.model_path, self.arch, draft_path, draft_arch)
                cache = shared_cache(cache, self.arch, draft_arch, self.kv_cache_dtype)
            self.kv_pool = KVPool.allocate(cache, self.arch, self.kv_cache_dtype, self.device)
            # The forward every step runs, chosen once for these weights and this pool.
            self.model.use_forward(select_forward(self.model, self.kv_pool.layer_caches()))
            if config.draft_model is not None:
                self.draft = DraftModel.load(
                    draft_path, draft_arch, cache, self.max_model_len, self.dtype,
                    self.kv_cache_dtype, self.device, self.backend,
                )  # fmt: skip
        self.sampler = Sampler()
        self.seqs: dict[str, SequenceState] = {}
        self.swapper = KVSwapper(
            self.kv_pool, self.backend, connect=self._connect_remote_store, group=self.group
        )
        self.structured = StructuredOutputsRunner(
            str(self.model_path), self.arch.vocab_size, self.arch.eos_token_ids
        )

    def _load_shard(self) -> None:
        """Load this rank's slice of the model (:mod:`pagedserve.worker.sharding`) and a KV
        pool of its KV heads, with as many blocks as the smallest rank's pool, so that a
        block id means the same block on every rank.

        Raises:
            ValueError: ``batch_invariant`` (its fused fp32 kernels do not shard), or
                heads the group size does not divide (:class:`ShardPlan`).
        """
        if self.config.model.batch_invariant:
            raise ValueError("batch_invariant does not apply with tensor_parallel_size > 1")
        plan = ShardPlan(self.arch, self.group.rank, self.group.size)
        self.kv_arch = plan.local_arch
        self.model = load_sharded_model(
            self.model_path, plan, self.group, self.max_model_len, self.dtype, self.device,
            self.backend,
        )  # fmt: skip
        log.info(
            "rank %d of %d: heads %s, KV heads %s, vocabulary %s; the generic per-layer "
            "forward (the fused CPU forward cannot all-reduce inside its C call)",
            plan.rank, plan.size, plan.heads, plan.kv_heads, plan.vocab_range,
        )  # fmt: skip
        n = self.group.min_int(num_blocks_for(self.config.cache, self.kv_arch, self.kv_cache_dtype))
        cache = dataclasses.replace(self.config.cache, num_blocks=n)
        self.kv_pool = KVPool.allocate(cache, self.kv_arch, self.kv_cache_dtype, self.device)

    def _make_batch_invariant(self) -> None:
        """Fixed-shape matmuls (see :mod:`pagedserve.worker.batch_invariant`).

        Raises:
            ValueError: the model does not run on the fused fp32 CPU kernels, whose
                attention and norms are the ones known to be batch-invariant.
        """
        if (
            not cpu_kernels_apply(self.model)
            or self.dtype != torch.float32
            or self.kv_cache_dtype != torch.float32
        ):
            raise ValueError(
                "batch_invariant needs the fused fp32 CPU kernels (device cpu, dtype and "
                "kv_cache_dtype float32, attention backend auto or cpu); got device "
                f"{self.device}, dtype {dtype_name(self.dtype)}, kv_cache_dtype "
                f"{dtype_name(self.kv_cache_dtype)}, "
                f"backend {self.backend}"
            )
        if self._pack_weights():
            # The packed GEMM sums each output over K in order: rows are independent.
            self.model.batch_invariant = True  # attention: every token as a decode
            return
        make_batch_invariant(self.model, self.model.embed_tokens.weight)

    def _pack_weights(self) -> bool:
        """Run the linear layers on the packed CPU GEMM
        (:mod:`pagedserve.worker.packed_linear`; bf16 weights:
        :mod:`pagedserve.worker.packed_linear_bf16`) when the model runs on the fused CPU
        kernels and the GEMM is available (``PAGEDSERVE_CPU_GEMM`` not 0); returns whether
        it does."""
        if not (cpu_kernels_apply(self.model) and cpu_native.gemm_available()):
            return False
        if self.dtype == torch.bfloat16 and self.kv_cache_dtype not in cpu_native.KV_DTYPES:
            return False  # the CPU forwards would not apply: keep the generic layers whole
        self.model.pack_weights()
        self.packed_gemm = True
        return True

    def get_info(self) -> WorkerInfo:
        """Static facts about this worker (see :class:`WorkerInfo`)."""
        return WorkerInfo(
            worker_id=self.config.worker_id,
            num_blocks=self.kv_pool.num_blocks,
            block_size=self.kv_pool.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.arch.vocab_size,
            eos_token_ids=self.arch.eos_token_ids,
            device=str(self.device),
            dtype=dtype_name(self.dtype),
            model_path=str(self.model_path),
            block_bytes=bytes_per_block(self.kv_arch, self.kv_pool.block_size, self.kv_cache_dtype),
            kv_cache_dtype=dtype_name(self.kv_cache_dtype),
            weights_digest=weights_digest(self.model_path),
            tensor_parallel_size=self.group.size,
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        """Steps 1-3 of the module docstring. Raises ValueError for unknown sequences."""
        draft = self.draft
        for seq_id in so.finished_seq_ids:
            self.seqs.pop(seq_id, None)
            if draft is not None:
                draft.forget(seq_id)
        for new in so.new_seqs:
            if draft is not None:
                draft.forget(new.seq_id)  # no draft KV: swap, fork and recompute skip it
            seed = new.sampling.seed
            self.seqs[new.seq_id] = SequenceState(
                seq_id=new.seq_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=BlockTableRow(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
                choice_index=new.choice_index,
                seed=secrets.randbits(63) if seed is None else seed,
            )
            spec = new.sampling.structured_outputs
            if spec is not None and self.group.is_driver:  # rank 0 alone masks and samples
                # Fork, recompute, swap-in and migration all arrive here: the matcher is
                # rebuilt from the outputs the scheduler holds.
                self.seqs[new.seq_id].grammar = self.structured.build(
                    spec, new.token_ids[new.num_prompt_tokens :]
                )
        for cached in so.cached_seqs:
            state = self.seqs.get(cached.seq_id)
            if state is None:
                raise ValueError(f"cached sequence {cached.seq_id!r} is unknown to this worker")
            start = cached.new_blocks_start
            if not (0 <= start <= len(state.block_ids)):
                raise ValueError(
                    f"sequence {cached.seq_id!r}: new_blocks_start {start} is outside its "
                    f"block table ({len(state.block_ids)} blocks)"
                )
            # table[start:] = new ids: an append, or copy-on-write replacing the last entry
            state.block_ids.assign(start, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.token_ids.extend(cached.new_token_ids)  # chosen by beam search
            if cached.spec_token_ids:  # verified this step (spec_decode)
                state.token_ids.extend(cached.spec_token_ids)
                state.num_spec_tokens = len(cached.spec_token_ids)
        unknown = [r for r in so.num_scheduled_tokens if r not in self.seqs]
        if unknown:
            raise ValueError(f"scheduled sequences unknown to this worker: {unknown}")

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        """Run one step; return the sampled tokens (see the module docstring).

        Raises:
            ValueError: on a SchedulerOutput inconsistent with the worker's state (unknown
                sequence, chunk past the known tokens, short block table, bad block id,
                position beyond ``max_model_len``).
        """
        start = time.perf_counter()
        started_s = time.monotonic()
        if self.thread_governor is not None:
            self.thread_governor.tick()
        self._update_states(so)
        # NOTE: swap-outs first: their blocks may be reused by this very step (swap-in
        # destinations, copy-on-write targets, new KV); swap-ins before the copies, which
        # may read a block just swapped in.
        swaps = self.swapper.run(so.swap_plan) if so.swap_plan is not None else {}
        dropped = self._drop_failed_swap_ins(so, swaps)
        if so.blocks_to_copy:
            mapping = torch.tensor(so.blocks_to_copy, dtype=torch.int64, device=self.device)
            kernels.copy_blocks(
                self.kv_pool.key_caches, self.kv_pool.value_caches, mapping, self.backend
            )
            if self.draft is not None:
                self.draft.copy_blocks(mapping, self.backend)
        if not so.num_scheduled_tokens.keys() - dropped:
            return RunnerOutput(
                so.step_id,
                {},
                time.perf_counter() - start,
                swap_results=swaps,
                started_s=started_s,
            )

        scheduled = [
            (self.seqs[r], n) for r, n in so.num_scheduled_tokens.items() if r not in dropped
        ]
        for state, n in scheduled:
            if state.num_computed_tokens + n > self.max_model_len:
                raise ValueError(
                    f"sequence {state.seq_id} reaches {state.num_computed_tokens + n} tokens, "
                    f"beyond max_model_len {self.max_model_len}"
                )
        num_drafts = {c.seq_id: c.num_draft_tokens for c in so.cached_seqs if c.num_draft_tokens}
        if num_drafts:
            if self.draft is None:
                raise ValueError(
                    f"{len(num_drafts)} sequences to draft for, but this worker has no draft "
                    "model (WorkerConfig.draft_model)"
                )
            self.draft.propose(scheduled, num_drafts)
        inputs = prepare_inputs(
            scheduled, self.kv_pool.block_size, self.kv_pool.num_blocks, self.device
        )
        states = [self.seqs[r] for r in inputs.sample_seq_ids]
        # A speculative step (proposals to verify) has no constrained row: speculation and
        # structured outputs are refused together at validation.
        speculative = any(s.num_spec_tokens for s in states)
        if speculative and self.group.size > 1:
            raise ValueError("speculative decoding needs tensor_parallel_size 1")
        # NOTE: the grammar bitmask fills on a thread while the forward runs (xgrammar's
        # fill releases the GIL, as do the model's kernels); None when nothing is masked.
        grammar_step = (
            None if speculative else self.structured.start_fill([s.grammar for s in states])
        )
        logits = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_pool.layer_caches(),
            inputs.attn_metadata,
            inputs.logits_indices,
        )
        if not self.group.is_driver:
            return self._follow_step(so, scheduled, states, start, started_s, swaps)
        if speculative:
            out = self._verify(so, logits, states, scheduled)
            if self.draft is not None:
                for state, _ in scheduled:
                    self.draft.verified(state.seq_id, state.num_computed_tokens)
            return dataclasses.replace(
                out,
                execute_time_s=time.perf_counter() - start,
                swap_results=swaps,
                started_s=started_s,
            )
        processed = process_logits(
            logits,
            [s.sampling for s in states],
            [s.token_ids for s in states],
            [s.num_prompt_tokens for s in states],
            self.arch.eos_token_ids,
        )
        fill_s = 0.0
        if grammar_step is not None:
            # NOTE: masked in place unless the raw logits are read after sampling.
            copy = processed is logits and any(
                s.sampling.logprobs is not None or s.sampling.use_beam_search for s in states
            )
            greedy = [
                s.sampling.temperature < GREEDY_TEMPERATURE or s.sampling.top_k == 1 for s in states
            ]
            processed, fill_s = self.structured.apply(grammar_step, processed, copy, greedy)
        tokens = self.sampler(processed, [s.sampling_row() for s in states])
        self._share_tokens(tokens)
        logprobs = self._logprobs(logits, states, tokens)
        beams = self._beam_candidates(logits, states)
        for state, n in scheduled:
            state.num_computed_tokens += n
        sampled = {}
        failed: dict[str, str] = {}
        for state, token in zip(states, tokens):
            if state.seq_id in beams:  # beam search: the scheduler chooses the token
                continue
            # The worker keeps the token even when the grammar fails, so a step already
            # planned for the sequence still finds its tokens; the scheduler aborts it.
            state.token_ids.append(token)
            grammar = state.grammar
            if grammar is not None and (grammar.error or not grammar.accept(token)):
                failed[state.seq_id] = grammar.error
                continue
            sampled[state.seq_id] = token
        return RunnerOutput(
            so.step_id,
            sampled,
            time.perf_counter() - start,
            logprobs,
            beams,
            swaps,
            started_s,
            failed,
            fill_s,
        )

    def _share_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled ``tokens`` (one per sampling row) on every rank of the group:
        each rank appends them to its copy of the sequences."""
        if self.group.size == 1 or not tokens:
            return tokens
        t = torch.tensor(tokens, dtype=torch.int64, device=self.group.device)
        return [int(x) for x in self.group.broadcast_tensor(t).tolist()]

    def _follow_step(
        self,
        so: SchedulerOutput,
        scheduled: list[tuple[SequenceState, int]],
        states: list[SequenceState],
        start: float,
        started_s: float,
        swaps: dict[str, SwapResult],
    ) -> RunnerOutput:
        """The end of a step on a rank other than 0: rank 0's sampled tokens appended as
        rank 0 appends them (beam-search sequences take theirs from the scheduler); the
        answer carries no tokens (rank 0's is the logical worker's)."""
        tokens = self._share_tokens([0] * len(states))
        for state, n in scheduled:
            state.num_computed_tokens += n
        for state, token in zip(states, tokens):
            if not state.sampling.use_beam_search:
                state.token_ids.append(token)
        return RunnerOutput(
            so.step_id, {}, time.perf_counter() - start, swap_results=swaps, started_s=started_s
        )

    def _verify(
        self,
        so: SchedulerOutput,
        logits: torch.Tensor,
        states: list[SequenceState],
        scheduled: list[tuple[SequenceState, int]],
    ) -> RunnerOutput:
        """Sample every row of a step with speculative sequences and keep the accepted
        tokens (:mod:`pagedserve.worker.spec_decode`). A speculative sequence advances by
        its last known token and the accepted proposals and answers in
        ``spec_token_ids``; the others as in a plain step."""
        vr = expand_rows(states)
        processed = process_logits(
            logits, vr.params, vr.token_ids, vr.num_prompt_tokens, self.arch.eos_token_ids
        )
        drawn = self.sampler(processed, vr.rows)
        sampled: dict[str, int] = {}
        logprobs: dict[str, SampleLogprobs] = {}
        spec: dict[str, list[int]] = {}
        spec_lps: dict[str, list[SampleLogprobs]] = {}
        rejected: dict[str, int] = {}
        for i, state in enumerate(states):
            first, end = vr.starts[i], vr.starts[i + 1]
            s = state.num_spec_tokens
            known = len(state.token_ids) - s
            tokens = accept(state.token_ids[known:], drawn[first:end])
            del state.token_ids[known:]
            state.token_ids.extend(tokens)
            state.num_spec_tokens = 0
            k = state.sampling.logprobs
            found = []
            if k is not None:
                found = compute_logprobs(
                    logits, range(first, first + len(tokens)), tokens, [k] * len(tokens)
                )
            if s:
                spec[state.seq_id] = tokens
                rejected[state.seq_id] = s + 1 - len(tokens)
                if found:
                    spec_lps[state.seq_id] = found
            else:
                sampled[state.seq_id] = tokens[0]
                if found:
                    logprobs[state.seq_id] = found[0]
        for state, n in scheduled:
            state.num_computed_tokens += n - rejected.get(state.seq_id, 0)
        return RunnerOutput(
            so.step_id,
            sampled,
            logprobs=logprobs,
            spec_token_ids=spec,
            spec_logprobs=spec_lps,
        )

    def _drop_failed_swap_ins(self, so: SchedulerOutput, swaps: dict[str, SwapResult]) -> set[str]:
        """Forget the sequences of failed swap-ins (the scheduler recomputes them)."""
        dropped: set[str] = set()
        for t in so.swap_plan.blocks_to_swap_in if so.swap_plan is not None else ():
            if not swaps[t.transfer_id].ok:
                dropped.update(t.seq_ids)
        for seq_id in dropped:
            self.seqs.pop(seq_id, None)
        return dropped

    # ------------------------------------------------------------------ swap setup
    def connect_host_store(self, address: str) -> None:
        """Use the host block store at ``address`` (``host:port``) for swap transfers, with
        the key and TLS trust of ``config.host_store_access``."""
        from pagedserve.worker.swap_client import HostStoreClient

        if self.swapper.client is not None:
            self.swapper.client.close()
        self.swapper.client = HostStoreClient(
            address,
            access=self.config.host_store_access,
            rank=self.group.rank,
            tensor_parallel_size=self.group.size,
        )

    def _connect_remote_store(self, address: str) -> HostStoreClient:
        """The client of another node's store at ``address``: the cluster's store key and
        TLS trust (every store of a cluster shares them), a deadline of
        ``REMOTE_STORE_TIMEOUT_S``."""
        from pagedserve.worker.swap_client import HostStoreClient

        return HostStoreClient(
            address,
            timeout_s=REMOTE_STORE_TIMEOUT_S,
            access=self.config.host_store_access,
            rank=self.group.rank,
            tensor_parallel_size=self.group.size,
        )

    def measure_prefill_s_per_token(self, num_tokens: int = 256) -> float:
        """Seconds per token of one prefill of ``num_tokens`` (capped by the pool and
        ``max_model_len``), run on scratch state before serving (blocks 0.. are
        overwritten; call only while no sequence is resident).

        Raises:
            RuntimeError: sequences are resident.
        """
        if self.seqs:
            raise RuntimeError("measure_prefill_s_per_token needs an idle worker")
        bs = self.kv_pool.block_size
        n = max(1, min(num_tokens, self.max_model_len - 1, self.kv_pool.num_blocks * bs))
        probe = "__prefill_probe__"
        tokens = [(7 * i + 3) % self.arch.vocab_size for i in range(n)]
        new = NewSequenceData(
            seq_id=probe,
            token_ids=tokens,
            num_prompt_tokens=n,
            block_ids=list(range(-(-n // bs))),
            num_computed_tokens=0,
            sampling=SamplingParams(temperature=0.0, max_tokens=1),
        )
        self.execute_model(SchedulerOutput(0, new_seqs=[new], num_scheduled_tokens={probe: 1}))
        t0 = time.perf_counter()
        so = SchedulerOutput(
            1,
            new_seqs=[new],
            num_scheduled_tokens={probe: n},
            finished_seq_ids=[probe],
        )
        self.execute_model(so)
        elapsed = time.perf_counter() - t0
        self.seqs.pop(probe, None)
        return elapsed / n

    def measure_swap_bandwidth(self, num_bytes: int = 8 << 20) -> float:
        """Bytes per second of one swap-out + swap-in through the host store (the mean of
        the two directions), with about ``num_bytes`` of real pool blocks; host blocks
        ``0..`` are written and freed (call before the scheduler swaps anything).

        Raises:
            SwapError: no store is connected, or it fails.
        """
        return self._round_trip(self.swapper.client, num_bytes)

    def measure_pull_bandwidth(self, address: str, num_bytes: int = 8 << 20) -> float:
        """Bytes per second of a swap-out + swap-in through another node's store at
        ``address`` (its remote address; the mean of the two directions), as
        :meth:`measure_swap_bandwidth`: the rate of this worker's remote swap-ins from it.
        Host blocks ``0..`` of that store are written and freed (call before serving).

        Raises:
            SwapError: the store cannot be reached, or it fails.
        """
        return self._round_trip(self.swapper.remote_client(address), num_bytes)

    def _round_trip(self, client: HostStoreClient | None, num_bytes: int) -> float:
        """One-way bytes/s of a round trip of about ``num_bytes`` through ``client``.

        Under tensor parallelism every rank runs it at once (each with its own chunks) and
        the result is the group's: ``T`` times the slowest rank's rate, the same on every
        rank; a failure on any rank fails it on all.
        """
        try:
            rate = self._round_trip_rank(client, num_bytes)
            error = ""
        except SwapError as exc:
            if self.group.size == 1:
                raise
            rate, error = 0.0, str(exc)
        if self.group.size == 1:
            return rate
        slowest = self.group.min_int(int(rate))
        if slowest < 1:
            raise SwapError(error or "the swap probe failed on another rank of the group")
        return float(slowest * self.group.size)

    def _round_trip_rank(self, client: HostStoreClient | None, num_bytes: int) -> float:
        """This rank's one-way bytes/s of a round trip of about ``num_bytes``."""
        if client is None:
            raise SwapError("no host block store is connected")
        per_block = bytes_per_block(self.kv_arch, self.kv_pool.block_size, self.kv_cache_dtype)
        n = max(1, min(self.kv_pool.num_blocks, num_bytes // per_block))
        ids = list(range(n))
        t0 = time.perf_counter()
        packed = self.swapper.pack(ids)
        client.swap_out("__bandwidth_probe__", packed, ids)
        back = self.swapper.host_buffer(n)
        client.swap_in("__bandwidth_probe__", ids, back)
        self.swapper.unpack(ids, back)
        t2 = time.perf_counter()
        client.free(ids)
        return 2 * n * per_block / (t2 - t0)

    def _beam_candidates(
        self, logits: torch.Tensor, states: list[SequenceState]
    ) -> dict[str, tuple[tuple[int, float], ...]]:
        """Top candidates (raw-logit log-softmax) of beam-search sequences."""
        rows = [i for i, s in enumerate(states) if s.sampling.use_beam_search]
        if not rows:
            return {}
        counts = []
        for i in rows:
            sp = states[i].sampling
            num_eos = 0 if sp.ignore_eos else len(self.arch.eos_token_ids)
            counts.append(num_beam_candidates(sp.beam_width, num_eos))
        found = compute_logprobs(logits, rows, [0] * len(rows), counts)
        return {states[i].seq_id: lp.top for i, lp in zip(rows, found)}

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, states: list[SequenceState], tokens: list[int]
    ) -> dict[str, SampleLogprobs]:
        """Logprobs (raw logits) of the sampled tokens of sequences that asked for them."""
        rows = [i for i, s in enumerate(states) if s.sampling.logprobs is not None]
        found = compute_logprobs(
            logits,
            rows,
            [tokens[i] for i in rows],
            [states[i].sampling.logprobs or 0 for i in rows],
        )
        return {states[i].seq_id: lp for i, lp in zip(rows, found)}
