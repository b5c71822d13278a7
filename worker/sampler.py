"""Next-token sampling: greedy, temperature, top-k, top-p, reproducible per-request seeds.

Rows whose parameters reduce to argmax (temperature 0 or top_k 1) take the argmax of the
logits. The other rows go through one vectorized pass (processors in the order HF
transformers applies them: temperature, then top-k, then top-p):

1. divide the logits by the row's temperature;
2. sort each row in descending order (stable, so ties keep ascending token ids);
3. top-k: keep the first k sorted tokens;
4. top-p (nucleus, Holtzman et al., 2020, sec. 3.1): keep the smallest sorted prefix whose
   probability mass reaches p (a token is dropped when the mass *before* it is >= p);
5. draw by inverse transform sampling: one uniform u per row, the token is the first whose
   cumulative kept mass exceeds ``u * total``.

The uniform of the token at output position ``i`` of choice ``c`` comes from a CPU
``torch.Generator`` seeded with a hash of ``(seed, c, i)``. The draw therefore depends only
on the request and the logits: not on batch composition, on which step the token is
computed in, or on a preemption and recompute in between (vLLM offers the same guarantee
for per-request seeds). The logits themselves are bitwise independent of the batch only in
batch-invariant mode (:mod:`pagedserve.worker.batch_invariant`); otherwise a last-bit
difference can flip a near-tied draw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_native
from pagedserve.scheduler.sampling_params import GREEDY_TEMPERATURE


def derive_seed(seed: int, choice_index: int, output_index: int) -> int:
    """A 64-bit generator seed for output token ``output_index`` of choice ``choice_index``."""
    digest = hashlib.blake2b(
        f"{seed}:{choice_index}:{output_index}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class SamplingRow:
    """How to sample one row of logits.

    Attributes:
        temperature: >= 0; 0 means greedy.
        top_k: tokens kept; 0 or -1 disables (1 means greedy).
        top_p: nucleus mass in (0, 1]; 1 disables.
        seed: the request's seed (drawn at random by the worker when the user gave none).
        choice_index: which choice of the request this sequence is.
        output_index: position of the token being drawn among the sequence's outputs.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    choice_index: int = 0
    output_index: int = 0

    @property
    def greedy(self) -> bool:
        """True when the row reduces to argmax."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def sorted_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered sampling distribution of each row, in descending-logit order.

    Args:
        logits: float ``[N, V]``.
        temperature: float ``[N]``, > 0.
        top_k: int64 ``[N]``; values <= 0 or >= V disable top-k.
        top_p: float ``[N]`` in (0, 1]; 1 disables top-p.

    Returns:
        ``(probs, order)``: float64 ``[N, V]`` probabilities (dropped tokens are exactly 0,
        rows sum to 1) and int64 ``[N, V]`` token ids in that order.
    """
    vocab = logits.shape[1]
    scaled = logits.double() / temperature.double().to(logits.device).unsqueeze(1)
    values, order = scaled.sort(dim=-1, descending=True, stable=True)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).to(logits.device)
    ranks = torch.arange(vocab, device=logits.device)
    values = values.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    p = top_p.double().to(logits.device).unsqueeze(1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= p) & (p < 1.0)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """:func:`sorted_probs` scattered back to vocabulary order: float64 ``[N, V]``."""
    probs, order = sorted_probs(logits, temperature, top_k, top_p)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: ``logits.argmax(dim=-1)`` of float ``[N, V]``, on the CPU kernel
    (:func:`pagedserve.kernels.cpu_native.argmax_rows`, the same indices) for fp32 CPU
    logits when it is built."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and cpu_native.available()
    ):
        return cpu_native.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Samples one token per logits row. Holds only a reusable CPU generator."""

    def __init__(self) -> None:
        self._generator = torch.Generator(device="cpu")

    def _uniforms(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """float64 ``[len(rows)]`` uniforms in [0, 1), each from its row's derived seed."""
        out = torch.empty(len(rows), dtype=torch.float64)
        for i, row in enumerate(rows):
            self._generator.manual_seed(derive_seed(row.seed, row.choice_index, row.output_index))
            out[i] = torch.rand((), dtype=torch.float64, generator=self._generator)
        return out

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """Sample a token id for each row.

        Args:
            logits: float ``[N, V]`` (any device).
            rows: ``N`` sampling specs, in row order.

        Returns:
            ``N`` token ids.

        Raises:
            ValueError: when ``len(rows) != N``.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
        if not rows:
            return []
        tokens = greedy_tokens(logits)
        random_rows = [i for i, row in enumerate(rows) if not row.greedy]
        if random_rows:
            specs = [rows[i] for i in random_rows]
            idx = torch.tensor(random_rows, device=logits.device)
            probs, order = sorted_probs(
                logits.index_select(0, idx),
                torch.tensor([r.temperature for r in specs], dtype=torch.float64),
                torch.tensor([r.top_k for r in specs], dtype=torch.int64),
                torch.tensor([r.top_p for r in specs], dtype=torch.float64),
            )
            cdf = probs.cumsum(dim=-1)
            target = self._uniforms(specs).to(cdf.device).unsqueeze(1) * cdf[:, -1:]
            pick = torch.searchsorted(cdf, target, right=True)
            # Never step past the last kept token (u * total can round up to total).
            last_kept = ((probs > 0).sum(dim=-1, keepdim=True) - 1).clamp_min(0)
            pick = torch.minimum(pick, last_kept)
            tokens[idx] = order.gather(1, pick).squeeze(1)
        return tokens.tolist()
