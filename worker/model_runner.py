"""The model runner: executes one :class:`SchedulerOutput` on the worker's model and KV pool.

Each step (vLLM v1's ``GPUModelRunner.execute_model`` follows the same order):

1. forget ``finished_seq_ids`` (finished, aborted or preempted);
2. add ``new_seqs`` with their full token lists and block tables;
3. apply ``cached_seqs`` deltas (appended block ids, num_computed_tokens);
4. run ``blocks_to_copy`` (copy-on-write) before anything reads or writes the cache;
5. flatten the chunks ``[num_computed, num_computed + n)`` of the sequences in
   ``num_scheduled_tokens`` order into model inputs and run the model;
6. apply penalties and ``min_tokens`` masks (:mod:`pagedserve.worker.logits`), sample
   for the sequences whose known tokens are all computed after the step (logprobs from
   the raw logits for those that ask), append
   the sampled token to the worker's copy of their token list, advance
   ``num_computed_tokens`` by the chunk, and return the tokens.

Because the worker appends what it samples, the scheduler never has to send a decode
token back; it only sends block-table deltas.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import torch

from pagedserve import kernels
from pagedserve.scheduler.beam_search import num_beam_candidates
from pagedserve.scheduler.outputs import RunnerOutput, SampleLogprobs, SchedulerOutput
from pagedserve.worker.arch import ModelArch
from pagedserve.worker.config import WorkerConfig
from pagedserve.worker.cpu_threads import ThreadGovernor
from pagedserve.worker.input_batch import BlockTableRow, SequenceState, prepare_inputs
from pagedserve.worker.kv_pool import KVPool
from pagedserve.worker.logits import compute_logprobs, process_logits
from pagedserve.worker.model_store import resolve_model
from pagedserve.worker.sampler import Sampler
from pagedserve.worker.weights import load_model

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        dtype: model and KV dtype name, e.g. ``"float32"``.
        model_path: the resolved Hugging Face folder.
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


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA when visible, else CPU. Raises ValueError for CUDA without one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> float32 on CPU, bfloat16 on CUDA; else the named dtype."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


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
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.model_path = resolve_model(config.model)
        self.arch = ModelArch.from_pretrained(self.model_path, config.model.max_model_len)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.arch.max_position_embeddings}"
            )
        self.backend = config.attention_backend
        self.model = load_model(
            self.model_path, self.arch, self.max_model_len, self.dtype, self.device, self.backend
        )
        self.kv_pool = KVPool.allocate(config.cache, self.arch, self.dtype, self.device)
        self.sampler = Sampler()
        self.seqs: dict[str, SequenceState] = {}

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
            dtype=str(self.dtype).removeprefix("torch."),
            model_path=str(self.model_path),
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        """Steps 1-3 of the module docstring. Raises ValueError for unknown sequences."""
        for seq_id in so.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in so.new_seqs:
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
        if so.blocks_to_copy:
            mapping = torch.tensor(so.blocks_to_copy, dtype=torch.int64, device=self.device)
            kernels.copy_blocks(
                self.kv_pool.key_caches, self.kv_pool.value_caches, mapping, self.backend
            )
        if not so.num_scheduled_tokens:
            return RunnerOutput(so.step_id, {}, time.perf_counter() - start, started_s=started_s)

        scheduled = [(self.seqs[r], n) for r, n in so.num_scheduled_tokens.items()]
        for state, n in scheduled:
            if state.num_computed_tokens + n > self.max_model_len:
                raise ValueError(
                    f"sequence {state.seq_id} reaches {state.num_computed_tokens + n} tokens, "
                    f"beyond max_model_len {self.max_model_len}"
                )
        inputs = prepare_inputs(
            scheduled, self.kv_pool.block_size, self.kv_pool.num_blocks, self.device
        )
        logits = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_pool.layer_caches(),
            inputs.attn_metadata,
            inputs.logits_indices,
        )
        states = [self.seqs[r] for r in inputs.sample_seq_ids]
        processed = process_logits(
            logits,
            [s.sampling for s in states],
            [s.token_ids for s in states],
            [s.num_prompt_tokens for s in states],
            self.arch.eos_token_ids,
        )
        tokens = self.sampler(processed, [s.sampling_row() for s in states])
        logprobs = self._logprobs(logits, states, tokens)
        beams = self._beam_candidates(logits, states)
        for state, n in scheduled:
            state.num_computed_tokens += n
        sampled = {}
        for state, token in zip(states, tokens):
            if state.seq_id not in beams:  # beam search: the scheduler chooses the token
                state.token_ids.append(token)
                sampled[state.seq_id] = token
        return RunnerOutput(
            so.step_id, sampled, time.perf_counter() - start, logprobs, beams, started_s
        )

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
