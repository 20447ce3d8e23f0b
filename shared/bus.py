"""Typed publish/subscribe over NATS: pydantic models encoded with msgpack (no pickle)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgpack
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel

from shared.logging import get_logger

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)
log = get_logger(__name__)


def encode(message: BaseModel) -> bytes:
    """A message as msgpack bytes."""
    return msgpack.packb(message.model_dump(mode="python", exclude_defaults=True), use_bin_type=True)


def decode(data: bytes, message_type: type[M]) -> M:
    """msgpack bytes as a validated message of ``message_type``.

    Raises:
        pydantic.ValidationError: the bytes are not a valid ``message_type``.
    """
    return message_type.model_validate(msgpack.unpackb(data, raw=False, strict_map_key=False))


Handler = Callable[[M], Awaitable[BaseModel | None]]


class Bus:
    """One NATS connection with typed helpers.

    Handlers receive the decoded message; a handler of a request/reply subject returns
    the reply message. A handler that raises is logged and the subscription goes on.
    """

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._subs: list[Subscription] = []

    @classmethod
    async def connect(cls, url: str, name: str = "pagedllm") -> Bus:
        nc = await nats.connect(  # drain_timeout: a stop with the server gone waits 5 s, not 30
            url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5, drain_timeout=5
        )
        return cls(nc)

    async def publish(self, subject: str, message: BaseModel) -> None:
        await self.nc.publish(subject, encode(message))

    async def request(self, subject: str, message: BaseModel, reply_type: type[R], timeout: float = 30.0) -> R:
        """Send a request and wait for its typed reply.

        Raises:
            nats.errors.TimeoutError: no reply within ``timeout`` seconds.
            nats.errors.NoRespondersError: nobody listens on ``subject``.
        """
        msg = await self.nc.request(subject, encode(message), timeout=timeout)
        return decode(msg.data, reply_type)

    async def subscribe(
        self, subject: str, message_type: type[M], handler: Handler, queue: str = ""
    ) -> Subscription:
        async def on_msg(msg: Msg) -> None:
            try:
                decoded = decode(msg.data, message_type)
                reply = await handler(decoded)
                if reply is not None and msg.reply:
                    await msg.respond(encode(reply))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("handler_failed", subject=subject)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
        self._subs.append(sub)
        return sub

    async def flush(self) -> None:
        await self.nc.flush()

    async def close(self) -> None:
        """Drain subscriptions (pending messages are handled) and close."""
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except Exception:  # already closing or server gone
            await self.nc.close()
