"""The scheduler service's liveness actions: it carries out the verdicts of the pure policy
(``Liveness``) over NATS.

``Watchdog`` drops an executor group with no blame (its requests requeued) or fails its
step (the step's culprit fails, the others are requeued), and runs the two loops that look
for the lost: ``watch_groups`` (groups whose heartbeat stopped or whose step ran too long;
the waiting requests when no group came back in time) and ``watch_peers`` (the gateways and
detokenizer shards of the requests held, pinged every ``heartbeat_timeout_s``).

It holds no state of its own: the requests and groups are the service's ``Scheduler``'s, the
liveness state its ``Liveness``'s, and it finishes requests and sends their errors through the
service (``kick``, ``finish_requests``, ``fail_requests``, ``send_error``,
``release_detokenizer``).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import nats.errors

from services.scheduler.liveness import PingAnswer, Verdict
from services.scheduler.request import Request
from shared import subjects as subj
from shared.logging import get_logger
from shared.messages import Ping, Pong, ServiceError

if TYPE_CHECKING:
    from services.scheduler.service import SchedulerService

log = get_logger(__name__)
#: the log event of a verdict that drops a group (a step timed out is a failed step: group_dropped)
DROP_EVENTS = {Verdict.GROUP_STOPPED: "group_stopped", Verdict.PLAN_LOST: "step_lost", Verdict.RESULT_LOST: "step_lost",
               Verdict.HEARTBEAT_LOST: "group_heartbeat_lost"}


class Watchdog:
    """Carries out the liveness verdicts of ``service``, which owns it (``service.watchdog``)."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    # ------------------------------------------------------------------ groups

    def remove_group(self, group_id: str) -> list[Request]:
        """Drop a group and its steps in flight (their results are then stale); returns its
        requests, routed again."""
        self.service.liveness.forget(group_id)
        return self.service.scheduler.remove_group(group_id)

    def note_group_dropped(self, error: ServiceError) -> None:
        """With no group left, the policy's wait for one to register again starts."""
        self.service.liveness.group_dropped(time.monotonic(), error, len(self.service.scheduler.groups))

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
        await self.service.kick()

    async def fail_group(self, group_id: str, error: ServiceError) -> None:
        """A group failed a step: the step's culprit, if known, fails with the error
        (``Scheduler.fail_step``); the group is dropped and its other requests are requeued,
        for another group or for this one when it registers again (its executor does so at
        once after a failed step)."""
        service = self.service
        service.liveness.forget(group_id)
        failed, moved = service.scheduler.fail_step(group_id)
        for req in failed:
            await service.send_error(req, error)
        await service.release_detokenizer(failed)
        log.warning("group_dropped", group_id=group_id, requeued=len(moved), failed=len(failed),
                    reason=error.message)
        self.note_group_dropped(error)
        await service.kick()

    # ------------------------------------------------------------------ loops

    async def watch_groups(self) -> None:
        """Drop groups whose heartbeat stopped or whose step never came back; fail the waiting
        requests when no group came back in time."""
        service = self.service
        while True:
            await asyncio.sleep(min(0.5, service.settings.heartbeat_interval_s))
            now = time.monotonic()
            for group_id in list(service.scheduler.groups):
                if (verdict := service.liveness.check(group_id, now)) is not None:
                    await self.drop_group(group_id, verdict)
            fail = service.liveness.fail_waiting(now, bool(service.scheduler.groups), bool(service.scheduler.waiting))
            if fail is not None:
                waiting = list(service.scheduler.waiting)
                await service.fail_requests([r.request_id for r in waiting], fail.error)
                log.warning("no_executor_group", failed=len(waiting), reason=fail.cause.message)

    async def watch_peers(self) -> None:
        """Every ``heartbeat_timeout_s``, ping the gateways and detokenizer shards of the
        requests held: a gateway gone has its requests aborted, so that they free their blocks
        instead of running to max_tokens for nobody; a detokenizer shard gone has its requests
        failed with a 503 ``request_lost`` (their outputs would go nowhere)."""
        service = self.service
        while True:
            await asyncio.sleep(service.liveness.heartbeat_timeout_s)
            by_gateway: dict[str, list[str]] = defaultdict(list)
            by_shard: dict[int, list[str]] = defaultdict(list)
            for req in service.scheduler.requests.values():
                by_gateway[req.gateway_id].append(req.request_id)
                by_shard[service.outputs.shard(req)].append(req.request_id)
            service.liveness.watch_peers(by_gateway, by_shard)
            try:
                for gateway_id, request_ids in by_gateway.items():
                    if service.liveness.gateway_ping(gateway_id, await self.ping(subj.gateway_ping(gateway_id))):
                        aborted = await service.finish_requests(request_ids, "abort")
                        log.warning("gateway_lost", gateway_id=gateway_id, aborted=len(aborted))
                        await service.kick()
                for shard, request_ids in by_shard.items():
                    answer = await self.ping(subj.ping(service.model_info.name, f"detokenizer.{shard}"))
                    if service.liveness.detokenizer_ping(shard, answer):
                        log.warning("detokenizer_lost", shard=shard, requests=len(request_ids))
                        await service.fail_requests(request_ids, ServiceError(
                            message=f"no detokenizer serves shard {shard} of this model; send the request again",
                            type="server_error", code="request_lost", status=503))
                        await service.kick()
            except Exception:  # never let one round end the watch for the scheduler's lifetime
                log.exception("peer_watch_failed")

    async def ping(self, ping_subject: str) -> PingAnswer:
        """Whether a peer answers its ping subject (``Ping`` -> ``Pong``, 2 s)."""
        try:
            await self.service.bus.request(ping_subject, Ping(), Pong, timeout=2.0)
        except nats.errors.NoRespondersError:
            return PingAnswer.NO_RESPONDERS
        except Exception:  # slow, an error reply, or NATS away: ask again next time
            return PingAnswer.ERROR
        return PingAnswer.ANSWERED
