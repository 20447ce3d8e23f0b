"""The OpenAI-compatible gateway: HTTP, Server-Sent Events and WebSocket over FastAPI.

``shared.engine_client.EngineClient`` talks to the services over NATS (the offline ``LLM``
uses it too). Here: ``protocol/`` (request and response shapes), ``errors`` (OpenAI error
bodies), ``generation`` with ``completion`` and ``chat`` (deltas folded into chunks and
responses, no I/O), ``serving`` (submit, stream, abort), ``websocket`` (``/v1/stream``),
``app`` (``create_app``: the routes), ``metrics`` (``GET /metrics``) and ``service``
(``GatewayService``: the app under uvicorn as a pagedllm service).
"""
