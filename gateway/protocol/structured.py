"""Structured output request fields, OpenAI's and vLLM's, as one ``StructuredOutputsParams``.

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: ``{json, regex, choice, grammar, json_object,
  disable_any_whitespace}``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one of them may ask for a constraint. Errors start with the field's path
(``response_format.json_schema.schema: ...``), so the HTTP error's ``param`` names it; a spec
the backend cannot compile is refused by the tokenizer service as
``structured_outputs.<kind>`` and renamed after the request's own field
(``name_structured_error``).
"""

from __future__ import annotations

import re
from typing import Any

from shared.messages import ServiceError, StructuredOutputsParams

#: vLLM's older fields -> the StructuredOutputsParams field each sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _response_format(value: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str]:
    """``response_format`` as params, and the path of the field holding the constraint."""
    kind = value.get("type")
    if kind in (None, "text"):
        return None, "response_format"
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind != "json_schema":
        raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema must be an object with name and schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
    return StructuredOutputsParams(json=schema), "response_format.json_schema.schema"


def structured_outputs_of(fields: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a request body asks for, and the path of the field that asked.

    ``fields``: the body's ``response_format``, ``structured_outputs`` and ``guided_*``
    values (None when absent).

    Raises:
        ValueError: two fields ask for a constraint, or one is malformed; the message starts
            with the field's name.
    """
    asked: list[tuple[StructuredOutputsParams, str]] = []
    try:
        if fields.get("response_format") is not None:
            params, path = _response_format(fields["response_format"])
            if params is not None:
                asked.append((params, path))
        if (so := fields.get("structured_outputs")) is not None:
            if not isinstance(so, dict):
                raise ValueError("structured_outputs must be an object")
            params = _params(so)
            asked.append((params, f"structured_outputs.{params.kind}"))
        for name, kind in GUIDED_FIELDS.items():
            if fields.get(name) is not None:
                asked.append((_params({kind: fields[name]}), name))
    except _Malformed as exc:
        raise ValueError(_message(exc, asked, fields)) from None
    if len(asked) > 1:
        names = ", ".join(path.split(".")[0] for _, path in asked)
        raise ValueError(f"{asked[1][1].split('.')[0]}: give one structured output constraint, got {names}")
    return asked[0] if asked else (None, None)


class _Malformed(ValueError):
    """A constraint's fields that do not make a ``StructuredOutputsParams``."""


def _params(fields: dict[str, Any]) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**fields)``, its refusal a ``_Malformed`` (an unknown field
    named first: ``jsn: Unexpected keyword argument``)."""
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as exc:
        text = str(exc)
        if m := re.match(r"Unexpected keyword argument '(\w+)'", text):
            text = f"{m.group(1)}: Unexpected keyword argument"
        raise _Malformed(text) from None
    except ValueError as exc:
        raise _Malformed(str(exc)) from None


def _message(exc: _Malformed, asked: list, fields: dict[str, Any]) -> str:
    """A construction error, prefixed with the field being read (the next one not in ``asked``)."""
    order = [n for n in ("response_format", "structured_outputs", *GUIDED_FIELDS) if fields.get(n) is not None]
    name = order[min(len(asked), len(order) - 1)]
    text = str(exc).removeprefix("structured_outputs: ").removeprefix("structured_outputs.")
    return f"{name}: {text}"


def name_structured_error(error: ServiceError, path: str | None) -> ServiceError:
    """A tokenizer's refusal of ``structured_outputs.<kind>`` named after the request's own
    field ``path`` (``response_format.json_schema.schema``, ``guided_regex``, ...)."""
    if path is None or not (error.param or "").startswith("structured_outputs"):
        return error
    message = error.message
    if error.param and message.startswith(error.param):
        message = path + message[len(error.param):]
    return error.model_copy(update={"param": path.split(".")[0], "message": message})
