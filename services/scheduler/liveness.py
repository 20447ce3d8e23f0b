"""The scheduler's liveness policy, pure: events in, each with an explicit ``now``
(``time.monotonic()`` seconds), verdicts out. The service's ``Watchdog`` (``watchdog.py``)
carries them out (drop a group and requeue its requests, fail a step, abort or fail requests).

Executor groups (one ``GroupWatch`` each, from its registration until it is dropped):
- **heartbeat lost**: no heartbeat (nor result) for ``heartbeat_timeout_s``;
- **step timed out**: the oldest step in flight has run for ``step_timeout_s``; a queued step's
  clock starts when the step before it is answered (async scheduling keeps two in flight);
- **plan lost**: NATS drops messages in transit when a connection or the server restarts. An
  executor with nothing queued or running says so (``Heartbeat.idle``) with the newest plan it
  received (``last_step_id``). Two idle heartbeats in a row that never received the oldest
  step in flight, the step sent before the first of them (so it had time to arrive), mean its
  plan was lost;
- **result lost**: an idle executor that received that step, whose result the scheduler has
  not had for ``heartbeat_timeout_s`` since an idle heartbeat first said so (a result still
  waiting in the scheduler's backlog gets that long to be handled);
- **group stopped**: a last heartbeat with ``stopping``; its requests move at once.

With no group left: once none has registered for ``heartbeat_timeout_s`` since the last one
went, the waiting requests (and those arriving later) fail with that group's error.

Peers (the gateways and detokenizer shards of the requests held, pinged every
``heartbeat_timeout_s``): one that NATS says nobody serves twice in a row (``MissCounter``) is
gone; once is no verdict (a peer reconnecting after a NATS blip has no subscription for a
moment), and neither is a slow answer or NATS away.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.liveness import MissCounter
from shared.messages import ServiceError


class Verdict(enum.Enum):
    """What the policy concludes about an executor group: each drops it."""

    GROUP_STOPPED = "group_stopped"  # its executor is stopping: requeue, no blame
    PLAN_LOST = "plan_lost"  # requeue, no blame
    RESULT_LOST = "result_lost"  # requeue, no blame
    HEARTBEAT_LOST = "heartbeat_lost"  # requeue, no blame
    STEP_TIMED_OUT = "step_timed_out"  # a failed step: blame (Scheduler.fail_step)

    @property
    def error(self) -> ServiceError:
        """The group's error: a timed-out step's culprit fails with it, and so do the waiting
        requests if no group comes back (``fail_waiting``)."""
        return _ERRORS[self]


_ERRORS = {
    Verdict.GROUP_STOPPED: ServiceError(message="executor group stopped", type="server_error", status=503),
    Verdict.PLAN_LOST: ServiceError(message="executor step lost", type="server_error", status=503),
    Verdict.RESULT_LOST: ServiceError(message="executor step lost", type="server_error", status=503),
    Verdict.HEARTBEAT_LOST: ServiceError(message="executor group lost", type="server_error", status=500),
    Verdict.STEP_TIMED_OUT: ServiceError(message="executor step timed out", type="server_error", status=500),
}


class PingAnswer(enum.Enum):
    """How a peer's ping went."""

    ANSWERED = "answered"
    NO_RESPONDERS = "no_responders"  # NATS says nobody serves its ping subject
    ERROR = "error"  # slow, or NATS away: no verdict


@dataclass
class GroupWatch:
    """What the policy knows of one executor group's liveness."""

    last_heartbeat: float  # when it last showed life: registered, a heartbeat or a result
    step_sent_at: list[float] = field(default_factory=list)  # its steps in flight: their clocks' start, oldest first
    idle_heartbeat_at: float | None = None  # its last heartbeat, if that one said idle with a step in flight
    unanswered: tuple[int, float] | None = None  # (step id, since): it received that step and is idle


@dataclass(frozen=True)
class FailWaiting:
    """No group came back in time: fail the waiting requests with ``error``; ``cause`` is the
    last group's error."""

    error: ServiceError
    cause: ServiceError


class Liveness:
    """The policy's state: a ``GroupWatch`` per executor group, the peers' misses in a row, and
    since when no group is left.

    Args:
        heartbeat_timeout_s: silence that drops a group; a result missing that long after an
            idle heartbeat.
        step_timeout_s: the longest a step may run.
        executor_wait_timeout_s: the wait for a group, once the last one is gone (it may be
            restarting), before the waiting requests fail; None: ``heartbeat_timeout_s``.
    """

    def __init__(self, heartbeat_timeout_s: float, step_timeout_s: float,
                 executor_wait_timeout_s: float | None = None) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.step_timeout_s = step_timeout_s
        self.executor_wait_timeout_s = heartbeat_timeout_s if executor_wait_timeout_s is None \
            else executor_wait_timeout_s
        self.groups: dict[str, GroupWatch] = {}
        self.peers: MissCounter[tuple[str, str]] = MissCounter(2)  # ("gateway", id) / ("detokenizer", shard)
        self.groups_lost: tuple[float, ServiceError] | None = None  # since when none is left, and why

    # ------------------------------------------------------------------ executor groups

    def group_registered(self, group_id: str, now: float) -> None:
        """A group (re-)registered: watched afresh; the wait for a group ends."""
        self.groups[group_id] = GroupWatch(last_heartbeat=now)
        self.groups_lost = None

    def forget(self, group_id: str) -> None:
        """The group was dropped (or registers again): nothing of its steps is watched."""
        self.groups.pop(group_id, None)

    def group_dropped(self, now: float, error: ServiceError, groups_left: int) -> None:
        """A group was dropped with ``error``; with ``groups_left`` 0, the wait for one to
        register again starts (unless it already runs)."""
        if not groups_left and self.groups_lost is None:
            self.groups_lost = (now, error)

    def step_sent(self, group_id: str, now: float) -> None:
        self._watch(group_id, now).step_sent_at.append(now)

    def result_received(self, group_id: str, now: float) -> None:
        """The group answered its oldest step in flight: the next one's clock starts now (it
        started running only now)."""
        watch = self._watch(group_id, now)
        watch.last_heartbeat = now
        sent = watch.step_sent_at
        if sent:
            sent.pop(0)
            if sent:
                sent[0] = max(sent[0], now)

    def heartbeat(self, group_id: str, now: float, *, idle: bool, last_step_id: int, stopping: bool,
                  oldest_step_id: int | None) -> Verdict | None:
        """A heartbeat of a registered group whose oldest step in flight is ``oldest_step_id``
        (None: none in flight). Returns GROUP_STOPPED, PLAN_LOST, RESULT_LOST or None."""
        watch = self._watch(group_id, now)
        watch.last_heartbeat = now
        if stopping:
            return Verdict.GROUP_STOPPED
        previous, watch.idle_heartbeat_at = watch.idle_heartbeat_at, None
        if not idle or oldest_step_id is None:
            watch.unanswered = None
            return None
        watch.idle_heartbeat_at = now
        if last_step_id < oldest_step_id:  # it never received the step
            watch.unanswered = None
            sent = watch.step_sent_at
            return Verdict.PLAN_LOST if sent and previous is not None and sent[0] < previous else None
        step, since = watch.unanswered or (None, now)
        if step != oldest_step_id:
            watch.unanswered = (oldest_step_id, now)
            return None
        return Verdict.RESULT_LOST if now - since > self.heartbeat_timeout_s else None

    def check(self, group_id: str, now: float) -> Verdict | None:
        """The watchdog's look at one group: HEARTBEAT_LOST, STEP_TIMED_OUT or None."""
        watch = self.groups.get(group_id)
        if watch is None:
            return None
        if now - watch.last_heartbeat > self.heartbeat_timeout_s:
            return Verdict.HEARTBEAT_LOST
        if watch.step_sent_at and now - watch.step_sent_at[0] > self.step_timeout_s:
            return Verdict.STEP_TIMED_OUT
        return None

    def fail_waiting(self, now: float, has_groups: bool, has_waiting: bool) -> FailWaiting | None:
        """Whether the waiting requests fail now: no group for longer than
        ``executor_wait_timeout_s`` since the last one went, and some wait."""
        if self.groups_lost is None or has_groups:
            return None
        since, cause = self.groups_lost
        if now - since <= self.executor_wait_timeout_s or not has_waiting:
            return None
        error = ServiceError(message=f"no executor group is available (the last one: {cause.message})",
                             type="server_error", code="no_executor", status=503)
        return FailWaiting(error, cause)

    def _watch(self, group_id: str, now: float) -> GroupWatch:
        return self.groups.setdefault(group_id, GroupWatch(last_heartbeat=now))

    # ------------------------------------------------------------------ peers

    def watch_peers(self, gateway_ids: Iterable[str], shards: Iterable[int]) -> None:
        """The peers of the requests held now: the misses of any other are forgotten."""
        self.peers.retain([("gateway", g) for g in gateway_ids] + [("detokenizer", str(s)) for s in shards])

    def gateway_ping(self, gateway_id: str, answer: PingAnswer) -> bool:
        """Whether the gateway is gone (its requests are aborted)."""
        return self._ping(("gateway", gateway_id), answer)

    def detokenizer_ping(self, shard: int, answer: PingAnswer) -> bool:
        """Whether the detokenizer shard is gone (its requests fail: their outputs would go
        nowhere)."""
        return self._ping(("detokenizer", str(shard)), answer)

    def _ping(self, peer: tuple[str, str], answer: PingAnswer) -> bool:
        if answer is PingAnswer.ANSWERED:
            self.peers.hit(peer)
            return False
        if answer is PingAnswer.NO_RESPONDERS:
            return self.peers.miss(peer)
        return False
