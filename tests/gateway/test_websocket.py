"""The WebSocket protocol (``/v1/stream``, ``gateway/websocket.py``) against a real
nats-server and the fake backend (the ``gw`` fixture in ``conftest.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway_fakes import FULL, PROMPT
from websockets.asyncio.client import connect as ws_connect


async def test_websocket_two_concurrent_requests(gw):
    async with ws_connect(f"ws://127.0.0.1:{gw.service.port}/v1/stream") as ws:
        await ws.send(
            json.dumps({"type": "completion", "id": "a", "request": {"model": gw.model, "prompt": PROMPT}})
        )
        await ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": 2,
                    "request": {
                        "model": gw.model,
                        "messages": [{"role": "user", "content": PROMPT}],
                        "max_tokens": 4,
                        "stream_options": {"include_usage": True},
                    },
                }
            )
        )
        await ws.send(
            json.dumps({"type": "chat", "id": "bad", "request": {"model": gw.model, "messages": []}})
        )
        await ws.send("not json")
        chunks: dict[Any, list[dict]] = {"a": [], 2: []}
        done: dict[Any, dict] = {}
        errors: dict[Any, dict] = {}
        while len(done) < 2 or len(errors) < 2:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
            if msg["type"] == "chunk":
                chunks[msg["id"]].append(msg["chunk"])
            elif msg["type"] == "done":
                done[msg["id"]] = msg["response"]
            else:
                assert msg["type"] == "error"
                errors[msg["id"]] = msg["error"]
        assert done["a"]["object"] == "text_completion"
        assert (
            "".join(c["choices"][0]["text"] for c in chunks["a"]) == done["a"]["choices"][0]["text"] == FULL
        )
        assert done[2]["object"] == "chat.completion"
        assert done[2]["choices"][0]["message"] == {
            "role": "assistant",
            "content": "The capital of France",
            "refusal": None,
            "tool_calls": [],
        }
        assert done[2]["choices"][0]["finish_reason"] == "length"
        assert chunks[2][0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[2] if c["choices"]) == (
            "The capital of France"
        )
        assert chunks[2][-1]["usage"]["completion_tokens"] == 4 and "usage" not in chunks["a"][-1]
        assert errors["bad"]["param"] == "messages" and errors["bad"]["type"] == "invalid_request_error"
        assert set(errors[None]) == {"message", "type", "param", "code"}

        # the connection is still open after errors
        await ws.send(json.dumps({"type": "completion", "request": {"model": "nope", "prompt": "x"}}))
        msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert msg == {
            "type": "error",
            "id": None,
            "error": {
                "message": "The model `nope` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            },
        }


async def test_websocket_disconnect_aborts(gw):
    async with ws_connect(f"ws://127.0.0.1:{gw.service.port}/v1/stream") as ws:
        await ws.send(
            json.dumps({"type": "completion", "id": 1, "request": {"model": gw.model, "prompt": "slow"}})
        )
        msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert msg["type"] == "chunk" and msg["chunk"]["choices"][0]["text"] == "Hello"
        request_id = msg["chunk"]["id"]
    await gw.backend.wait_aborted(request_id)
