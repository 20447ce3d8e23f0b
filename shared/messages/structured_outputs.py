"""``StructuredOutputsParams``: the constraint a request's output must satisfy (vLLM's names).

A msgspec record (``shared.messages.common.Record``): checked once where it is built, carried
inside ``SamplingParams`` (and ``CompileGrammar``) and decoded with its types checked only.
"""

from __future__ import annotations

import hashlib
import json as jsonlib
from typing import Any

from shared.messages.common import Record, is_decoding

#: the constraint kinds, one of which a ``StructuredOutputsParams`` sets
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# compiled grammars an executor keeps (shared/structured_output.py's LRU); the scheduler
# remembers as many per group as compiled there, so one evicted there is asked for again
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputsParams(Record):
    """Exactly one constraint on the generated text (vLLM's ``StructuredOutputsParams``).

    - ``json``: a JSON Schema (a dict, or its JSON text); the output is a JSON value valid
      under it.
    - ``regex``: the output matches the regular expression in full.
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: a context-free grammar, in EBNF (xgrammar's GBNF dialect, ``root ::= ...``)
      or Lark (llguidance's, ``start: ...``).
    - ``json_object``: the output is any JSON object.

    ``disable_any_whitespace`` forbids whitespace between a JSON value's tokens (``json``
    and ``json_object``), as vLLM's option. The grammar is compiled by the structured output
    backend (``shared/structured_output``): xgrammar, with llguidance for what xgrammar
    refuses. Whether a schema, regex or grammar compiles is checked when the request is
    tokenized (the HTTP API answers 400 naming the field).

    Raises:
        ValueError: none or several of the constraints are given, ``choice`` is empty or holds
            a non-string, ``json`` is a string that is not JSON, ``json_object`` is False, or a
            value is of the wrong type; the message names the field.
        TypeError: an unknown field.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if is_decoding():
            return
        self._coerce()
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            which = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be set, got {which}")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be true when given")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must hold at least one string")
        if isinstance(self.json, str):
            try:
                schema = jsonlib.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON Schema object")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    def spec(self) -> str:
        """The constraint as one string, the key of its compiled grammar: a schema as compact
        JSON (its keys in their order: properties are generated in schema order), the choices as a JSON list, ``""`` for ``json_object``."""
        kind = self.kind
        if kind == "json":
            schema = jsonlib.loads(self.json) if isinstance(self.json, str) else self.json
            return jsonlib.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return jsonlib.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    def cache_key(self) -> tuple[str, str, bool]:
        """``(kind, spec, disable_any_whitespace)``: equal keys compile to the same grammar."""
        return self.kind, self.spec(), self.disable_any_whitespace

    def digest(self) -> str:
        """A short stable name of ``cache_key()`` (hex, 16 characters): how the scheduler and an
        executor group name a grammar (``CompileGrammar``, ``GrammarReady``)."""
        return hashlib.sha256(jsonlib.dumps(self.cache_key()).encode()).hexdigest()[:16]


#: vLLM's name before 0.11 (``SamplingParams(guided_decoding=GuidedDecodingParams(...))``)
GuidedDecodingParams = StructuredOutputsParams
