"""``/v1/completions``: a request's output as ``text_completion`` chunks and response, and the
legacy ``logprobs`` shape (no I/O; see ``gateway/generation.py``).

``echo`` starts each choice with its prompt. With ``logprobs`` too, the prompt tokens' log
probabilities come first, and ``text_offset`` runs on over the echoed text. The engine
sends them with sample 0's first delta. A stream therefore holds back the echo, and any
delta of another sample that comes before them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from gateway.generation import Generation, token_str, tokens_text_len
from gateway.protocol.requests import CompletionRequest
from gateway.protocol.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    json_logprob,
)
from shared.messages import DecodedLogprobs, RequestDelta, TokenizeReply


@dataclass
class _EchoStream:
    """How far one choice's echo has streamed."""

    sent: bool = False  # its prompt was streamed
    # with logprobs: its deltas (and their first text_offset past the prompt) that came
    # before the prompt's log probabilities (sample 0's first delta), sent after them
    held: list[tuple[RequestDelta, int]] = field(default_factory=list)


class CompletionGeneration(Generation):
    """One ``/v1/completions`` request in flight (one engine request per prompt of a batch)."""

    def __init__(self, request_id: str, model: str, body: CompletionRequest,
                 prompts: list[tuple[str, TokenizeReply]]) -> None:
        super().__init__(request_id, model, body, prompts)
        self.echo_only = body.echo_only  # echo with max_tokens 0
        self._echo = [_EchoStream() for _ in self.choices]

    def echo(self, index: int) -> str:
        """The prompt text choice ``index`` starts with (with ``echo``; else "")."""
        return self.parts[index // self.n].echo

    def chunk(self, choices: list[CompletionChoice]) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model, choices=choices)

    def start_chunks(self) -> list[BaseModel]:
        """The echoed prompts; with logprobs they wait for the prompt's (in the first delta)."""
        if self.logprobs:
            return []
        for echo in self._echo:
            echo.sent = True
        return [self.chunk([CompletionChoice(index=i, text=self.echo(i))])
                for i in range(len(self.choices)) if self.echo(i)]

    def delta_chunks(self, delta: RequestDelta, index: int) -> list[BaseModel]:
        p = index // self.n
        part = self.parts[p]
        offset = self.choices[index].tokens_text_len - tokens_text_len(delta.logprobs)  # its first token's
        if self.logprobs and part.echo and part.prompt_logprobs is None:  # a sample > 0 came first
            self._echo[index].held.append((delta, offset))
            return []
        chunks: list[BaseModel] = []
        for i in range(p * self.n, (p + 1) * self.n):  # those that waited for the prompt's
            waiting, self._echo[i].held = self._echo[i].held, []
            for d, held_offset in waiting:
                chunks += self._choice_chunks(d, i, held_offset)
        return chunks + self._choice_chunks(delta, index, offset)

    def _choice_chunks(self, delta: RequestDelta, index: int, offset: int) -> list[BaseModel]:
        """The chunks of one delta of choice ``index`` (whose first token's text_offset past
        the prompt is ``offset``): the echo first, once."""
        c, part = self.choices[index], self.parts[index // self.n]
        chunks: list[BaseModel] = []
        if not self._echo[index].sent:
            self._echo[index].sent = True
            if part.echo:
                chunks.append(self.chunk([CompletionChoice(
                    index=index, text=part.echo,
                    logprobs=completion_logprobs(part.prompt_logprobs or [], 0, self.tokens_as_ids))]))
        if self.echo_only:
            news = delta.finished
            text, logprobs = "", None
        else:
            news = self.has_news(delta)
            text = delta.text
            logprobs = (completion_logprobs(delta.logprobs, part.prompt_text_len + offset, self.tokens_as_ids)
                        if self.logprobs else None)
        if news:
            chunks.append(self.chunk([CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason if delta.finished else None,
                stop_reason=c.stop_reason if delta.finished else None,
            )]))
        return chunks

    def response(self) -> CompletionResponse:
        choices = [
            CompletionChoice(index=i, text=self.echo(i) + c.text, finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason,
                             logprobs=completion_logprobs([*(self.parts[i // self.n].prompt_logprobs or ()),
                                                           *c.logprobs], 0, self.tokens_as_ids)
                             if self.logprobs else None)
            for i, c in enumerate(self.choices)
        ]
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )


def completion_logprobs(items: list[DecodedLogprobs], offset: int, as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's completion ``logprobs`` of ``items``: per token its text, its offset (from
    ``offset``, adding each token's text length, as vLLM), its log probability, and the sampled
    and most likely tokens' log probabilities by text (None for the first prompt token of an
    echo). Where tokens share a text (parts of characters all read U+FFFD) the largest log
    probability is kept, as in vLLM, so the entry's maximum is the true one;
    ``return_tokens_as_token_ids`` (``as_ids``) keeps them apart."""
    out = CompletionLogprobs()
    for lp in items:
        sampled = lp.sampled
        out.text_offset.append(offset)
        offset += len(sampled.token)
        out.tokens.append(token_str(sampled, as_ids))
        if sampled.logprob is None:  # the first prompt token (echo): nothing before it
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(json_logprob(sampled.logprob))
        top: dict[str, float] = {}
        for t in (sampled, *lp.top):
            key, value = token_str(t, as_ids), json_logprob(t.logprob)  # type: ignore[arg-type]
            if key not in top or value > top[key]:
                top[key] = value
        out.top_logprobs.append(top)
    return out
