"""Compiling a :class:`StructuredOutputs` spec into an xgrammar grammar for one tokenizer.

:class:`GrammarCompiler` wraps ``xgrammar.GrammarCompiler`` for the served model's tokenizer
(the model's vocabulary size, its EOS ids as the grammar's stop tokens) and keeps a bounded
LRU of compiled grammars keyed by :attr:`StructuredOutputs.key`. Every compile runs under a
time limit and a size limit; whatever goes wrong is a ``ValueError`` naming the request
field (``json_schema``, ``json_object``, ``regex``, ``choice``, ``grammar``) and xgrammar's
reason. The frontend compiles before admission (a request that does not compile never
reaches the scheduler); each worker compiles again for its matchers, from the same cache
code (:mod:`pagedserve.worker.structured`).

JSON is compiled compact (``any_whitespace=False``: no whitespace between tokens), as
vLLM's ``disable-any-whitespace`` option does: a small model let free on whitespace can
fill ``max_tokens`` with newlines. Schemas compile in xgrammar's strict mode whatever
``strict`` says (no properties or items beyond the schema's where it leaves them open):
such an output satisfies the non-strict schema as well. ``choice`` compiles to the EBNF ``root ::= "a" | "b"``
(each string JSON-escaped, the literal syntax xgrammar's EBNF reads).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from pagedserve.scheduler.structured_outputs import StructuredOutputs
from pagedserve.worker.schema_keywords import unenforced_keyword

FIELDS = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
"""The request field each :attr:`StructuredOutputs.kind` comes from (named in errors)."""

_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # "[16:53:21] /path/file.cc:94: "


@dataclass(frozen=True)
class GrammarConfig:
    """Limits of grammar compilation.

    Attributes:
        max_cached: compiled grammars kept (LRU), >= 1.
        compile_timeout_s: seconds one compile may take, > 0.
        max_grammar_bytes: the largest compiled grammar (xgrammar's
            ``memory_size_bytes``: its token-mask cache), > 0.
        compile_threads: xgrammar's threads per compile, >= 1.
        max_concurrent: compiles running at once (one past its time limit keeps its
            slot until it ends), >= 1.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    max_cached: int = 128
    compile_timeout_s: float = 10.0
    max_grammar_bytes: int = 256 << 20
    compile_threads: int = 2
    max_concurrent: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.max_cached, int) or self.max_cached < 1:
            raise ValueError(f"max_cached must be an int >= 1, got {self.max_cached!r}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s!r}")
        if not isinstance(self.max_grammar_bytes, int) or self.max_grammar_bytes < 1:
            raise ValueError(f"max_grammar_bytes must be >= 1, got {self.max_grammar_bytes!r}")
        if not isinstance(self.compile_threads, int) or self.compile_threads < 1:
            raise ValueError(f"compile_threads must be >= 1, got {self.compile_threads!r}")
        if not isinstance(self.max_concurrent, int) or self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent!r}")


def xgrammar_reason(exc: BaseException) -> str:
    """xgrammar's error message without its timestamp and C++ source location."""
    text = str(exc).strip()
    return _XGR_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


def _refuse_unenforced(schema_text: str) -> None:
    """Raise ``ValueError`` (``json_schema: ...``) where xgrammar would drop a keyword.

    Text that is not JSON is left to xgrammar, whose reason is the clearer one.
    """
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        return
    found = unenforced_keyword(schema)
    if found is not None:
        keyword, where = found
        raise ValueError(
            f"json_schema: keyword {keyword!r} (at {where}) is not supported: "
            "xgrammar would not enforce it"
        )


def choice_grammar(choices: tuple[str, ...]) -> str:
    """The EBNF grammar matching exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles specs for one tokenizer, with a bounded LRU of the results (thread-safe).

    Args:
        tokenizer: the served model's Hugging Face tokenizer.
        vocab_size: rows of the model's LM head (the bitmask covers them all).
        eos_token_ids: the model's EOS ids: the only tokens that end a grammar.
        config: limits (default :class:`GrammarConfig`).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        config: GrammarConfig | None = None,
    ) -> None:
        import xgrammar as xgr

        self.config = config or GrammarConfig()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self._xgr = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=self.config.compile_threads, cache_enabled=False
        )
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._lock = threading.Lock()
        # NOTE: xgrammar cannot stop a compile: each runs on a daemon thread of its own so
        # the caller stops waiting at the time limit (and exit never waits for it); the
        # slots bound how many such threads run at once.
        self._slots = threading.BoundedSemaphore(self.config.max_concurrent)

    @classmethod
    def for_model(
        cls,
        model_path: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        config: GrammarConfig | None = None,
    ) -> GrammarCompiler:
        """A compiler for the tokenizer saved in the model folder ``model_path``."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path), vocab_size, eos_token_ids, config)

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: StructuredOutputs) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (cached by ``spec.key``).

        Raises:
            ValueError: the spec does not compile, is a schema using a keyword xgrammar
                would not enforce (:mod:`pagedserve.worker.schema_keywords`), takes longer than
                ``compile_timeout_s`` or compiles larger than ``max_grammar_bytes``; the
                message starts with the request field (e.g. ``"json_schema: ..."``).
        """
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        field = FIELDS[spec.kind]
        if spec.kind == "json":
            _refuse_unenforced(str(spec.json))
        limit = self.config.compile_timeout_s
        if not self._slots.acquire(timeout=limit):
            raise ValueError(f"{field}: the grammar compiler stayed busy for {limit:g} s")
        future: Future[Any] = Future()
        threading.Thread(
            target=self._run_compile, args=(spec, future), name="grammar-compile", daemon=True
        ).start()
        try:
            compiled = future.result(timeout=limit)
        except FutureTimeout:
            raise ValueError(
                f"{field}: compiling took longer than {self.config.compile_timeout_s:g} s"
            ) from None
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its reason
            raise ValueError(f"{field}: does not compile: {xgrammar_reason(exc)}") from None
        size = int(compiled.memory_size_bytes)
        if size > self.config.max_grammar_bytes:
            raise ValueError(
                f"{field}: the compiled grammar takes {size} bytes "
                f"(at most {self.config.max_grammar_bytes})"
            )
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.config.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _run_compile(self, spec: StructuredOutputs, future: Future[Any]) -> None:
        """Compile on this thread into ``future``, then free the slot."""
        try:
            future.set_result(self._compile_uncached(spec))
        except BaseException as exc:  # delivered to the waiting caller, if still waiting
            future.set_exception(exc)
        finally:
            self._slots.release()

    def _compile_uncached(self, spec: StructuredOutputs) -> Any:
        kind = spec.kind
        source = str(getattr(spec, kind))  # the text of json, regex or grammar
        if kind == "json":
            # NOTE: strict mode always (as vLLM): the output never adds properties the
            # schema does not name, which satisfies a non-strict schema too.
            return self._xgr.compile_json_schema(source, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return self._xgr.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if kind == "regex":
            return self._xgr.compile_regex(source)
        if kind == "choice":
            return self._xgr.compile_grammar(choice_grammar(spec.choice or ()))
        return self._xgr.compile_grammar(source)
