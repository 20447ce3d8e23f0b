"""The OpenAI-compatible gateway: HTTP, Server-Sent Events and WebSocket over FastAPI.

``gateway.client.EngineClient`` talks to the services over NATS (also used by the offline
``LLM`` API; it does not import FastAPI), ``gateway.app.create_app`` builds the FastAPI app,
``gateway.service.GatewayService`` runs it with uvicorn as a pagedllm service.
"""
