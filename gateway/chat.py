"""``/v1/chat/completions``: a request's output as ``chat.completion.chunk``s and a
``chat.completion``, and the chat ``logprobs`` shape (no I/O; see ``gateway/generation.py``).

A stream starts with one chunk per choice carrying the assistant's role and empty content.
"""

from __future__ import annotations

from pydantic import BaseModel

from gateway.generation import Generation, token_str
from gateway.protocol.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    json_logprob,
)
from shared.messages import DecodedLogprobs, RequestDelta


class ChatGeneration(Generation):
    """One ``/v1/chat/completions`` request in flight."""

    def chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                            choices=choices)

    def start_chunks(self) -> list[BaseModel]:
        return [
            self.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(len(self.choices))
        ]

    def delta_chunks(self, delta: RequestDelta, index: int) -> list[BaseModel]:
        if not self.has_news(delta):
            return []
        c = self.choices[index]
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=delta.text or None),
            logprobs=chat_logprobs(delta.logprobs, self.tokens_as_ids) if self.logprobs else None,
            finish_reason=c.finish_reason if delta.finished else None,
            stop_reason=c.stop_reason if delta.finished else None,
        )
        return [self.chunk([choice])]

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=c.text),
                logprobs=chat_logprobs(c.logprobs, self.tokens_as_ids) if self.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(self.choices)
        ]
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )


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
