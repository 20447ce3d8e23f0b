"""The offline API: ``LLM(...).generate(prompts, sampling_params)``.

It runs the same services as ``pagedllm serve`` (tokenizer, scheduler, executor,
detokenizer) on an embedded NATS server, in one background event loop of this process, and
talks to them through ``shared.engine_client.EngineClient`` over the same subjects. Each
request's deltas are folded by the gateway's ``RequestState`` (``gateway/generation.py``),
then given vLLM's ``RequestOutput`` shape.
"""

from __future__ import annotations

import asyncio
import atexit
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError
from tqdm.auto import tqdm

from gateway.generation import RequestState
from gateway.protocol.tools import ChatTool
from pagedllm.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedllm.launcher import InProcessServices, pinned_settings
from pagedllm.outputs import RequestOutput, request_output
from pagedllm.sampling_params import BeamSearchParams
from services.tokenizer.chat import load_chat_template
from shared.bus import Bus
from shared.config import Settings
from shared.engine_client import EngineClient
from shared.logging import configure_logging
from shared.messages import SamplingParams, SchedulerStats, StatsQuery
from shared.model_source import load_model_info
from shared.nats_server import EmbeddedNats
from shared.pings import wait_engine_ready
from shared.subjects import Subjects

ENGINE_SERVICES = ("scheduler", "tokenizer", "detokenizer", "executor")
_TOOLS = TypeAdapter(list[ChatTool])
PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An offline engine.

    Args:
        model: a local Hugging Face model directory; ``None`` = the bundled SmolLM2.
        dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.
        **kwargs: any engine setting of :class:`shared.config.Settings` by its vLLM name
            (``max_model_len``, ``block_size``, ``num_gpu_blocks_override``, ...); with
            ``nats_url`` (and its credentials, or ``nats_creds``) the services run on that NATS
            server instead of an embedded one.

    Raises:
        ValueError: an invalid setting (the message names it) or a model that is not available.
        shared.bus.NatsAuthorizationError: the NATS server of ``nats_url`` refused the credentials.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", **kwargs: Any) -> None:
        settings = Settings(model=model, dtype=dtype, **kwargs)
        configure_logging(kwargs.get("log_level", "WARNING") if "log_level" in kwargs else "WARNING")
        self.model_info = load_model_info(settings)
        self._nats: EmbeddedNats | None = None
        url = settings.nats_url
        if not url:
            self._nats = EmbeddedNats().start()
            url = self._nats.url
        self.settings = pinned_settings(settings, self.model_info, url)
        self.subjects = Subjects(self.model_info.name)
        self._services = InProcessServices(self.settings, self.model_info, ENGINE_SERVICES)
        self._closed = False
        try:
            self._services.start()
            self._bus, self._client = self._services.run(self._connect_client())
            self._services.run(wait_engine_ready(self._bus, self.model_info.name,
                                                 self.settings.num_detokenizer_shards, timeout=300))
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    async def _connect_client(self) -> tuple[Bus, EngineClient]:
        bus = await Bus.connect(self.settings.nats_url, name="llm", creds=self.settings.nats_creds)
        client = EngineClient(bus, self.model_info.name)
        await client.start()
        return bus, client

    def stats(self) -> SchedulerStats:
        """The scheduler's statistics (running, waiting, free blocks per group)."""
        return self._services.run(self._bus.request(self.subjects.stats_get, StatsQuery(), SchedulerStats, 10))

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; results come back in input order.

        Args:
            prompts: a string, a list of token ids, a ``{"prompt": ...}`` /
                ``{"prompt_token_ids": [...]}`` dict, or a list of these.
            sampling_params: one for all prompts, or one per prompt (default: vLLM's).
            priority: one value per prompt (lower first) for ``scheduling_policy="priority"``.

        A prompt + ``max_tokens`` over ``max_model_len`` stops at ``max_model_len`` with
        finish_reason "length" (as vLLM's ``LLM``; the OpenAI server refuses it instead).

        Raises:
            ValueError: a prompt is rejected (empty, ``max_model_len`` tokens or more, token ids
                outside the vocabulary); nothing of the call is generated then.
        """
        items = self._normalize_prompts(prompts)
        return self._run([{"prompt": p} for p in items], sampling_params, use_tqdm, priority)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's ``LLM.beam_search``); results in input order,
        each with its ``beam_width`` best beams, best first.

        The search runs in the engine: the prompt is prefilled once, every live beam is one
        decode row per step, and the beams share their prompt and common-prefix blocks
        (``services/scheduler/beam.py`` has the selection rule and the length convention).

        Args:
            prompts: as for :meth:`generate` (strings, token-id lists, ``{"prompt": ...}`` or
                ``{"prompt_token_ids": [...]}``).
            params: a ``BeamSearchParams``.

        Raises:
            TypeError: ``params`` is not a ``BeamSearchParams``.
            ValueError: a prompt is rejected, as for :meth:`generate`.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        items = self._normalize_prompts(prompts)
        outputs = self._run([{"prompt": p} for p in items], params.sampling_params(), use_tqdm, None)
        return [
            BeamSearchOutput(sequences=[
                BeamSearchSequence(tokens=[*out.prompt_token_ids, *c.token_ids], logprobs=c.logprobs or [],
                                   cum_logprob=c.cumulative_logprob or 0.0, text=c.text,
                                   finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                for c in out.outputs])
            for out in outputs
        ]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (chat template applied;
        ``RequestOutput.prompt`` is the prompt text it rendered).

        Args:
            chat_template: a Jinja chat template (a file path or the template's text) used
                instead of the engine's (``LLM(chat_template=...)``, else the model's).
            tools: OpenAI function tools (``{"type": "function", "function": {"name", "description",
                "parameters"}}``) for the chat template to show the model, as vLLM's ``LLM.chat``:
                the reply is text; calls in it are not parsed here.

        Raises:
            ValueError: malformed ``tools``, an unreadable ``chat_template`` file, or messages
                the template refuses (the message names the parameter).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = load_chat_template(chat_template)
        tool_dicts = None
        if tools is not None:
            try:
                tool_dicts = [tool.template_dict() for tool in _TOOLS.validate_python(tools)]
            except ValidationError as exc:
                raise ValueError(f"tools: {exc.errors()[0]['msg']} at {list(exc.errors()[0]['loc'])}") from None
        items = [{"messages": list(c), "add_generation_prompt": add_generation_prompt, "tools": tool_dicts,
                  "chat_template": template} for c in conversations]
        return self._run(items, sampling_params, use_tqdm, None)

    @staticmethod
    def _normalize_prompts(prompts: Any) -> list[str | list[int]]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        elif isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        out: list[str | list[int]] = []
        for p in prompts:
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            if not isinstance(p, str | list):
                raise ValueError(f"prompts: expected a string or a list of token ids, got {type(p).__name__}")
            out.append(p)
        return out

    def _run(self, items: list[dict], sampling_params: Any, use_tqdm: bool, priority: Any) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("this LLM is closed")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(items) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError(f"sampling_params: got {len(params)} for {len(items)} prompts")
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority: got {len(priority)} values for {len(items)} prompts")
        bar = tqdm(total=len(items), desc="Generating", disable=not use_tqdm or len(items) < 2)
        try:
            return self._services.run(self._generate_all(items, params, priority, bar))
        finally:
            bar.close()

    async def _generate_all(self, items, params, priority, bar) -> list[RequestOutput]:
        ids = [f"llm-{uuid.uuid4().hex}" for _ in items]
        try:
            # all submitted at once, in input order (tasks start in creation order)
            replies = await asyncio.gather(*(
                self._client.submit(rid, sampling_params=sp, priority=priority[i] if priority else 0,
                                   cap_at_max_model_len=True, return_prompt="messages" in item, **item)
                for i, (rid, item, sp) in enumerate(zip(ids, items, params, strict=True))
            ))
            for reply in replies:
                if reply.error is not None:
                    raise ValueError(reply.error.message)
            states = [RequestState.new(sp.n) for sp in params]

            async def collect(rid: str, state: RequestState) -> None:
                async for delta in self._client.stream(rid):
                    if delta.error is not None:
                        raise ValueError(delta.error.message)
                    state.add(delta)
                bar.update(1)

            await asyncio.gather(*(collect(rid, state) for rid, state in zip(ids, states, strict=True)))
        except BaseException:
            await self._client.abort(ids)
            raise
        outputs = []
        for rid, state, item, sp, reply in zip(ids, states, items, params, replies, strict=True):
            prompt = item.get("prompt")
            # chat: the rendered text; token ids: None, as vLLM's LLM
            text = reply.prompt if "messages" in item else prompt if isinstance(prompt, str) else None
            outputs.append(request_output(rid, state, text, list(reply.prompt_token_ids),
                                          sp.logprobs is not None or sp.use_beam_search))
        return outputs

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def _shutdown(services: InProcessServices, nats_server: EmbeddedNats | None) -> None:
        services.stop()
        if nats_server is not None:
            nats_server.stop()

    def close(self) -> None:
        """Stop the services and the embedded NATS server (idempotent)."""
        if self._closed:
            return
        self._closed = True
        client = getattr(self, "_client", None)
        if client is not None:  # ends its liveness watch and any stream still open
            try:
                self._services.run(client.stop(), timeout=10)
            except Exception:
                pass
        bus = getattr(self, "_bus", None)
        if bus is not None:
            try:
                self._services.run(bus.close(), timeout=10)
            except Exception:
                pass
        LLM._shutdown(self._services, self._nats)
        atexit.unregister(self.close)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

