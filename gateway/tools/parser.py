"""``ToolParser``: tool calls read out of a model's text, as it streams and whole.

Each parser (one per output format: ``hermes.py``, ``llama3_json.py``, ``mistral.py``, and
``forced.py`` for the JSON that ``tool_choice`` ``required`` or a named function forces) only
says how its format splits the text so far into content and call drafts (``parse``). This
base turns successive parses into OpenAI's stream deltas: content as it becomes certain,
then per call a first delta with its ``id``, ``type`` and ``name`` (``arguments`` ""), then
the arguments' text as it comes. ``extract`` on a whole text is the same parser fed once, so
a streamed response adds up to exactly the non-streamed one, but for a call whose JSON turns
malformed after its first delta was sent: the stream cannot take that delta back, while
``extract`` returns the whole text as content.

The ``arguments`` string is the model's own text of the arguments' JSON value (spacing
included), as OpenAI's is; a JSON string holding the arguments is given as its content.
When no call could be read (no call marker, or JSON that is not a call), the whole text is
content, as vLLM's parsers do.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import ClassVar

from gateway.protocol.responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from gateway.tools.json_scan import NotJson, ScanMemo, scan_object, skip_ws


@dataclass
class CallDraft:
    """One call as far as the text goes: its name once its JSON string is complete, the
    text of its arguments so far (it only grows), and whether its object is closed."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class Parse:
    """What the text so far says: ``content`` (a prefix of the text, surely not part of a
    call; it only grows) and the calls that have begun, in order."""

    content: str
    calls: list[CallDraft] = field(default_factory=list)


@dataclass
class ToolDeltas:
    """What one ``feed`` adds: content text and tool-call deltas (OpenAI's stream shape)."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass
class ExtractedToolCalls:
    """A whole text read by a parser: ``content`` (None when calls were made and no other
    text was), the calls, and whether each call's JSON was closed (``complete``)."""

    content: str | None
    tool_calls: list[ToolCall]
    complete: bool = False


def new_call_id() -> str:
    """A tool call id as OpenAI's look: ``call_`` and 24 random hexadecimal digits."""
    return "call_" + secrets.token_hex(12)


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0  # characters of the draft's arguments already sent
    complete: bool = False  # its object is closed


class ToolParser:
    """Reads tool calls from one generated text, fed as it streams (one instance per choice).

    Subclasses give ``parse``; ``name`` is the ``--tool-call-parser`` value;
    ``skip_special_tokens`` False makes the gateway keep special tokens in the text (a format
    whose call marker is one).
    """

    name: ClassVar[str] = ""
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self) -> None:
        self.text = ""
        self.memo: ScanMemo = {}  # open arguments' scans, resumed at the next feed
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    @property
    def called(self) -> bool:
        """Whether a call has begun."""
        return bool(self._calls)

    @property
    def calls_complete(self) -> bool:
        """Whether calls were made and each one's JSON is closed (none was cut short)."""
        return bool(self._calls) and all(call.complete for call in self._calls)

    def parse(self, text: str, final: bool) -> Parse:
        """Split ``text`` (all generated so far; ``final``: all there will be) into content and
        call drafts. Successive parses of a growing text must only grow ``content`` and each
        draft's ``arguments``."""
        raise NotImplementedError

    def feed(self, delta: str) -> ToolDeltas:
        """Add the next piece of generated text; what it makes certain."""
        self.text += delta
        return self._diff(self.parse(self.text, final=False))

    def finish(self) -> ToolDeltas:
        """The text is complete: what remains (without any call, all unsent text is content)."""
        out = self._diff(self.parse(self.text, final=True))
        if not self._calls and self._content_sent < len(self.text):
            out.content += self.text[self._content_sent:]
            self._content_sent = len(self.text)
        return out

    @classmethod
    def extract(cls, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole text (the same as streaming it: ``feed`` + ``finish``)."""
        parser = cls()
        parts = [parser.feed(text), parser.finish()]
        content = "".join(p.content for p in parts)
        calls: list[ToolCall] = []
        for delta in (d for p in parts for d in p.tool_calls):
            if delta.id is not None:
                calls.append(ToolCall(id=delta.id, function=FunctionCall(name=delta.function.name or "",
                                                                         arguments="")))
            calls[delta.index].function.arguments += delta.function.arguments or ""
        if calls and not content.strip():
            return ExtractedToolCalls(None, calls, parser.calls_complete)
        return ExtractedToolCalls(content, calls, parser.calls_complete)

    def _diff(self, parse: Parse) -> ToolDeltas:
        out = ToolDeltas(content=parse.content[self._content_sent:])
        self._content_sent = max(self._content_sent, len(parse.content))
        for index, call in enumerate(parse.calls):
            if call.name is None:  # calls begin in order: a later one waits for this name
                break
            if index == len(self._calls):
                self._calls.append(_SentCall(new_call_id()))
                out.tool_calls.append(DeltaToolCall(index=index, id=self._calls[index].id, type="function",
                                                    function=DeltaFunctionCall(name=call.name, arguments="")))
            sent = self._calls[index]
            sent.complete = call.complete
            if len(call.arguments) > sent.arguments_sent:
                out.tool_calls.append(DeltaToolCall(
                    index=index, function=DeltaFunctionCall(arguments=call.arguments[sent.arguments_sent:])))
                sent.arguments_sent = len(call.arguments)
        return out


# ---------------------------------------------------------------- helpers for the formats


def held_back(text: str, marker: str) -> str:
    """``text`` less what may still become ``marker`` (a suffix that begins it) and less
    trailing whitespace (sent once more text follows it): the part that is surely content."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            text = text[:-k]
            break
    return text.rstrip()


def read_call(text: str, pos: int, argument_keys: tuple[str, ...],
              memo: ScanMemo | None = None) -> tuple[CallDraft, int | None]:
    """The call object whose ``{`` is at ``pos`` (``{"name": ..., <argument key>: ...}``) as far
    as the text goes, and the offset after it (None while open). A missing argument key reads
    as ``{}`` once the object closes. ``memo``: the parser's, so that open arguments are not
    scanned again from their start (``json_scan.value_end``).

    Raises:
        NotJson: not a call object (not JSON, a name that is not a string, or closed without a name).
    """
    scan = scan_object(text, pos, memo)
    name = None
    if (span := scan.members.get("name")) is not None and span.end is not None:
        name = _loads(text, span.start, span.end)
        if not isinstance(name, str):
            raise NotJson(span.start)
    if scan.end is not None and name is None:
        raise NotJson(pos)
    arguments = ""
    span = next((scan.members[k] for k in argument_keys if k in scan.members), None)
    if span is not None:
        if text[span.start] in "{[":  # everything so far is the open container's
            arguments = text[span.start:span.end if span.end is not None else len(text)]
        elif span.end is not None:
            value = _loads(text, span.start, span.end)
            arguments = value if isinstance(value, str) else text[span.start:span.end]
    elif scan.end is not None:
        arguments = "{}"
    return CallDraft(name, arguments, scan.end is not None), scan.end


def read_call_list(text: str, pos: int, argument_keys: tuple[str, ...],
                   memo: ScanMemo | None = None) -> list[CallDraft]:
    """The calls of the JSON array whose ``[`` is at ``pos``, as far as the text goes (a
    malformed element ends the list there)."""
    calls: list[CallDraft] = []
    i = skip_ws(text, pos + 1)
    while i < len(text) and text[i] == "{":
        try:
            call, end = read_call(text, i, argument_keys, memo)
        except NotJson:
            break
        calls.append(call)
        if end is None:
            break
        i = skip_ws(text, end)
        if i >= len(text) or text[i] != ",":
            break
        i = skip_ws(text, i + 1)
    return calls


def _loads(text: str, start: int, end: int) -> object:
    try:
        return json.loads(text[start:end])
    except ValueError:
        raise NotJson(start) from None
