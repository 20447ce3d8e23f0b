"""The structured output backend: compiles a ``StructuredOutputsParams`` into a grammar and
makes per-request matchers that fill token bitmasks (vLLM's ``backend="auto"``).

xgrammar (Dong et al. 2024, "XGrammar") compiles first; what it refuses (a Lark grammar, a
regex or schema feature it lacks) goes to llguidance (Microsoft's guidance engine, Earley
over a lexer). A spec both refuse is a ``StructuredOutputError`` naming the field. Compiled
grammars are kept in an LRU keyed by ``(kind, spec, disable_any_whitespace)``, so one schema
compiles once per process.

Both fill the same bitmask layout: ``int32 [rows, ceil(V / 32)]``, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. ``V`` is the model's logits width (the config's
``vocab_size``, which may exceed the tokenizer's: the extra ids are never allowed). Once the
constraint is complete only the stop tokens (the model's EOS ids) are allowed.

Used by the tokenizer service (to refuse a bad spec when the request arrives) and by an
executor group's rank 0 (to constrain sampling: ``services/executor/structured_output.py``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shared.logging import get_logger
from shared.messages.structured_outputs import GRAMMAR_CACHE_SIZE, StructuredOutputsParams

log = get_logger("structured_output")
CACHE_SIZE = GRAMMAR_CACHE_SIZE  # compiled grammars kept per process (LRU)
#: the whitespace a JSON value may hold between two tokens when ``disable_any_whitespace`` is
#: off: unbounded whitespace lets a small model at temperature 1 wander off for ever
MAX_JSON_WHITESPACE = 8


class StructuredOutputError(ValueError):
    """A structured output spec that no backend compiles; ``param`` names its field
    (``structured_outputs.json``, ...), ``str()`` says why."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar refuses it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 ``[R, ceil(V / 32)]``)."""

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and a stop token was accepted."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: xgrammar's ``CompiledGrammar`` or llguidance's grammar text."""

    backend: str  # "xgrammar" or "guidance"
    grammar: Any


def bitmask_words(vocab_size: int) -> int:
    """Words of one bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(
    logits: torch.Tensor,  # [N, V] float32, changed in place
    bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32
    rows: list[int],  # [R]: the logits row of each bitmask row
) -> None:
    """Set to -inf the logits of the tokens each row's bitmask forbids, in the listed rows
    only (the others are left as they are): xgrammar's CPU kernel
    (``apply_token_bitmask_inplace``) on CPU float32 logits the mask covers, else the same in
    torch, on any device (a mask narrower than the logits forbids the tokens past it)."""
    if not rows:
        return
    vocab = logits.shape[1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and bitmask.shape[1] * 32 >= vocab:
        import xgrammar

        if rows == list(range(logits.shape[0])):
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        else:
            index = torch.tensor(rows)
            picked = logits[index]  # [R, V]: the kernel's indices address the mask's rows too
            xgrammar.apply_token_bitmask_inplace(picked, bitmask)
            logits[index] = picked
        return
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()  # [R, V]
    if allowed.shape[1] < vocab:  # a mask narrower than the logits allows none of the rest
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (each escaped)."""
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class StructuredOutputBackend:
    """Compiles constraints for one tokenizer and makes matchers (thread-safe).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (``config.vocab_size``), >= the tokenizer's.
        eos_token_ids: the tokens that end a request; the only ones allowed once the
            constraint is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._xgr_compiler: Any = None
        self._ll_tokenizer: Any = None

    # ------------------------------------------------------------------ compile

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params`` (cached).

        Raises:
            StructuredOutputError: neither backend compiles it; names the field.
        """
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = CompiledGrammar("xgrammar", self._compile_xgrammar(params))
        except (RuntimeError, ValueError, TypeError) as xgr_error:
            try:
                compiled = CompiledGrammar("guidance", self._compile_guidance(params))
            except (RuntimeError, ValueError, TypeError) as ll_error:
                raise StructuredOutputError(
                    f"structured_outputs.{params.kind}: invalid ({_first_line(xgr_error)}; "
                    f"llguidance: {_first_line(ll_error)})", f"structured_outputs.{params.kind}") from None
            log.info("structured_output_fallback", kind=params.kind, xgrammar_error=_first_line(xgr_error))
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile_xgrammar(self, params: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        if self._xgr_compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.eos_token_ids))
            self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiler = self._xgr_compiler
        whitespace: dict[str, Any] = (
            {"any_whitespace": False} if params.disable_any_whitespace
            else {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE})
        kind = params.kind
        if kind == "json":
            return compiler.compile_json_schema(params.spec(), strict_mode=True, **whitespace)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_regex(_choice_regex(params.choice or []))
        return compiler.compile_grammar(params.grammar)

    def _compile_guidance(self, params: StructuredOutputsParams) -> str:
        import llguidance
        import llguidance.hf

        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=list(self.eos_token_ids) or None)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = json.loads(params.spec()) if kind == "json" else {"type": "object"}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_regex(_choice_regex(params.choice or []))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(params.grammar)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if is_error:
            raise ValueError("; ".join(messages) or "invalid grammar")
        return grammar

    # ------------------------------------------------------------------ matchers

    def matcher(self, compiled: CompiledGrammar) -> Matcher:
        """A fresh matcher at the start of ``compiled``."""
        if compiled.backend == "xgrammar":
            return _XgrammarMatcher(compiled.grammar, self.eos_token_ids)
        return _GuidanceMatcher(self._ll_tokenizer, compiled.grammar, self.eos_token_ids)


_backends: dict[tuple, StructuredOutputBackend] = {}
_backends_lock = threading.Lock()


def shared_backend(model_path: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                   load_tokenizer: Callable[[], Any]) -> StructuredOutputBackend:
    """The process's one backend for this model (made with ``load_tokenizer()`` the first
    time), so that the services of one process (the offline ``LLM``) share its compiled
    grammars: the executor finds compiled what the tokenizer service checked."""
    key = (str(model_path), vocab_size, tuple(eos_token_ids))
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            backend = _backends[key] = StructuredOutputBackend(load_tokenizer(), vocab_size, eos_token_ids)
        return backend


def _first_line(error: BaseException) -> str:
    """An exception's message, without xgrammar's ``[time] file.cc:line:`` prefix."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(error).__name__
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text


def _only(bitmask: torch.Tensor, row: int, token_ids: tuple[int, ...]) -> None:
    """``bitmask[row]`` allows exactly ``token_ids``."""
    bitmask[row].zero_()
    for t in token_ids:
        bit = 1 << (t % 32)
        bitmask[row, t // 32] |= bit - 2**32 if bit >= 2**31 else bit  # as a signed int32


class _XgrammarMatcher:
    def __init__(self, compiled: Any, eos_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        self._eos = eos_token_ids

    def accept_token(self, token_id: int) -> bool:
        return not self._m.is_terminated() and bool(self._m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():  # xgrammar refuses to fill then
            _only(bitmask, row, self._eos)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class _GuidanceMatcher:
    def __init__(self, ll_tokenizer: Any, grammar: str, eos_token_ids: tuple[int, ...]) -> None:
        import llguidance

        self._m = llguidance.LLMatcher(ll_tokenizer, grammar)
        self._eos = eos_token_ids
        self._done = False

    def accept_token(self, token_id: int) -> bool:
        if self._done or self._m.is_error():
            return False
        ok = bool(self._m.consume_token(token_id))
        if ok and token_id in self._eos:
            self._done = True
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        if self._done or self._m.is_error():
            _only(bitmask, row, self._eos)
        else:
            llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def is_terminated(self) -> bool:
        # the protocol's meaning (xgrammar's): a stop token accepted. Not llguidance's
        # is_stopped(), which is true in its error state too: a refused token would read as
        # the end of the grammar, and the request would never be marked broken
        return self._done
