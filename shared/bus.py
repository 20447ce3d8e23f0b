"""Typed publish/subscribe over NATS: messages encoded with msgpack (no pickle).

Most control messages are pydantic models (``model_dump`` / ``model_validate``); the four
per-step messages and the messages that carry a request's records (``RequestSpec``,
``SamplingParams``) are msgspec structs, encoded and decoded by msgspec: their types are
checked on decode and their values are not checked again (``shared.messages.decoding``: they
were checked where they were built). The one pydantic model a struct embeds, ``ServiceError``,
is carried as its fields and validated on decode.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel

from shared.logging import get_logger
from shared.messages import ServiceError, decoding

AnyMessage = BaseModel | msgspec.Struct
M = TypeVar("M", bound=AnyMessage)
R = TypeVar("R", bound=AnyMessage)
log = get_logger(__name__)


def _enc_hook(obj: Any) -> Any:
    """A pydantic model inside a struct (``ServiceError``): its fields."""
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="python", exclude_defaults=True)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(type_: type, obj: Any) -> Any:
    """A pydantic model inside a struct, validated from its fields."""
    if isinstance(type_, type) and issubclass(type_, BaseModel):
        return type_.model_validate(obj)
    raise NotImplementedError(f"cannot decode {type_}")


_struct_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


@functools.cache
def _struct_decoder(message_type: type[msgspec.Struct]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(message_type, dec_hook=_dec_hook)


def encode(message: AnyMessage) -> bytes:
    """A message as msgpack bytes (fields equal to their defaults left out)."""
    if isinstance(message, msgspec.Struct):
        return _struct_encoder.encode(message)
    return msgpack.packb(message.model_dump(mode="python", exclude_defaults=True), use_bin_type=True)


def decode(data: bytes, message_type: type[M]) -> M:
    """msgpack bytes as a validated message of ``message_type``.

    Raises:
        pydantic.ValidationError: the bytes are not a valid ``message_type`` (a pydantic model).
        msgspec.ValidationError: the bytes are not a valid ``message_type`` (a struct: the
            types of its fields, and the pydantic models it carries).
        msgspec.DecodeError: the bytes are not msgpack (a struct).
    """
    if issubclass(message_type, msgspec.Struct):
        with decoding():
            return _struct_decoder(message_type).decode(data)
    return message_type.model_validate(msgpack.unpackb(data, raw=False, strict_map_key=False))


Handler = Callable[[M], Awaitable[AnyMessage | None]]

#: nats micro's error reply: these headers on an empty reply (``Nats-Service-Error-Code`` an
#: HTTP-like status as a string)
ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"


class RemoteError(Exception):
    """A request's handler failed at the other end: it answered with nats micro's error headers
    at once (``Bus.subscribe``) rather than leave the caller to wait out its timeout.
    ``error`` is the failure as a ``ServiceError`` (``status`` from the error code)."""

    def __init__(self, subject: str, error: ServiceError) -> None:
        super().__init__(f"{subject}: {error.message}")
        self.subject = subject
        self.error = error


def error_headers(message: str, status: int) -> dict[str, str]:
    """nats micro's error reply headers: ``message`` on one line (a header value cannot hold a
    line break) and ``status``."""
    return {ERROR_HEADER: " ".join(message.split()) or "error", ERROR_CODE_HEADER: str(status)}


def remote_error(subject: str, headers: dict[str, str] | None) -> RemoteError | None:
    """The ``RemoteError`` a reply's headers carry, if any."""
    if not headers or ERROR_HEADER not in headers:
        return None
    code = headers.get(ERROR_CODE_HEADER, "")
    status = int(code) if code.isdigit() else 500
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return RemoteError(subject, ServiceError(message=headers[ERROR_HEADER], type=kind, status=status))


#: while the server stays unreachable, a connection error is logged again at most this often
CONNECTION_ERROR_LOG_INTERVAL_S = 30.0
CONNECTION_ERRORS = (
    OSError, asyncio.TimeoutError, nats.errors.NoServersError, nats.errors.StaleConnectionError,
    nats.errors.ConnectionClosedError,
)
#: nats.py raises a plain ``nats.errors.Error`` when the TCP connection opens but the server's
#: INFO line does not come (a server starting or stopping accepts and closes): an outage too
_HANDSHAKE_ERROR_MESSAGES = ("when expecting INFO message", "info message, json parse error")


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc``, given to nats.py's ``error_cb``, says the server cannot be reached (or
    not yet): a refused or dropped connection, a timeout, or a handshake without the INFO line."""
    if isinstance(exc, CONNECTION_ERRORS):
        return True
    return type(exc) is nats.errors.Error and any(m in str(exc) for m in _HANDSHAKE_ERROR_MESSAGES)


#: how nats-server words a refusal of a connection's credentials (a wrong password or token, a
#: user JWT it does not trust, expired or revoked); nats.py raises them as a plain ``Error``.
#: Not its "Authentication Timeout" (a CONNECT that came late): that one may pass next time.
_AUTHORIZATION_ERROR_MESSAGES = ("authorization violation", "authentication expired", "authentication revoked")


def is_authorization_error(exc: BaseException) -> bool:
    """Whether ``exc``, given to nats.py's ``error_cb``, says the server refused this
    connection's credentials (none given, or wrong ones)."""
    if isinstance(exc, nats.errors.AuthorizationError):
        return True
    return isinstance(exc, nats.errors.Error) and any(m in str(exc).lower() for m in _AUTHORIZATION_ERROR_MESSAGES)


class NatsAuthorizationError(PermissionError):
    """The NATS server refused the credentials of a new connection (``Bus.connect``): trying
    again would not help. The message names the server without its credentials."""


def redact_url(url: str) -> str:
    """``url`` without the credentials of its user-info part (``nats://***@host:port``)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


class ConnectionEvents:
    """nats.py's ``error_cb``, ``disconnected_cb`` and ``reconnected_cb`` for one connection:
    one short structured log line per event, instead of nats.py's default ``nats: encountered
    error`` traceback every reconnect attempt (every 0.5 s while the server is down).

    A connection error (:func:`is_connection_error`: refused, timed out, unexpected EOF, no
    INFO line in the handshake, ...) is logged without a traceback: the first of an outage,
    then at most once per ``CONNECTION_ERROR_LOG_INTERVAL_S``, with ``errors``, the number of
    connection errors since the connection was last up. Another NATS error (slow consumer,
    ...) is one line each; any other exception keeps its traceback.

    Before the first connection is up, a refusal of the credentials (:func:`is_authorization_error`)
    ends the connection attempt with a :class:`NatsAuthorizationError` (raised from
    ``on_error``, out of nats.py's connect); once connected, a refusal while reconnecting (the
    server's configuration changed) is logged as a connection error and retried.

    ``connecting``: the task that runs nats.py's connect (``Bus.connect``'s). A cancel of it
    that nats.py lost is raised again from ``on_error``, out of the connect: on Python 3.11,
    ``asyncio.wait_for`` (around nats.py's TCP connect) returns an attempt's error instead of
    the cancel when both come in one loop turn, and nats.py logs the error and retries for ever.
    """

    def __init__(self, name: str, url: str, connecting: asyncio.Task | None = None) -> None:
        self.name = name
        self.url = redact_url(url)  # logged: never with its credentials
        self.errors = 0  # connection errors since the connection was last up
        self._last_logged = 0.0
        self.client: Client | None = None  # set once connected
        self._connecting = connecting
        self._cancels = connecting.cancelling() if connecting is not None else 0  # requested before connect

    async def on_error(self, exc: Exception) -> None:
        if self.client is None and self.cancel_lost():
            raise asyncio.CancelledError
        if self.client is None and is_authorization_error(exc):
            raise NatsAuthorizationError(
                f"NATS at {self.url} refused the credentials of connection {self.name!r} ({exc}): check the user "
                "and password or token in the NATS URL, or the credentials file (PAGEDLLM_NATS_CREDS)")
        if not is_connection_error(exc) and not is_authorization_error(exc):
            if isinstance(exc, nats.errors.Error):  # slow consumer, drain timeout, ...: says what it is
                log.warning("nats_error", connection=self.name, error=str(exc) or type(exc).__name__)
            else:
                log.error("nats_error", connection=self.name, error=repr(exc), exc_info=exc)
            return
        self.errors += 1
        now = time.monotonic()
        if self.errors > 1 and now - self._last_logged < CONNECTION_ERROR_LOG_INTERVAL_S:
            return
        self._last_logged = now
        log.warning("nats_connection_error", connection=self.name, url=self.url,
                    error=str(exc) or type(exc).__name__, errors=self.errors)

    async def on_disconnected(self) -> None:
        if self.client is not None and self.client.is_closed:  # our own close (a stop): nothing lost
            log.debug("nats_closed", connection=self.name, url=self.url)
            return
        log.warning("nats_disconnected", connection=self.name, url=self.url)

    def on_connected(self) -> None:
        """The first connection is up (nats.py has no callback for it): log it if it took
        retries, and start counting errors afresh."""
        if self.errors:
            log.info("nats_connected", connection=self.name, url=self.url, errors=self.errors)
        self._up()

    async def on_reconnected(self) -> None:
        log.info("nats_reconnected", connection=self.name, url=self.url, errors=self.errors)
        self._up()

    def _up(self) -> None:
        """The connection is up: the next outage's first error is logged."""
        self.errors = 0
        self._last_logged = 0.0

    def cancel_lost(self) -> bool:
        """Whether this runs in the connecting task, cancelled since ``Bus.connect`` began and
        running on: the cancel was lost."""
        task = asyncio.current_task()
        return task is not None and task is self._connecting and task.cancelling() > self._cancels


class Bus:
    """One NATS connection with typed helpers.

    Handlers receive the decoded message; a handler of a request/reply subject returns
    the reply message. A handler that raises is logged and the subscription goes on; a request
    it fails is answered at once with nats micro's error headers (``request`` raises them as a
    ``RemoteError``): status 400 when the request does not decode, else 500.
    """

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._subs: list[Subscription] = []

    @classmethod
    async def connect(cls, url: str, name: str = "pagedllm", creds: Path | str | None = None) -> Bus:
        """Connect to ``url``, retrying for ever (every 0.5 s) until the server answers, and
        reconnecting the same way after a loss; errors, disconnections and reconnections are
        logged as one line each (:class:`ConnectionEvents`). A cancel ends it whenever it comes
        (nats.py's connect alone may lose one and retry on: see :class:`ConnectionEvents`).

        Credentials: a user and password or a token in ``url`` (``nats://user:pw@host:4222``,
        ``nats://token@host:4222``), or ``creds``, a NATS credentials file (a user JWT and its
        NKey seed, as ``nsc`` writes it), read at each connection attempt.

        Raises:
            FileNotFoundError: ``creds`` is not a file.
            NatsAuthorizationError: the server refused the credentials (none, or wrong ones).
        """
        if creds is not None and not Path(creds).is_file():
            raise FileNotFoundError(f"NATS credentials file {str(creds)!r} not found")
        events = ConnectionEvents(name, url, connecting=asyncio.current_task())
        nc = Client()
        try:
            await nc.connect(  # drain_timeout: a stop with the server gone waits 5 s, not 30
                url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5,
                drain_timeout=5, user_credentials=None if creds is None else str(creds),
                error_cb=events.on_error, disconnected_cb=events.on_disconnected,
                reconnected_cb=events.on_reconnected,
            )
        except NatsAuthorizationError:
            await nc.close()
            raise
        events.client = nc
        if events.cancel_lost():  # in the handshake's last turn (its wait_for returned the answer)
            await nc.close()
            raise asyncio.CancelledError
        events.on_connected()
        return cls(nc)

    async def publish(self, subject: str, message: AnyMessage) -> None:
        await self.nc.publish(subject, encode(message))

    async def request(self, subject: str, message: AnyMessage, reply_type: type[R], timeout: float = 30.0) -> R:
        """Send a request and wait for its typed reply.

        Raises:
            nats.errors.TimeoutError: no reply within ``timeout`` seconds.
            nats.errors.NoRespondersError: nobody listens on ``subject``.
            RemoteError: the handler failed (an error reply, at once).
        """
        msg = await self.nc.request(subject, encode(message), timeout=timeout)
        if (error := remote_error(subject, msg.headers)) is not None:
            raise error
        return decode(msg.data, reply_type)

    async def subscribe(
        self, subject: str, message_type: type[M], handler: Handler, queue: str = ""
    ) -> Subscription:
        async def on_msg(msg: Msg) -> None:
            status = 400  # until it decodes
            try:
                decoded = decode(msg.data, message_type)
                status = 500
                reply = await handler(decoded)
                if reply is not None and msg.reply:
                    await msg.respond(encode(reply))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("handler_failed", subject=subject)
                if msg.reply:
                    await self._respond_error(msg, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                                              status)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
        self._subs.append(sub)
        return sub

    async def _respond_error(self, msg: Msg, message: str, status: int) -> None:
        try:
            await self.nc.publish(msg.reply, b"", headers=error_headers(message, status))
        except Exception:  # NATS away: the caller times out
            log.warning("error_reply_failed", subject=msg.subject)

    async def flush(self) -> None:
        """Return once the server has processed everything sent so far (a subscription made
        before it receives every message published after it, from any connection).

        nats.py's ``flush`` writes its PING straight to the socket, ahead of commands still
        buffered for its flusher task (a SUB just made), so its PONG can come back before the
        server has the SUB: another connection's publish right after was missed 163 times in
        2,000 here. The first round trip gets the buffer written; the second PING follows it.
        """
        await self.nc.flush()
        await self.nc.flush()

    async def close(self) -> None:
        """Drain subscriptions (pending messages are handled) and close."""
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except Exception:  # already closing or server gone
            await self.nc.close()
