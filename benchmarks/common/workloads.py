"""Workloads (and the co-load) that benchmarks of several groups share.

* :data:`PROMPTS`: the chat prompts of the first serving benchmark
  (``engine/engine_inprocess.py``, ``engine/profile_step.py``);
* :func:`serving_workload`: the seeded chat + document mix of ``serving/serving.py``
  (``memory/capacity.py`` runs it too, so the two figures share a workload);
* :func:`busy_core`: a seeded CPU-bound process body for the shared-machine runs
  (``memory/pressure.py --co-load``, ``engine/threads_sharing.py``).

A script imports it after putting this folder on its path::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))
    from workloads import PROMPTS

(this folder only: ``benchmarks/`` itself holds a ``kernels/`` folder that would shadow
the PyPI package transformers probes for).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from typing import Any

# Chat prompts of the first serving benchmark (engine/engine_inprocess.py, engine/profile_step.py).
PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are the main causes of climate change?",
    "Describe how a bicycle works.",
    "Give three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
]

_TOPICS = [
    "the water cycle",
    "photosynthesis",
    "the French revolution",
    "compound interest",
    "volcanoes",
    "the immune system",
    "black holes",
    "supply chains",
    "jazz music",
    "bread baking",
    "plate tectonics",
    "the printing press",
    "vaccines",
    "tides",
    "solar panels",
    "coral reefs",
    "the stock market",
    "honey bees",
    "glaciers",
    "chess",
]
_ASKS = [
    "Explain {t} to a ten-year-old.",
    "What are three surprising facts about {t}?",
    "Write a short story that involves {t}.",
    "Compare {t} and {u} in a few sentences.",
    "Give me a step-by-step guide to understanding {t}.",
    "Why does {t} matter for everyday life?",
    "Write a haiku about {t}.",
    "List the pros and cons of studying {t}.",
]
_SUBJECTS = [
    "The committee",
    "A small team",
    "The city council",
    "Researchers",
    "The author",
    "Local farmers",
    "The new manager",
    "Several students",
    "The museum",
    "Engineers",
]
_VERBS = [
    "reviewed",
    "described",
    "questioned",
    "improved",
    "measured",
    "documented",
    "criticised",
    "funded",
    "simplified",
    "tested",
]
_OBJECTS = [
    "the annual budget",
    "a bridge design",
    "the survey results",
    "an old archive",
    "the water supply",
    "a training program",
    "the harvest forecast",
    "a new library",
    "the transport plan",
    "the safety rules",
]
_TAILS = [
    "after a long debate.",
    "with unexpected results.",
    "during the winter months.",
    "despite several delays.",
    "for the first time in a decade.",
    "in great detail.",
    "with help from volunteers.",
    "before the deadline.",
]


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _document(rng: random.Random, n_sentences: int) -> str:
    sents = [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        for _ in range(n_sentences)
    ]
    paras = [" ".join(sents[i : i + 5]) for i in range(0, len(sents), 5)]
    return "\n\n".join(paras)


def serving_workload(
    tokenizer: Any, n: int, seed: int, max_model_len: int, quick: bool
) -> list[dict[str, Any]]:
    """``n`` requests: 70% chat questions, 30% documents to summarise (seeded).

    Document length (sentences, ~13 tokens each) and output length are log-normal: the
    medians are 20 sentences and 64 tokens (sigma 0.8 / 0.9), capped at 100 sentences and
    512 tokens, and prompt + output within ``max_model_len``. ``quick`` scales all down.
    """
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        if rng.random() < 0.3:
            n_sent = _lognormal_int(rng, 6 if quick else 20, 0.8, 2, 20 if quick else 100)
            text = "Summarize the following document.\n\n" + _document(rng, n_sent)
            kind = "document"
        else:
            t, u = rng.sample(_TOPICS, 2)
            text = rng.choice(_ASKS).format(t=t, u=u)
            kind = "chat"
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
        )
        if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
            ids = list(ids["input_ids"])
        out = _lognormal_int(rng, 8 if quick else 64, 0.9, 4, 16 if quick else 512)
        out = min(out, max_model_len - len(ids))
        reqs.append({"id": f"r{i}", "kind": kind, "prompt_ids": ids, "max_tokens": out})
    return reqs


def busy_core(core: int, seed: int, stop: Any) -> None:
    """A CPU-bound loop pinned to ``core`` (an LCG over a seeded state) until ``stop``."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {core})
    x = seed
    while not stop.is_set():
        for _ in range(200_000):
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
