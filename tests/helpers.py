"""Reusable test helpers: tiny random HF models, a char-level tokenizer, a fake scheduler.

* :func:`build_tiny_model` writes a small random Llama-family model (safetensors) and a
  character-level tokenizer with a ChatML template to a folder, so tests can load it with
  HF transformers and with pagedserve.
* :class:`FakeScheduler` drives a worker (anything with ``execute_model``) through
  continuous batching with a token budget (chunked prefill), a shuffled free-block list
  (non-contiguous block tables, reuse of freed blocks) and the SchedulerOutput delta
  contract. It is deliberately simple: no preemption, no prefix cache.
* :func:`drive` runs the real step loop (:class:`~pagedserve.scheduler.engine_loop.
  EngineLoop`) over in-process workers (:class:`InProcessWorker`) until no worker can make
  progress, with every scheduler's integrity checked after every step.
"""

from __future__ import annotations

import asyncio
import random
import string
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.scheduler.engine_messages import EngineRequest
from pagedserve.scheduler.outputs import (
    CachedSequenceData,
    NewSequenceData,
    RunnerOutput,
    SchedulerOutput,
    SwapPlan,
)
from pagedserve.scheduler.sampling_params import SamplingParams

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=1_000_000)
TINY_PROMPTS = [
    [5, 17, 33, 9, 100, 64, 2, 77, 31],
    [12],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61],
    [99, 3, 3, 3, 120, 7, 8],
    [1, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91,
     92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105],
]  # fmt: skip


def swaps_of(so: SchedulerOutput) -> SwapPlan:
    """The step's swap plan, or an empty one when it moves nothing."""
    return so.swap_plan if so.swap_plan is not None else SwapPlan()


def build_char_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast``: 5 specials + printable ASCII (105 ids).

    ``<s>`` is 1 and ``</s>`` is 2 (as Llama); ``<|im_end|>`` is 4.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHATML
    return tok


def build_tiny_model(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Save a random tiny model (fp32 safetensors + char tokenizer) to ``path``.

    Default shape: vocab 128, hidden 96, 2 layers, 6 heads / 2 KV heads (head_dim 16),
    intermediate 192, rope theta 10000, untied embeddings, weights ~N(0, 0.2) so outputs
    depend strongly on context. ``overrides`` go to the HF config class.
    """
    import torch
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
    }[architecture]
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    with torch.no_grad():  # give the norms non-trivial weights too
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    out = Path(path)
    model.save_pretrained(out, safe_serialization=True)
    build_char_tokenizer().save_pretrained(out)
    return out


@dataclass
class _Seq:
    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    sampling: SamplingParams
    choice_index: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False
    outputs: list[int] = field(default_factory=list)


class FakeScheduler:
    """A minimal continuous-batching scheduler for driving a worker in tests.

    Each step spends ``token_budget`` tokens: running sequences first (a decode costs 1, a
    prefill continues with a chunk of at most the remaining budget), then waiting ones
    are admitted in order while budget and ``max_num_seqs`` allow. Blocks come from a
    shuffled free list; finished sequences return theirs (so later ones reuse dirty
    blocks) and are reported in the next step's ``finished_seq_ids``.
    """

    def __init__(
        self,
        worker: Any,
        block_size: int,
        num_blocks: int,
        token_budget: int = 64,
        max_num_seqs: int = 64,
        shuffle_seed: int | None = 0,
    ) -> None:
        self.worker = worker
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free_blocks)
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.step_id = 0
        self.history: list[SchedulerOutput] = []
        self.outputs: list[RunnerOutput] = []

    def _alloc(self, seq: _Seq, end: int) -> list[int]:
        need = -(-end // self.block_size) - len(seq.block_ids)
        if need > len(self.free_blocks):
            raise RuntimeError("FakeScheduler ran out of blocks (no preemption)")
        new = [self.free_blocks.pop() for _ in range(max(need, 0))]
        seq.block_ids.extend(new)
        return new

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        sampling: SamplingParams = GREEDY,
        prefix: str = "req",
        num_prompt_tokens: list[int] | None = None,
        choice_indices: list[int] | None = None,
    ) -> list[list[int]]:
        """Run ``prompts`` to ``max_tokens`` new outputs each; return them in order.

        ``num_prompt_tokens`` marks how much of each prompt is prompt (the rest being
        earlier outputs), as when a preempted request is resumed by recomputation.
        ``choice_indices`` gives each sequence its choice index (seeds sampling; default 0).
        """
        lens = num_prompt_tokens or [len(p) for p in prompts]
        choices = choice_indices or [0] * len(prompts)
        seqs = [
            _Seq(f"{prefix}-{i}", list(p), n, max_tokens, sampling, c)
            for i, (p, n, c) in enumerate(zip(prompts, lens, choices))
        ]
        waiting, running = deque(seqs), []
        finished: list[str] = []
        while waiting or running:
            budget = self.token_budget
            new, cached, counts, skipped = [], [], {}, []
            candidates = list(running)
            while waiting and len(candidates) < self.max_num_seqs:
                candidates.append(waiting.popleft())
            for seq in candidates:
                n = min(len(seq.token_ids) - seq.num_computed, budget)
                if n <= 0:
                    if not seq.sent:
                        skipped.append(seq)
                    continue
                start = len(seq.block_ids)
                new_blocks = self._alloc(seq, seq.num_computed + n)
                if seq.sent:
                    cached.append(
                        CachedSequenceData(seq.seq_id, start, new_blocks, seq.num_computed)
                    )
                else:
                    new.append(
                        NewSequenceData(
                            seq.seq_id,
                            list(seq.token_ids),
                            seq.num_prompt_tokens,
                            list(seq.block_ids),
                            seq.num_computed,
                            seq.sampling,
                            seq.choice_index,
                        )
                    )
                    seq.sent = True
                    running.append(seq)
                counts[seq.seq_id] = n
                budget -= n
            waiting.extendleft(reversed(skipped))
            so = SchedulerOutput(self.step_id, new, cached, counts, finished)
            self.step_id += 1
            self.history.append(so)
            out = self.worker.execute_model(so)
            self.outputs.append(out)
            finished = []
            for seq in list(running):
                if seq.seq_id not in counts:
                    continue
                seq.num_computed += counts[seq.seq_id]
                token = out.sampled_token_ids.get(seq.seq_id)
                if token is None:
                    continue
                seq.token_ids.append(token)
                seq.outputs.append(token)
                if len(seq.outputs) >= seq.max_tokens:
                    running.remove(seq)
                    self.free_blocks.extend(seq.block_ids)
                    finished.append(seq.seq_id)
        if finished:
            self.worker.execute_model(SchedulerOutput(self.step_id, finished_seq_ids=finished))
            self.step_id += 1
        return [s.outputs for s in seqs]


def use_forward(worker: Any, name: str) -> None:
    """Install the model forward called ``name`` (``cpu-fused``, ``cpu-layers`` or
    ``layers``) on a local worker's model, for its KV pool's caches."""
    from pagedserve.worker.cpu_forward import CpuLayerForward, FusedCpuForward
    from pagedserve.worker.model import LayerForward

    model, caches = worker.runner.model, worker.runner.kv_pool.layer_caches()
    chosen = {
        "cpu-fused": lambda: FusedCpuForward.build(model, caches),
        "cpu-layers": lambda: CpuLayerForward.build(model, caches),
        "layers": LayerForward,
    }[name]()
    assert chosen is not None and chosen.name == name
    model.use_forward(chosen)


def chunk_and_decode_inputs(worker: Any, block_size: int, num_blocks: int) -> Any:
    """One step's ModelInputs of 21 rows: a 20-token prefill chunk of ``TINY_PROMPTS[4]``
    over an 8-token cached prefix (blocks 0-29) and a decode of ``TINY_PROMPTS[0]`` at
    position 8 (blocks 60, 59, 58)."""
    from pagedserve.worker.input_batch import SequenceState, prepare_inputs

    long, short = TINY_PROMPTS[4], TINY_PROMPTS[0]
    chunk = SequenceState("a", list(long), len(long), list(range(30)), 0, GREEDY, 0, 0)
    chunk.num_computed_tokens = 8
    decode = SequenceState("b", list(short), len(short), [60, 59, 58], 0, GREEDY, 0, 0)
    decode.num_computed_tokens = 8
    return prepare_inputs([(chunk, 20), (decode, 1)], block_size, num_blocks, worker.runner.device)


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers greedy continuation of one prompt (batch 1, no EOS stop)."""
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def until_eos(ids: list[int], eos_ids: tuple[int, ...] | list[int]) -> list[int]:
    """``ids`` cut after the first EOS (kept), for comparing runs that stop differently."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


class ScriptedWorker:
    """Mirrors the worker's per-request state; 'samples' len(tokens) + 100 (or a script)."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.script = script or {}

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for rid in so.finished_seq_ids:
            self.tables.pop(rid, None)
            self.tokens.pop(rid, None)
        for nr in so.new_seqs:
            self.tables[nr.seq_id] = list(nr.block_ids)
            self.tokens[nr.seq_id] = list(nr.token_ids)
        for cr in so.cached_seqs:
            table = self.tables[cr.seq_id]
            assert 0 <= cr.new_blocks_start <= len(table)
            table[cr.new_blocks_start :] = cr.new_block_ids
        sampled = {}
        spec: dict[str, list[int]] = {}
        drafts = {cr.seq_id: cr.spec_token_ids for cr in so.cached_seqs if cr.spec_token_ids}
        for rid, n in so.num_scheduled_tokens.items():
            computed = self._computed(so, rid)
            proposed = drafts.get(rid, [])
            assert computed + n - len(proposed) <= len(self.tokens[rid])
            if proposed:
                # Speculative decoding: 'sample' each position in turn, accept while the
                # proposal agrees (what the real worker's verification does).
                assert computed + n == len(self.tokens[rid]) + len(proposed)
                out = spec[rid] = []
                for j in range(len(proposed) + 1):
                    out.append(self._sample(rid))
                    if j == len(proposed) or out[-1] != proposed[j]:
                        break
            elif computed + n == len(self.tokens[rid]):
                sampled[rid] = self._sample(rid)
        return RunnerOutput(step_id=so.step_id, sampled_token_ids=sampled, spec_token_ids=spec)

    def _sample(self, rid: str) -> int:
        script = self.script.get(rid.split("/")[0])
        tok = script.pop(0) if script else 100 + len(self.tokens[rid])
        self.tokens[rid].append(tok)
        return tok

    @staticmethod
    def _computed(so: SchedulerOutput, rid: str) -> int:
        for nr in so.new_seqs:
            if nr.seq_id == rid:
                return nr.num_computed_tokens
        for cr in so.cached_seqs:
            if cr.seq_id == rid:
                return cr.num_computed_tokens
        raise AssertionError(rid)


class CheckedKVCacheManager:
    """Proxy over a KVCacheManager that runs ``check_integrity()`` after every method call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from pagedserve.scheduler.kv_cache_manager import KVCacheManager

        self.m = KVCacheManager(*args, **kwargs)
        self.m.check_integrity()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.m, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self.m.check_integrity()

        return call

    def used(self) -> int:
        """Blocks not allocatable now (held by some block table)."""
        return self.m.num_blocks - self.m.num_free_blocks


# ----------------------------------------------------------------------------- the step loop
class InProcessWorker:
    """A synchronous worker (``execute`` of a fake, or ``Worker.execute_model``) as the
    engine loop's ``WorkerHandle``: the step runs when it is sent, as a worker that runs
    its steps in order would run it, and the answer comes after one turn of the event loop
    (so several workers' loops interleave). Deterministic, unlike a thread.

    Args:
        execute: runs one step.
        die_when: ``die_when(sched_out)`` True when the step is sent kills the worker:
            that step, every unanswered one and every later one fail with
            ``WorkerDied``, as a dead Ray actor's would. Setting ``dead`` does the same.
    """

    def __init__(self, execute: Any, die_when: Any = None) -> None:
        self._execute = execute
        self._die_when = die_when
        self.dead = False
        self.sent: list[SchedulerOutput] = []

    def execute(self, so: SchedulerOutput) -> Any:
        from pagedserve.scheduler.engine_loop import WorkerDied

        self.sent.append(so)
        self.dead = self.dead or bool(self._die_when and self._die_when(so))
        if self.dead:
            return self._answer(None, WorkerDied("killed by the test"))
        try:
            return self._answer(self._execute(so), None)
        except Exception as exc:  # a failed step: raised where the answer is awaited
            return self._answer(None, exc)

    async def _answer(self, out: RunnerOutput | None, exc: BaseException | None) -> RunnerOutput:
        from pagedserve.scheduler.engine_loop import WorkerDied

        await asyncio.sleep(0)
        if self.dead:  # as a dead actor's calls: every answer not yet read is lost
            raise WorkerDied("killed by the test")
        if exc is not None:
            raise exc
        assert out is not None
        return out


@dataclass
class Driven:
    """What :func:`drive` saw: tokens per (request id, choice index), every delta in order,
    the final delta of each request id, how many steps were planned in all and how many
    of them while another of the same worker was in flight."""

    tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)
    finish: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    ahead: int = 0


def drive(
    sched: Any,
    workers: list[Any],
    on_plan: Any = None,
    on_step: Any = None,
    timeout_s: float = 120.0,
    check: bool = True,
    until: Any = None,
    max_steps: int | None = None,
) -> Driven:
    """Run ``sched``'s engine loop (serial or overlapped, as its config says) over
    ``workers`` until no worker can make progress; assert nothing is left to do.

    Args:
        workers: per worker id, a ``WorkerHandle`` or a callable ``execute(so)`` (wrapped
            in an :class:`InProcessWorker`).
        on_plan: ``on_plan(sched, worker_id, so, in_flight_so)`` after a step is sent.
        on_step: ``on_step(sched, worker_id, so)`` after its answer is applied.
        check: ``sched.check_integrity()`` after every step.
        until: ``until()`` True stops planning (the run ends once the steps in flight are
            applied; work may be left).
        max_steps: a bound on the steps planned (all workers together); the run must
            finish within it.
    """
    from pagedserve.scheduler.engine_loop import EngineLoop

    seen = Driven()

    def sink(outputs: list[Any]) -> None:
        for o in outputs:
            seen.outputs.append(o)
            seen.tokens.setdefault((o.request_id, o.choice_index), []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                seen.finish[o.request_id] = o.finish_reason

    def planned(wid: int, so: SchedulerOutput, cur: SchedulerOutput | None) -> None:
        seen.steps += 1
        seen.ahead += cur is not None
        if on_plan is not None:
            on_plan(sched, wid, so, cur)

    def stepped(wid: int, so: SchedulerOutput, ro: RunnerOutput) -> None:
        if check:
            sched.check_integrity()
        if on_step is not None:
            on_step(sched, wid, so)

    handles = {
        i: w if hasattr(w, "execute") and not callable(w) else InProcessWorker(w)
        for i, w in enumerate(workers)
    }

    def stop() -> bool:
        if max_steps is not None and seen.steps >= max_steps:
            return True
        return until is not None and bool(until())

    engine = EngineLoop(sched, handles, sink, planned, stepped)
    asyncio.run(asyncio.wait_for(engine.run_until_idle(stop), timeout_s))
    if until is None:
        bounded = max_steps is not None and seen.steps >= max_steps
        assert not any(sched.has_work(i) for i in sched.workers), (
            f"did not finish within the step bound ({max_steps})" if bounded else "stalled"
        )
    return seen


# ----------------------------------------------------------------------------- beam search
def hf_beams(
    hf: Any, prompt: list[int], k: int, n: int, max_new: int, length_penalty: float, eos: Any
) -> list[tuple[list[int], float]]:
    """HF ``generate(num_beams=k, num_return_sequences=n, early_stopping=True)``: the n best
    beams as (generated ids cut after the first EOS, sequence score), best first."""
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            num_beams=k,
            num_return_sequences=n,
            do_sample=False,
            early_stopping=True,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=eos if eos is not None else 0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    rows = []
    for row, score in zip(out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()):
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append((row, score))
    return rows


def run_beams(
    model_dir: Path,
    prompt: list[int],
    sampling: SamplingParams,
    num_blocks: int = 64,
    eos: tuple[int, ...] = (2,),
    block_size: int = 4,
    max_model_len: int = 256,
    worker: Any = None,
    on_done: Any = None,
) -> tuple[list[Any], int, int]:
    """Run one beam-search request through the real Scheduler and a Worker (a new one unless
    ``worker`` is given; integrity checked after every step). Returns (final deltas, peak
    used blocks, number of block copies); ``on_done(scheduler)`` is called at the end."""
    from pagedserve.scheduler.config import SchedulerConfig
    from pagedserve.scheduler.scheduler import Scheduler, WorkerSpec
    from pagedserve.worker.config import CacheConfig, ModelConfig, WorkerConfig
    from pagedserve.worker.worker import Worker

    if worker is None:
        worker = Worker(
            WorkerConfig(
                model=ModelConfig(
                    model=str(model_dir), max_model_len=max_model_len, dtype="float32"
                ),
                cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                device="cpu",
            )
        )
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64, max_model_len=max_model_len, async_scheduling=False
        ),
        [WorkerSpec(0, num_blocks, block_size)],
    )
    sched.workers[0].kv = kv = CheckedKVCacheManager(num_blocks, block_size, True)
    sched.add_request(EngineRequest("r", prompt, sampling, eos))
    peak, copies = 0, 0

    def planned(s: Any, wid: int, so: SchedulerOutput, cur: Any) -> None:
        nonlocal peak, copies
        peak = max(peak, kv.used())
        copies += len(so.blocks_to_copy)

    outs = drive(sched, [worker.execute_model], on_plan=planned).outputs
    assert kv.num_free_blocks == num_blocks and not sched.requests and not sched.sequences
    if on_done is not None:
        on_done(sched)
    return outs, peak, copies


def assert_same_beams(ours: list[Any], ref: list[tuple[list[int], float]]) -> None:
    """Our final beams equal HF's: same count and order, scores within 1e-4, and the same
    tokens except where two candidates' scores differ by < 1e-4 (a near-tie)."""
    import pytest

    assert [o.choice_index for o in ours] == list(range(len(ref)))
    for o, (tokens, score) in zip(ours, ref):
        assert o.score == pytest.approx(score, abs=1e-4)
        if list(o.new_token_ids) != tokens:
            assert any(abs(o.score - s) < 1e-4 for t, s in ref if t == list(o.new_token_ids))
    assert [o.score for o in ours] == sorted((o.score for o in ours), reverse=True)


class LoopThread:
    """An asyncio loop on a daemon thread; an in-process cluster's frontend lives there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 300.0) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout=timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class ActorStreams:
    """A test's frontend of a :class:`SchedulerActor` (in process): one subscription,
    demultiplexed per request by tag, as :class:`pagedserve.cluster.output_router.
    OutputRouter` does for the real frontend.

    ``generate(request_id, prompt, sampling)`` adds the request and yields its outputs in
    batches (all queued since the last batch); it ends once every choice finished, and a
    consumer that stops early aborts the request.
    """

    def __init__(self, actor: Any, subscriber: str = "test-frontend") -> None:
        self.actor = actor
        self.subscriber = subscriber
        self._tags = iter(range(1, 1 << 62))
        self._queues: dict[int, asyncio.Queue[Any]] = {}
        self._pump: asyncio.Task[None] | None = None
        self._opening: asyncio.Future[None] | None = None

    async def _open(self) -> None:
        # One subscription for all concurrent generate() calls, as the OutputRouter keeps:
        # a second one under the same name would end the first and abort its requests.
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._subscribe())
        await asyncio.shield(self._opening)

    async def _subscribe(self) -> None:
        stream = self.actor.subscribe(self.subscriber)
        assert await stream.__anext__() == []  # subscribed

        async def pump() -> None:
            async for batch in stream:
                for tag, out in batch:
                    queue = self._queues.get(tag)
                    if queue is not None:
                        queue.put_nowait(out)

        self._pump = asyncio.ensure_future(pump())

    async def generate(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, eos: tuple = ()
    ) -> Any:
        from pagedserve.scheduler.engine_messages import EngineRequest

        await self._open()
        tag = next(self._tags)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[tag] = queue
        remaining = sampling.n
        try:
            await self.actor.add_request(
                EngineRequest(
                    request_id, prompt, sampling, eos, subscriber=self.subscriber, tag=tag
                )
            )
            while remaining > 0:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                remaining -= sum(1 for o in batch if o.finish_reason is not None)
                yield batch
        finally:
            del self._queues[tag]
            route = self.actor._routes.get(request_id)
            if remaining > 0 and route is not None and route.tag == tag:
                await self.actor.abort(request_id)  # still this stream's request
