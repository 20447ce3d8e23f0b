"""Where the members of a JSON object begin and end in text that may stop half-way.

The tool-call parsers read calls (``{"name": ..., "arguments": {...}}``) out of a model's
text while it is still being generated. They need, at any point, the spans of the object's
members that are there so far: a member's value is complete (its end is known) or still
open. ``scan_object`` answers that with no JSON library, so that an open value is never
mistaken for an invalid one; ``json.loads`` then reads the complete values.

Only the structure is checked (strings, brackets, separators); a scalar's spelling (``tru``,
``1.2.3``) is left to ``json.loads`` on the complete value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"
_SCALAR_CHARS = frozenset("+-.0123456789eEtrufalsn")  # numbers, true, false, null


class NotJson(ValueError):
    """The text cannot be the start of the JSON value expected there; ``pos`` is the offset
    of the first character that cannot belong to it."""

    def __init__(self, pos: int) -> None:
        super().__init__(f"not JSON at offset {pos}")
        self.pos = pos


@dataclass
class Span:
    """A value's characters: ``text[start:end]``; ``end`` None while the value is still open
    (the text stops inside it)."""

    start: int
    end: int | None = None


@dataclass
class ObjectScan:
    """The members of one JSON object found so far.

    ``members`` maps each key that is complete to the span of its value (a key seen twice:
    the first); ``end`` is the offset after the closing brace, None while the object is open.
    """

    start: int
    members: dict[str, Span] = field(default_factory=dict)
    end: int | None = None


def skip_ws(text: str, pos: int) -> int:
    """The offset of the first non-whitespace character at or after ``pos`` (``len(text)`` if none)."""
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
    """The offset after the JSON string that starts at ``text[pos] == '"'``; None if the text
    stops inside it."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


@dataclass
class OpenContainer:
    """Where the scan of an open object or array stopped (to resume there once the text
    grows): the next offset, the closing brackets still owed, and whether it stopped inside
    a string (just after a backslash)."""

    pos: int
    closers: list[str]
    in_string: bool = False
    escaped: bool = False


#: start offset of a container -> where its scan stopped while open, or its end once closed
#: (for a text that only grows)
ScanMemo = dict[int, OpenContainer | int]


def value_end(text: str, pos: int, memo: ScanMemo | None = None) -> int | None:
    """The offset after the JSON value that starts at ``pos`` (a non-whitespace character);
    None if the text stops inside it. A scalar that reaches the end of the text is open (more
    digits may follow). With ``memo`` (kept by the caller while its text only grows), the scan
    of an open object or array resumes where the previous one stopped, and a closed one is
    not scanned again, so reading a growing text costs its new characters only.

    Raises:
        NotJson: the character at ``pos`` cannot start a value, or brackets do not match.
    """
    c = text[pos]
    if c == '"':
        return string_end(text, pos)
    if c in "{[":
        return _container_end(text, pos, memo)
    if c not in _SCALAR_CHARS:
        raise NotJson(pos)
    i = pos
    while i < len(text) and text[i] in _SCALAR_CHARS:
        i += 1
    return None if i == len(text) else i


def _container_end(text: str, pos: int, memo: ScanMemo | None) -> int | None:
    state = memo.get(pos) if memo is not None else None
    if isinstance(state, int):
        return state
    if state is None:
        state = OpenContainer(pos + 1, ["}" if text[pos] == "{" else "]"])
    i, closers, in_string, escaped = state.pos, state.closers, state.in_string, state.escaped
    while i < len(text):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            closers.append("}" if c == "{" else "]")
        elif c in "}]":
            if c != closers.pop():
                raise NotJson(i)
            if not closers:
                if memo is not None:
                    memo[pos] = i + 1
                return i + 1
        i += 1
    if memo is not None:
        memo[pos] = OpenContainer(i, closers, in_string, escaped)
    return None


def scan_object(text: str, pos: int, memo: ScanMemo | None = None) -> ObjectScan:
    """The members of the JSON object whose ``{`` is at ``text[pos]``, as far as the text goes
    (``memo``: as for ``value_end``, for its members' values).

    Raises:
        NotJson: the text is not the start of a JSON object there (the offending offset).
    """
    if pos >= len(text) or text[pos] != "{":
        raise NotJson(pos)
    scan = ObjectScan(start=pos)
    i = skip_ws(text, pos + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            raise NotJson(i)
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        key = _decode_key(text[i:key_end], i)
        i = skip_ws(text, key_end)
        if i == len(text):
            return scan
        if text[i] != ":":
            raise NotJson(i)
        i = skip_ws(text, i + 1)
        if i == len(text):
            return scan
        span = Span(i, value_end(text, i, memo))
        scan.members.setdefault(key, span)
        if span.end is None:
            return scan
        i = skip_ws(text, span.end)
        if i == len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            raise NotJson(i)
        i = skip_ws(text, i + 1)
    return scan


def _decode_key(raw: str, pos: int) -> str:
    try:
        return json.loads(raw)
    except ValueError:
        raise NotJson(pos) from None
