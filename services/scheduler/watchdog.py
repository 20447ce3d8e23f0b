"""The scheduler service's liveness actions: it carries out the verdicts of the pure policy
(``Liveness``) over NATS.

``Watchdog`` drops an executor group with no blame (its requests requeued) or fails its
step (the step's culprit fails, the others are requeued), and runs the two loops that look
for the lost: ``watch_groups`` (groups whose heartbeat stopped or whose step ran too long;
the waiting requests when no group came back in time) and ``watch_peers`` (the gateways and
detokenizer shards of the requests held, pinged every ``heartbeat_timeout_s``).

It holds no state of its own: it is given the ``Scheduler`` (requests, groups) and the
``Liveness`` (the policy's state) it acts on, and finishes requests and sends their errors
through ``WatchdogActions``, which the scheduler service implements; it never imports the
service module.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

import nats.errors

from services.scheduler.liveness import Liveness, PingAnswer, Verdict
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared import subjects as subj
from shared.bus import Bus
from shared.logging import get_logger
from shared.messages import FinishReason, Ping, Pong, ServiceError

log = get_logger(__name__)
#: the log event of a verdict that drops a group (a step timed out is a failed step: group_dropped)
DROP_EVENTS = {Verdict.GROUP_STOPPED: "group_stopped", Verdict.PLAN_LOST: "step_lost", Verdict.RESULT_LOST: "step_lost",
               Verdict.HEARTBEAT_LOST: "group_heartbeat_lost"}


class WatchdogActions(Protocol):
    """What the watchdog asks of the scheduler service (``SchedulerService`` implements each;
    they send over NATS)."""

    async def kick(self) -> None:
        """Send every group that has work and room in flight its next plans."""

    async def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Request]:
        """Finish the requests held among ``request_ids`` with ``reason`` (their blocks free at
        once, their detokenizer state is released); returns those finished."""

    async def fail_requests(self, request_ids: list[str], error: ServiceError) -> None:
        """Finish the requests held among ``request_ids``, each with every sample of its n > 1
        request, and send ``error`` to their gateways; ids not held are ignored."""

    async def send_error(self, req: Request, error: ServiceError) -> None:
        """Send ``error`` to the gateway of ``req`` (already finished).

        Raises:
            Exception: what publishing raises (NATS away)."""

    async def release_detokenizer(self, reqs: list[Request]) -> None:
        """Tell the detokenizer shards to drop the text state of ``reqs`` (failures logged)."""


class Watchdog:
    """Carries out the liveness verdicts of ``liveness`` on the requests and groups of
    ``scheduler``, through ``actions``.

    Args:
        actions: the service's sending actions.
        scheduler: the requests and executor groups (no I/O).
        liveness: the policy, and its state.
        shard_of: the detokenizer shard of a request (``Outputs.shard``).
        model: the served model's name (its detokenizers' ping subjects).
        heartbeat_interval_s: the executors' heartbeat interval (``watch_groups`` looks at
            least this often, and every 0.5 s at most).
    """

    def __init__(self, actions: WatchdogActions, scheduler: Scheduler, liveness: Liveness, *,
                 shard_of: Callable[[Request], int], model: str, heartbeat_interval_s: float) -> None:
        self.actions = actions
        self.scheduler = scheduler
        self.liveness = liveness
        self.shard_of = shard_of
        self.model = model
        self.heartbeat_interval_s = heartbeat_interval_s

    # ------------------------------------------------------------------ groups

    def remove_group(self, group_id: str) -> list[Request]:
        """Drop a group and its steps in flight (their results are then stale); returns its
        requests, routed again."""
        self.liveness.forget(group_id)
        return self.scheduler.remove_group(group_id)

    def note_group_dropped(self, error: ServiceError) -> None:
        """With no group left, the policy's wait for one to register again starts."""
        self.liveness.group_dropped(time.monotonic(), error, len(self.scheduler.groups))

    async def drop_group(self, group_id: str, verdict: Verdict, **fields: object) -> None:
        """Carry out a verdict of the liveness policy: a step timed out fails (``fail_group``);
        else the group is dropped with no blame (no request failed) and its requests requeued;
        its executor, told it is unknown, registers again with a clean state."""
        if verdict is Verdict.STEP_TIMED_OUT:
            await self.fail_group(group_id, verdict.error)
            return
        moved = self.remove_group(group_id)
        (log.info if verdict is Verdict.GROUP_STOPPED else log.warning)(
            DROP_EVENTS[verdict], group_id=group_id, requeued=len(moved), **fields)
        self.note_group_dropped(verdict.error)
        await self.actions.kick()

    async def fail_group(self, group_id: str, error: ServiceError) -> None:
        """A group failed a step: the step's culprit, if known, fails with the error
        (``Scheduler.fail_step``); the group is dropped and its other requests are requeued,
        for another group or for this one when it registers again (its executor does so at
        once after a failed step)."""
        actions = self.actions
        self.liveness.forget(group_id)
        failed, moved = self.scheduler.fail_step(group_id)
        for req in failed:
            await actions.send_error(req, error)
        await actions.release_detokenizer(failed)
        log.warning("group_dropped", group_id=group_id, requeued=len(moved), failed=len(failed),
                    reason=error.message)
        self.note_group_dropped(error)
        await actions.kick()

    # ------------------------------------------------------------------ loops

    async def watch_groups(self) -> None:
        """Drop groups whose heartbeat stopped or whose step never came back; fail the waiting
        requests when no group came back in time."""
        scheduler, liveness = self.scheduler, self.liveness
        while True:
            await asyncio.sleep(min(0.5, self.heartbeat_interval_s))
            now = time.monotonic()
            for group_id in list(scheduler.groups):
                if (verdict := liveness.check(group_id, now)) is not None:
                    await self.drop_group(group_id, verdict)
            fail = liveness.fail_waiting(now, bool(scheduler.groups), bool(scheduler.waiting))
            if fail is not None:
                waiting = list(scheduler.waiting)
                await self.actions.fail_requests([r.request_id for r in waiting], fail.error)
                log.warning("no_executor_group", failed=len(waiting), reason=fail.cause.message)

    async def watch_peers(self, bus: Bus) -> None:
        """Every ``heartbeat_timeout_s``, ping (over ``bus``) the gateways and detokenizer
        shards of the requests held: a gateway gone has its requests aborted, so that they free
        their blocks instead of running to max_tokens for nobody; a detokenizer shard gone has
        its requests failed with a 503 ``request_lost`` (their outputs would go nowhere)."""
        actions, liveness = self.actions, self.liveness
        while True:
            await asyncio.sleep(liveness.heartbeat_timeout_s)
            by_gateway: dict[str, list[str]] = defaultdict(list)
            by_shard: dict[int, list[str]] = defaultdict(list)
            for req in self.scheduler.requests.values():
                by_gateway[req.gateway_id].append(req.request_id)
                by_shard[self.shard_of(req)].append(req.request_id)
            liveness.watch_peers(by_gateway, by_shard)
            try:
                for gateway_id, request_ids in by_gateway.items():
                    if liveness.gateway_ping(gateway_id, await ping(bus, subj.gateway_ping(gateway_id))):
                        aborted = await actions.finish_requests(request_ids, "abort")
                        log.warning("gateway_lost", gateway_id=gateway_id, aborted=len(aborted))
                        await actions.kick()
                for shard, request_ids in by_shard.items():
                    answer = await ping(bus, subj.ping(self.model, f"detokenizer.{shard}"))
                    if liveness.detokenizer_ping(shard, answer):
                        log.warning("detokenizer_lost", shard=shard, requests=len(request_ids))
                        await actions.fail_requests(request_ids, ServiceError(
                            message=f"no detokenizer serves shard {shard} of this model; send the request again",
                            type="server_error", code="request_lost", status=503))
                        await actions.kick()
            except Exception:  # never let one round end the watch for the scheduler's lifetime
                log.exception("peer_watch_failed")


async def ping(bus: Bus, ping_subject: str) -> PingAnswer:
    """Whether a peer answers its ping subject (``Ping`` -> ``Pong``, 2 s)."""
    try:
        await bus.request(ping_subject, Ping(), Pong, timeout=2.0)
    except nats.errors.NoRespondersError:
        return PingAnswer.NO_RESPONDERS
    except Exception:  # slow, an error reply, or NATS away: ask again next time
        return PingAnswer.ERROR
    return PingAnswer.ANSWERED
