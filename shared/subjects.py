"""Every NATS subject, in one place. Each subject carries exactly one message type."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from shared.model_source import subject_token

PREFIX = "pagedllm"
TOKENIZER_QUEUE = "tokenizer"


@dataclass(frozen=True)
class Subjects:
    """The subjects of one served model (``model`` is its served name)."""

    model: str

    @property
    def base(self) -> str:
        return f"{PREFIX}.{subject_token(self.model)}"

    @property
    def tokenize(self) -> str:  # TokenizeRequest -> TokenizeReply (request/reply, queue group)
        return f"{self.base}.tokenize"

    @property
    def submit(self) -> str:  # SubmitRequest
        return f"{self.base}.submit"

    @property
    def abort(self) -> str:  # AbortRequests
        return f"{self.base}.abort"

    @property
    def fail(self) -> str:  # FailRequests
        return f"{self.base}.fail"

    @property
    def register(self) -> str:  # RegisterGroup -> RegisterAck (request/reply)
        return f"{self.base}.register"

    @property
    def heartbeat(self) -> str:  # Heartbeat
        return f"{self.base}.heartbeat"

    def step(self, group_id: str) -> str:  # StepPlan
        return f"{self.base}.exec.{group_id}.step"

    def compile(self, group_id: str) -> str:  # CompileGrammar
        return f"{self.base}.exec.{group_id}.compile"

    @property
    def grammar_ready(self) -> str:  # GrammarReady
        return f"{self.base}.grammar.ready"

    @property
    def result(self) -> str:  # StepResult
        return f"{self.base}.result"

    def detok(self, shard: int) -> str:  # DetokStep
        return f"{self.base}.detok.{shard}"

    @property
    def stats(self) -> str:  # SchedulerStats, published every second
        return f"{self.base}.stats"

    @property
    def stats_get(self) -> str:  # StatsQuery -> SchedulerStats (request/reply)
        return f"{self.base}.stats.get"

    @property
    def scheduler_started(self) -> str:  # SchedulerStarted
        return f"{self.base}.scheduler.started"

    @property
    def requests_get(self) -> str:  # RequestsQuery -> RequestsKnown (request/reply)
        return f"{self.base}.requests.get"


def ping(model: str, service: str) -> str:  # Ping -> Pong (request/reply)
    return f"{PREFIX}.{subject_token(model)}.ping.{service}"


def gateway(gateway_id: str) -> str:  # GatewayStep
    return f"{PREFIX}.gw.{gateway_id}"


def gateway_ping(gateway_id: str) -> str:  # Ping -> Pong (request/reply): is the gateway there?
    return f"{PREFIX}.gw.{gateway_id}.ping"


def detok_shard(request_id: str, num_shards: int) -> int:
    """The detokenizer shard of a request: a stable hash of its id."""
    return zlib.crc32(request_id.encode()) % num_shards
