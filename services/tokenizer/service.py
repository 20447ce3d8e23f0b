"""The tokenizer service: prompt or chat messages -> token ids, validated, submitted.

recv ``TokenizeRequest`` (request/reply, queue group ``TOKENIZER_QUEUE``, so replicas share
the load) -> tokenize (chat template for ``messages``) -> validate against
``max_model_len`` -> publish ``SubmitRequest`` (the request's ``RequestSpec`` forwarded as it came,
and its token ids) to the scheduler FIRST -> reply
``TokenizeReply`` (the token ids, or a ``ServiceError`` the gateway returns as HTTP 400).
Because the submit goes out before the reply on the same connection, a gateway that got
the reply never races the scheduler's first output for that request.
"""

from __future__ import annotations

import asyncio
import copy
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import nats.errors

from services.tokenizer.chat import ChatRenderer, load_chat_template
from services.tokenizer.errors import TokenizeError
from shared.bus import Bus
from shared.config import Settings
from shared.logging import get_logger
from shared.messages import (
    RequestSpec,
    ServiceError,
    StructuredOutputsParams,
    SubmitRequest,
    TokenizeReply,
    TokenizeRequest,
)
from shared.model_source import ModelInfo, load_tokenizer
from shared.service import BusService
from shared.structured_output import StructuredOutputBackend, StructuredOutputError, shared_backend
from shared.subjects import TOKENIZER_QUEUE

log = get_logger(__name__)


#: bytes of one prompt token's log probabilities in a RequestDelta: (base, per alternative);
#: measured 73 and ~64 (msgpack, short token texts, token bytes as int lists; less now that they travel
#: as bin), with room for longer texts
PROMPT_LOGPROB_BYTES = (120, 96)


class TokenizerService(BusService):
    """Tokenizes and validates requests, then submits them to the scheduler.

    Args:
        settings: engine settings (``nats_url`` is used when ``bus`` is None).
        model_info: the served model; its ``path`` holds the Hugging Face tokenizer.
        bus: a connected bus to share; None = connect to ``settings.nats_url`` in ``start()``
            (and close it in ``stop()``).
        tokenizer: an already loaded tokenizer (tests); None = ``AutoTokenizer.from_pretrained``.

    Tokenization runs on one worker thread (HF tokenizers must not be called from two
    threads at once), so a long prompt never blocks the event loop. A structured output's
    validation compile runs on a thread of its own, awaited by its request only, so a slow
    schema holds up no other request's tokenization. Replicas share the requests (queue
    group ``TOKENIZER_QUEUE``).
    """

    name = "tokenizer"

    def __init__(
        self, settings: Settings, model_info: ModelInfo, bus: Bus | None = None, tokenizer: Any = None
    ) -> None:
        super().__init__(settings, model_info, bus)
        self.tokenizer = tokenizer
        self._chat: ChatRenderer | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-grammar")
        self._structured: StructuredOutputBackend | None = None  # made at the first constraint

    async def load(self) -> None:
        """Load the tokenizer (unless given) and the ``chat_template`` setting's template.

        Raises:
            ValueError: the ``chat_template`` file cannot be read.
        """
        if self.tokenizer is None:
            self.tokenizer = await load_tokenizer(self.model_info.path)
        _ = self.chat  # a chat_template that cannot be read stops the service now

    @property
    def chat(self) -> ChatRenderer:
        """The renderer of chat messages (the ``chat_template`` setting's template, else the model's)."""
        if self._chat is None or self._chat.tokenizer is not self.tokenizer:
            self._chat = ChatRenderer(self.tokenizer, load_chat_template(self.settings.chat_template))
        return self._chat

    async def serve(self) -> None:
        await self.subscribe(self.subjects.tokenize, TokenizeRequest, self.handle, queue=TOKENIZER_QUEUE)

    async def start(self) -> None:
        """Load the tokenizer, connect (if needed) and serve the tokenize subject.

        Raises:
            ValueError: no bus was given and ``settings.nats_url`` is None.
        """
        await super().start()
        log.info("tokenizer_started", model=self.model_info.name, subject=self.subjects.tokenize)

    async def stop(self) -> None:
        """Drain the subscription, close an owned connection, stop the worker thread."""
        await super().stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)

    async def handle(self, request: TokenizeRequest) -> TokenizeReply:
        """Answer one ``TokenizeRequest``; on success publish its ``SubmitRequest`` first."""
        t0 = time.perf_counter()
        kind = "chat" if request.messages is not None else "completion"
        spec = request.spec
        try:
            loop = asyncio.get_running_loop()
            ids, prompt_text = await loop.run_in_executor(self._executor, self.tokenize, request)
            if spec.sampling_params.structured_outputs is not None:
                await self.check_structured_outputs(spec.sampling_params.structured_outputs)
        except TokenizeError as e:
            log.info("tokenize_rejected", request_id=spec.request_id, kind=kind,
                     param=e.error.param, reason=e.error.message)
            return TokenizeReply(error=e.error)
        except Exception as e:  # a bug or a broken tokenizer: answer rather than let the gateway hang
            log.exception("tokenize_failed", request_id=spec.request_id)
            error = ServiceError(message=f"tokenization failed: {e}", type="internal_server_error", status=500)
            return TokenizeReply(error=error)
        assert self.bus is not None
        try:
            await self.bus.publish(self.subjects.submit,
                                   SubmitRequest(spec=self._submitted_spec(request, len(ids)), prompt_token_ids=ids))
        except nats.errors.MaxPayloadError:  # not sent: refuse it rather than leave the client waiting
            error = ServiceError(message=f"the request's {len(ids)} prompt tokens are more than one NATS message "
                                         f"may carry here ({self.bus.nc.max_payload} bytes: the NATS server's "
                                         "max_payload)", param="messages" if kind == "chat" else "prompt",
                                 code="request_too_large", status=413)
            return TokenizeReply(error=error)
        log.info("tokenized", request_id=spec.request_id, kind=kind, num_prompt_tokens=len(ids),
                 max_tokens=spec.sampling_params.max_tokens, ms=round((time.perf_counter() - t0) * 1e3, 2))
        return TokenizeReply(prompt_token_ids=ids,
                             prompt=prompt_text if request.return_prompt else None)

    # ------------------------------------------------------------------ no I/O below

    def tokenize(self, request: TokenizeRequest) -> tuple[list[int], str | None]:
        """The request's prompt token ids, checked against ``max_model_len``, and for
        ``messages`` the prompt text the chat template rendered (for a ``prompt`` with
        ``return_prompt``, its text; else None).

        ``messages`` go through the chat template (``add_generation_prompt`` as asked; the
        text is tokenized without adding special tokens, as ``apply_chat_template`` and vLLM
        do); a string ``prompt`` is tokenized like ``tokenizer(prompt)`` (default special
        tokens); a ``list[int]`` prompt is used as given. With ``return_prompt``, a
        completion's prompt text is returned too (token ids decoded, special tokens kept).

        Raises:
            TokenizeError: empty or malformed input, token ids (of the prompt or of
                ``logit_bias``) outside ``[0, vocab_size)``,
                no chat template, or too long for ``max_model_len`` (the error
                names the parameter: ``prompt``, ``messages`` or ``max_tokens``; with
                ``cap_at_max_model_len`` only a prompt that leaves no room for one token).
        """
        if request.messages is not None and request.prompt is not None:
            raise TokenizeError("give either prompt or messages, not both", param="messages")
        vocab = self.model_info.vocab_size
        params = request.spec.sampling_params
        if bad := [t for t in params.logit_bias if t >= vocab]:
            raise TokenizeError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                param="logit_bias")
        prompt_text = None
        if request.messages is not None:
            param = "messages"
            prompt_text = self.chat.render(request.messages, request.add_generation_prompt, request.tools,
                                           request.chat_template)
            ids = [int(t) for t in self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]]
        elif request.prompt is None:
            raise TokenizeError("the request has neither a prompt nor messages", param="prompt")
        else:
            param = "prompt"
            ids = self._tokenize_prompt(request.prompt)
            if request.return_prompt:  # the text the ids stand for (completions' echo)
                prompt_text = (request.prompt if isinstance(request.prompt, str)
                               else self.tokenizer.decode(ids, skip_special_tokens=False))
        if not ids:
            raise TokenizeError(f"the {param} is empty: it must hold at least one token", param=param)
        max_tokens = None if request.cap_at_max_model_len else params.max_tokens
        self._check_length(len(ids), max_tokens, param)
        self._check_prompt_logprobs_size(len(ids), params.prompt_logprobs)
        return ids, prompt_text

    async def check_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's structured output constraint (cached) on the compile thread, so
        that a schema, regex or grammar that no backend takes is refused now, naming the field,
        rather than fail in the executor; the executor's compile of the same spec then succeeds.

        The backend is made once, on the tokenizer thread, with a copy of the tokenizer: the
        compile thread reads that copy while the tokenizer thread tokenizes with the original.

        Raises:
            TokenizeError: no backend compiles ``spec`` (``param``: ``structured_outputs.<kind>``).
        """
        loop = asyncio.get_running_loop()
        if self._structured is None:
            info = self.model_info
            self._structured = await loop.run_in_executor(
                self._executor, shared_backend, info.path, info.vocab_size, info.eos_token_ids,
                lambda: copy.deepcopy(self.tokenizer))
        try:
            await loop.run_in_executor(self._compile_pool, self._structured.compile, spec)
        except StructuredOutputError as e:
            raise TokenizeError(str(e), param=e.param) from None

    def _check_prompt_logprobs_size(self, num_prompt: int, num_top: int | None) -> None:
        """A prompt's log probabilities travel in one message to the detokenizer and one to
        the gateway: refuse a request whose would not fit the NATS server's ``max_payload``
        (``PROMPT_LOGPROB_BYTES`` per token and per alternative, an upper estimate)."""
        if num_top is None or self.bus is None:
            return
        size = num_prompt * (PROMPT_LOGPROB_BYTES[0] + PROMPT_LOGPROB_BYTES[1] * num_top)
        limit = self.bus.nc.max_payload
        if size > limit:
            raise TokenizeError(
                f"the log probabilities of {num_prompt} prompt tokens with {num_top} alternatives each (about "
                f"{size} bytes) are more than one NATS message may carry here ({limit} bytes: the NATS "
                "server's max_payload); ask for fewer alternatives or send a shorter prompt",
                param="logprobs", code="request_too_large")

    def _tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise TokenizeError("the prompt is empty", param="prompt")
            return [int(t) for t in self.tokenizer(prompt)["input_ids"]]
        vocab = self.model_info.vocab_size
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab:
                raise TokenizeError(f"prompt[{i}]: token id {t} is outside the vocabulary [0, {vocab})",
                                    param="prompt")
        return list(prompt)

    def _submitted_spec(self, request: TokenizeRequest, num_prompt: int) -> RequestSpec:
        """The request's spec for the scheduler, as the gateway built it; but with
        ``cap_at_max_model_len``, a ``max_tokens`` beyond ``max_model_len`` becomes None
        (generate up to the context length, finish_reason "length"; the scheduler also caps
        that to its KV cache pool)."""
        spec = request.spec
        params = spec.sampling_params
        if (request.cap_at_max_model_len and params.max_tokens is not None
                and num_prompt + params.max_tokens > self.model_info.max_model_len):
            return spec.derive(sampling_params=params.replace(max_tokens=None))
        return spec

    def _check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        limit = self.model_info.max_model_len
        where = "messages" if param == "messages" else "prompt"
        if num_prompt >= limit:
            raise TokenizeError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt} tokens in the {where}, which leaves no room for the completion. "
                f"Please reduce the length of the {where}.",
                param=param, code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise TokenizeError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {where}, {max_tokens} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                param="max_tokens", code="context_length_exceeded",
            )

