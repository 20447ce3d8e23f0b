"""Chat messages to prompt text: messages checked and normalised, the chat template chosen
(the request's, the server's ``--chat-template``, else the model's) and rendered with the
request's tools, as transformers' ``apply_chat_template(tools=...)`` passes them.

A template that never mentions ``tools`` cannot show them to the model (SmolLM2's own):
rendering goes on without them, as in vLLM, and the first such request per template is logged
(``tools_not_in_chat_template``); ``examples/tool_chat_template_smollm2.jinja`` is one that does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.tokenizer.errors import TokenizeError
from shared.logging import get_logger

log = get_logger(__name__)


def load_chat_template(value: str | None) -> str | None:
    """The text of a chat template given as a file path or as the template itself (not a file
    and it has ``{``); None stays None.

    Raises:
        ValueError: a path that is not a readable file (the message names it).
    """
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" in value and not (len(value) < 4096 and "\n" not in value and path.is_file()):
        return value
    try:
        return path.read_text()
    except OSError as exc:
        raise ValueError(f"chat_template: cannot read {value!r}: {exc.strerror or exc}") from None


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template, or with ``chat_template`` (its
    text) instead of the tokenizer's when given."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._warned: set[str] = set()

    def render(self, messages: Sequence[Any], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None, chat_template: str | None = None) -> str:
        """The prompt text of ``messages`` (``chat_template``: this request's template).

        Raises:
            TokenizeError: malformed messages, no chat template, or one that fails on them
                (param ``messages``).
        """
        conversation = normalize_messages(messages)
        template = chat_template or self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise TokenizeError("this model has no chat template: use the completions API with a prompt",
                                param="messages")
        if tools and "tools" not in template and template not in self._warned:
            self._warned.add(template)
            log.warning("tools_not_in_chat_template", hint="the chat template does not show tools to the model; "
                        "give one that does with --chat-template (examples/tool_chat_template_smollm2.jinja)")
        try:
            text = self.tokenizer.apply_chat_template(conversation, tools=tools or None, chat_template=template,
                                                      add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as e:  # jinja2 errors raised by the template (e.g. "roles must alternate")
            raise TokenizeError(f"the chat template rejected the messages: {e}", param="messages") from e
        if not isinstance(text, str):
            raise TokenizeError(f"the chat template rendered {type(text).__name__}, not a string", param="messages")
        return text


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Chat messages checked and reduced to ``{"role": str, "content": str, ...}``.

    ``content`` may be a string or a list of ``{"type": "text", "text": str}`` parts, joined
    with "\\n" as vLLM does; an assistant message may have ``content`` None (read as "").
    An assistant's ``tool_calls`` reach the template with each ``function.arguments`` as an
    object when it is a JSON object's text (templates expect a mapping, as vLLM gives them).
    Other keys (e.g. ``name``, ``tool_call_id``) are passed to the chat template unchanged.

    Raises:
        TokenizeError: the list is empty, or a message is malformed (param ``messages``; the
            message names the offending index).
    """
    if not messages:
        raise TokenizeError("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizeError(f"messages[{i}] must be an object with role and content", param="messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise TokenizeError(f"messages[{i}].role must be a non-empty string", param="messages")
        message = {**m, "role": role, "content": _content_text(i, role, m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(m["tool_calls"])]
        out.append(message)
    return out


def _content_text(i: int, role: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                raise TokenizeError(
                    f"messages[{i}].content[{j}]: only parts of type 'text' are supported, got {kind!r}",
                    param="messages",
                )
            if not isinstance(part.get("text"), str):
                raise TokenizeError(f"messages[{i}].content[{j}].text must be a string", param="messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise TokenizeError(
        f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}",
        param="messages",
    )


def _template_call(i: int, j: int, call: Any) -> dict[str, Any]:
    """A past tool call as templates take it: ``function.arguments`` an object when its text is one."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise TokenizeError(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"arguments\": ...}}", param="messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    return {**call, "function": {**function, "arguments": arguments}}
