"""``/v1/chat/completions``: a request's output as ``chat.completion.chunk``s and a
``chat.completion``, and the chat ``logprobs`` shape (no I/O; see ``gateway/generation.py``).

A stream starts with one chunk per choice carrying the assistant's role and empty content.
With tools (``gateway/tools/``), each choice's text goes through its own ``ToolParser``: the
content it is sure of and the calls as OpenAI streams them (a call's first delta with its
``id``, ``type`` and ``name``, then its ``arguments`` in pieces; no chunk names one call
twice). A choice that made calls ends with finish_reason "tool_calls" (a named function
forced: "stop", as OpenAI and vLLM), unless a call was cut short ("length").
"""

from __future__ import annotations

from pydantic import BaseModel

from gateway.generation import Generation, SampleState, token_str
from gateway.protocol.requests import ChatCompletionRequest
from gateway.protocol.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    DeltaToolCall,
    TopLogprob,
    json_logprob,
)
from gateway.tools import ToolDeltas
from gateway.tools.choice import NO_TOOLS, ToolUse
from shared.messages import DecodedLogprobs, RequestDelta, TokenizeReply


class ChatGeneration(Generation):
    """One ``/v1/chat/completions`` request in flight; ``tools``: how it uses its tools."""

    def __init__(self, request_id: str, model: str, body: ChatCompletionRequest,
                 prompts: list[tuple[str, TokenizeReply]], tools: ToolUse = NO_TOOLS) -> None:
        super().__init__(request_id, model, body, prompts)
        self.tools = tools
        self._parsers = [tools.parser() for _ in self.choices] if tools.parser is not None else None

    def finish_reason(self, c: SampleState, called: bool, complete: bool) -> str | None:
        """The choice's finish_reason: "tool_calls" when it made calls (not for a named
        function, as OpenAI) and stopped by itself, or reached its token limit after closing
        every call (text after them is dropped); else the engine's."""
        if called and not self.tools.named and (c.finish_reason == "stop"
                                                or (c.finish_reason == "length" and complete)):
            return "tool_calls"
        return c.finish_reason

    def chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                            choices=choices)

    def start_chunks(self) -> list[BaseModel]:
        return [
            self.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(len(self.choices))
        ]

    def delta_chunks(self, delta: RequestDelta, index: int) -> list[BaseModel]:
        if self._parsers is None:
            found = ToolDeltas(content=delta.text)
            called = complete = False
        else:
            parser = self._parsers[index]
            found = parser.feed(delta.text)
            if delta.finished:
                rest = parser.finish()
                found.content += rest.content
                found.tool_calls += rest.tool_calls
            called, complete = parser.called, parser.calls_complete
        if not (found.content or found.tool_calls or delta.finished or (self.logprobs and delta.logprobs)):
            return []
        c = self.choices[index]
        choices = [ChatStreamChoice(index=index, delta=DeltaMessage(content=None if k else found.content or None,
                                                                    tool_calls=calls or None))
                   for k, calls in enumerate(_calls_per_chunk(found.tool_calls))]
        if self.logprobs:
            choices[0].logprobs = chat_logprobs(delta.logprobs, self.tokens_as_ids)
        if delta.finished:
            choices[-1].finish_reason = self.finish_reason(c, called, complete)
            choices[-1].stop_reason = c.stop_reason
        return [self.chunk([choice]) for choice in choices]

    def response(self) -> ChatCompletionResponse:
        choices = []
        for i, c in enumerate(self.choices):
            message, complete = AssistantMessage(content=c.text), False
            if self.tools.parser is not None:
                found = self.tools.parser.extract(c.text)
                message = AssistantMessage(content=found.content, tool_calls=found.tool_calls)
                complete = found.complete
            choices.append(ChatChoice(
                index=i,
                message=message,
                logprobs=chat_logprobs(c.logprobs, self.tokens_as_ids) if self.logprobs else None,
                finish_reason=self.finish_reason(c, bool(message.tool_calls), complete),
                stop_reason=c.stop_reason,
            ))
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )


def _calls_per_chunk(calls: list[DeltaToolCall]) -> list[list[DeltaToolCall]]:
    """``calls`` in order, split so that no chunk holds two deltas of one call (a call's
    first delta and its arguments go in chunks of their own); at least one (maybe empty) list."""
    groups: list[list[DeltaToolCall]] = [[]]
    for call in calls:
        if any(c.index == call.index for c in groups[-1]):
            groups.append([])
        groups[-1].append(call)
    return groups


def chat_logprobs(items: list[DecodedLogprobs], as_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat ``logprobs`` of ``items``: per token its text (or ``token_id:<id>``,
    ``as_ids``), bytes and log probability, with the ``top_logprobs`` most likely tokens'."""
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=token_str(lp.sampled, as_ids), logprob=json_logprob(lp.sampled.logprob),  # type: ignore[arg-type]
            bytes=list(lp.sampled.bytes),
            top_logprobs=[TopLogprob(token=token_str(t, as_ids), logprob=json_logprob(t.logprob),  # type: ignore[arg-type]
                                     bytes=list(t.bytes))
                          for t in lp.top],
        )
        for lp in items
    ])
