"""Beam search's request fields at the gateway: what it refuses, by name, before the engine."""

from __future__ import annotations

import pytest
from gateway_fakes import PROMPT, assert_openai_error


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "use_beam_search"),
    ({"top_p": 0.5}, "top_p"),
    ({"seed": 3}, "seed"),
    ({"stop": ["x"]}, "stop"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"min_tokens": 2}, "min_tokens"),
])
async def test_beam_search_refuses_what_it_cannot_honour(gw, extra, param):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = await gw.http.post(path, json={"model": gw.model, **body, "use_beam_search": True, "n": 2, **extra})
        assert param in assert_openai_error(r, 400, param)["message"]


async def test_length_penalty_without_beam_search_is_refused(gw):
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "length_penalty": 0.5})
    assert "use_beam_search" in assert_openai_error(r, 400, "length_penalty")["message"]
