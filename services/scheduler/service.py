"""The scheduler service: the step loop of every executor group, over NATS.

recv (submit / abort / register / heartbeat / step result) -> ``Scheduler`` (no I/O)
-> send (``StepPlan``s to every group with room in flight, one ``DetokStep`` per detokenizer
shard, errors to gateways). Each group steps independently, while the other groups compute:
with async scheduling it gets its next plan as soon as it has been sent the previous one (two
in flight), else when its last result arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict

import nats.errors
import structlog
from nats.aio.subscription import Subscription

from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler, SchedulerConfig, StepOutcome
from shared import subjects as subj
from shared.bus import Bus
from shared.config import Settings
from shared.messages import (
    AbortRequests,
    DetokNewRequest,
    DetokStep,
    FinishReason,
    GatewayStep,
    Heartbeat,
    HeartbeatAck,
    Ping,
    Pong,
    PromptLogprobs,
    RegisterAck,
    RegisterGroup,
    RequestDelta,
    RequestsKnown,
    RequestsQuery,
    SchedulerStats,
    ServiceError,
    StatsQuery,
    StepResult,
    SubmitRequest,
    TokenUpdate,
)
from shared.model_source import ModelInfo
from shared.service import answer_pings, refuse_if_served

log = structlog.get_logger("scheduler")
PROMPT_TAIL_TOKENS = 6  # prompt context the detokenizer needs for the first output token
PLAN_MARGIN_BYTES = 64 << 10  # of NATS max_payload, for plan fields Request.new_request_bytes omits


class SchedulerService:
    """Owns the ``Scheduler`` and drives it from NATS messages."""

    name = "scheduler"

    def __init__(self, settings: Settings, model_info: ModelInfo, bus: Bus | None = None) -> None:
        self.settings = settings
        self.model_info = model_info
        self.subjects = subj.Subjects(model_info.name)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                policy=settings.scheduling_policy,
                enable_prefix_caching=settings.enable_prefix_caching,
                async_scheduling=settings.async_scheduling,
            )
        )
        self.bus = bus
        self._own_bus = bus is None
        self._tasks: list[asyncio.Task] = []
        self._submit_sub: Subscription | None = None
        self._peer_misses: dict[str, int] = {}  # ping subject -> pings in a row nobody answered
        self._step_sent_at: dict[str, list[float]] = {}  # group -> send times of its steps in flight
        self._idle_heartbeat_at: dict[str, float] = {}  # group -> when its last heartbeat said idle
        # group -> (step id, since when) its executor answered the step and its result is missing
        self._unanswered_since: dict[str, tuple[int, float]] = {}
        # when the last group went and its error: waiting requests fail if none registers in time
        self._groups_lost: tuple[float, ServiceError] | None = None

    async def start(self) -> None:
        if self.bus is None:
            self.bus = await Bus.connect(self.settings.nats_url, name="scheduler")
        s, b = self.subjects, self.bus
        await refuse_if_served(b, self.model_info.name, self.name, "scheduler")
        # plans stay under the server's max_payload, with room for the fields not estimated
        max_payload = b.nc.max_payload
        self.scheduler.config = dataclasses.replace(
            self.scheduler.config, max_plan_bytes=max(max_payload // 2, max_payload - PLAN_MARGIN_BYTES))
        self._submit_sub = await b.subscribe(s.submit, SubmitRequest, self._on_submit)
        await b.subscribe(s.abort, AbortRequests, self._on_abort)
        await b.subscribe(s.register, RegisterGroup, self._on_register)
        await b.subscribe(s.heartbeat, Heartbeat, self._on_heartbeat)
        await b.subscribe(s.result, StepResult, self._on_result)
        await b.subscribe(s.stats_get, StatsQuery, self._on_stats_query)
        await b.subscribe(s.requests_get, RequestsQuery, self._on_requests_query)
        await answer_pings(b, self.model_info.name, self.name)
        self._tasks = [asyncio.create_task(self._watchdog()), asyncio.create_task(self._publish_stats()),
                       asyncio.create_task(self._watch_peers())]
        log.info("scheduler_started", model=self.model_info.name)

    async def stop(self) -> None:
        """Stop; every request still held fails at once with a 503 ``request_lost`` (its state
        goes with the scheduler), rather than when its client's liveness check notices."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._submit_sub is not None:  # no new request is taken while the held ones are failed
            try:
                await self._submit_sub.unsubscribe()
            except Exception:  # the connection is gone
                pass
            self._submit_sub = None
        if self.bus is not None and self.scheduler.requests:
            await self._fail_requests(list(self.scheduler.requests), ServiceError(
                message="the scheduler stopped before this request finished; send it again",
                type="server_error", code="request_lost", status=503))
            try:
                await self.bus.flush()
            except Exception:  # NATS already gone: the clients' liveness checks end the requests
                log.warning("stop_notify_failed")
        if self._own_bus and self.bus is not None:
            await self.bus.close()

    # ------------------------------------------------------------------ handlers

    async def _on_submit(self, msg: SubmitRequest) -> None:
        req = Request.from_submit(msg, self.model_info.max_model_len, self.model_info.eos_token_ids, time.time())
        error = self.scheduler.add_request(req)
        if error is not None:
            log.info("request_rejected", request_id=req.request_id, reason=error.message)
            await self._send_error(req, error)
            return
        log.debug("request_queued", request_id=req.request_id, prompt_tokens=req.num_prompt_tokens)
        if msg.notify_accepted:
            if self.scheduler.groups:
                await self._send_accepted([req])
            else:  # a group registering may still refuse it (larger than its pool): say so then
                req.acceptance_due = True
        await self._kick()

    async def _send_accepted(self, reqs: list[Request]) -> None:
        """Tell the gateways these requests can no longer be refused (``notify_accepted``)."""
        by_gateway: dict[str, list[RequestDelta]] = defaultdict(list)
        for req in reqs:
            by_gateway[req.gateway_id].append(RequestDelta(request_id=req.request_id, accepted=True))
        for gateway_id, deltas in by_gateway.items():
            await self.bus.publish(subj.gateway(gateway_id), GatewayStep(outputs=deltas))

    async def _on_abort(self, msg: AbortRequests) -> None:
        if msg.error is not None:  # a detokenizer lost their state: their clients must hear it
            await self._fail_requests(msg.request_ids, msg.error)
        else:
            for req in await self._finish_requests(msg.request_ids, msg.reason):
                log.info("request_aborted", request_id=req.request_id, reason=msg.reason)
        await self._kick()

    async def _finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Request]:
        """``Scheduler.abort`` (blocks free at once), then tell the detokenizer shards to drop
        the state of those they had (``_release_detokenizer``). Returns the finished requests."""
        done = self.scheduler.abort(request_ids, reason)
        await self._release_detokenizer(done)
        return done

    async def _release_detokenizer(self, reqs: list[Request]) -> None:
        """Requests finished here without a last output (aborted, failed): named in
        ``DetokStep.released`` to the shards they were sent to, which drop their text state
        (else it stays there for good) and send nothing (their clients heard of the end from
        the gateway or from this scheduler)."""
        shards: dict[int, DetokStep] = defaultdict(DetokStep)
        n = self.settings.num_detokenizer_shards
        for req in reqs:
            if req.sent_to_detokenizer:
                shards[subj.detok_shard(req.request_id, n)].released.append(req.request_id)
        try:
            for shard, step in shards.items():
                await self.bus.publish(self.subjects.detok(shard), step)
        except Exception:  # NATS away: the state stays until that detokenizer restarts
            log.warning("detokenizer_release_failed", requests=len(reqs))

    async def _fail_requests(self, request_ids: list[str], error: ServiceError) -> None:
        """Finish each of these requests still held, with every sample of its n > 1 request
        (the client's stream ends at the error), then send ``error`` to its gateway. Ids not
        held are ignored."""
        held = [self.scheduler.requests[rid] for rid in request_ids if rid in self.scheduler.requests]
        families = list(dict.fromkeys(req.parent_request_id or req.request_id for req in held))
        for req in await self._finish_requests(families, "error"):
            log.warning("request_failed", request_id=req.request_id, code=error.code, reason=error.message)
        for req in held:
            try:
                await self._send_error(req, error)
            except Exception:  # NATS away: the client's liveness check ends it
                log.warning("error_send_failed", request_id=req.request_id)

    async def _on_register(self, msg: RegisterGroup) -> RegisterAck:
        if msg.block_size < 1 or msg.num_blocks < 1:
            return RegisterAck(
                group_id=msg.group_id, accepted=False, error=ServiceError(message="empty KV cache pool")
            )
        requeued = self._remove_group(msg.group_id)
        refused = self.scheduler.add_group(msg.group_id, msg.num_blocks, msg.block_size)
        self._groups_lost = None
        log.info("group_registered", group_id=msg.group_id, num_blocks=msg.num_blocks,
                 block_size=msg.block_size, requeued=len(requeued), refused=len(refused))
        for req, error in refused:  # waited for a group, but too big for every pool
            await self._send_error(req, error)
        due = [req for req in self.scheduler.requests.values() if req.acceptance_due]  # routed now: they stay
        for req in due:
            req.acceptance_due = False
        await self._send_accepted(due)
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._kick()))
        return RegisterAck(group_id=msg.group_id, accepted=True, next_step_id=self.scheduler.next_step_id)

    async def _on_heartbeat(self, msg: Heartbeat) -> HeartbeatAck:
        """Note the group alive. A stopping group, or one whose step in flight was lost (see
        ``_steps_lost``), is dropped and its requests requeued (no blame: no request failed);
        the executor, told it is unknown, registers again with a clean state."""
        group = self.scheduler.groups.get(msg.group_id)
        if group is None:
            return HeartbeatAck(group_id=msg.group_id, known=False)
        now = time.monotonic()
        group.last_heartbeat = now
        if msg.stopping or self._steps_lost(msg, now):
            oldest = group.in_flight[0].plan.step_id if group.in_flight else None
            moved = self._remove_group(msg.group_id)
            if msg.stopping:
                log.info("group_stopped", group_id=msg.group_id, requeued=len(moved))
            else:
                log.warning("step_lost", group_id=msg.group_id, step_id=oldest, requeued=len(moved))
            reason = "executor group stopped" if msg.stopping else "executor step lost"
            self._note_groups_lost(ServiceError(message=reason, type="server_error", status=503))
            await self._kick()
            return HeartbeatAck(group_id=msg.group_id, known=False)
        return HeartbeatAck(group_id=msg.group_id, known=True)

    def _steps_lost(self, msg: Heartbeat, now: float) -> bool:
        """Whether the group's oldest step in flight is lost (NATS drops messages in transit
        when a connection or the server restarts). The executor has nothing queued or running
        (``idle``) and:
        - never received the step (``last_step_id`` below it) in two heartbeats in a row, the
          step sent before the first, so its plan had time to arrive: the plan was lost;
        - or received it, and the scheduler has not had its result for ``heartbeat_timeout_s``
          since an idle heartbeat first said so: the result was lost (a result still waiting
          in this process's backlog gets that long to be handled).
        """
        group_id = msg.group_id
        previous = self._idle_heartbeat_at.pop(group_id, None)
        group = self.scheduler.groups[group_id]
        if not msg.idle or not group.in_flight:
            self._unanswered_since.pop(group_id, None)
            return False
        self._idle_heartbeat_at[group_id] = now
        oldest = group.in_flight[0].plan.step_id
        if msg.last_step_id < oldest:
            self._unanswered_since.pop(group_id, None)
            sent = self._step_sent_at.get(group_id)
            return bool(sent) and previous is not None and sent[0] < previous
        step, since = self._unanswered_since.get(group_id, (None, now))
        if step != oldest:
            self._unanswered_since[group_id] = (oldest, now)
            return False
        return now - since > self.settings.heartbeat_timeout_s

    async def _on_result(self, result: StepResult) -> None:
        if not self.scheduler.is_in_flight(result.group_id, result.step_id):
            log.info("stale_step_result", group_id=result.group_id, step_id=result.step_id)
            return  # a dropped group's, or sent before it registered again
        sent = self._step_sent_at.get(result.group_id)
        if sent:
            sent.pop(0)
            if sent:  # the next step in flight started running only now
                sent[0] = max(sent[0], time.monotonic())
        if result.error is not None:
            log.error("step_failed", group_id=result.group_id, error=result.error.message)
            await self._fail_group(result.group_id, result.error)
            return
        outcome = self.scheduler.update_from_output(result)
        await self._kick()  # the executor computes the next step while the outputs go out
        await self._publish_outputs(outcome)
        for req in outcome.finished:
            log.info("request_finished", request_id=req.request_id, finish_reason=req.finish_reason,
                     output_tokens=len(req.output_token_ids), preemptions=req.num_preemptions)

    async def _on_requests_query(self, msg: RequestsQuery) -> RequestsKnown:
        held = self.scheduler.requests
        parents = {r.parent_request_id for r in held.values() if r.parent_request_id}
        return RequestsKnown(known=[rid for rid in msg.request_ids if rid in held or rid in parents])

    async def _on_stats_query(self, _: StatsQuery) -> SchedulerStats:
        return self.scheduler.stats()

    # ------------------------------------------------------------------ step loop

    async def _kick(self) -> None:
        """Send every group that has work and room in flight its next plans (one at a time, or
        with async scheduling up to two: the executor finds step N + 1 queued when it finishes
        step N)."""
        for group_id in list(self.scheduler.groups):
            while self.scheduler.can_schedule(group_id):
                plan = self.scheduler.schedule(group_id)
                if plan is None:
                    break
                self._step_sent_at.setdefault(group_id, []).append(time.monotonic())
                try:
                    await self.bus.publish(self.subjects.step(group_id), plan)
                except Exception as exc:  # too large, or NATS gone: the planned step never leaves
                    moved = self._remove_group(group_id)  # the executor registers again (heartbeat)
                    log.error("step_send_failed", group_id=group_id, step_id=plan.step_id,
                              error=repr(exc), requeued=len(moved))
                    self._note_groups_lost(ServiceError(message=f"sending a step failed: {exc!r}",
                                                        type="server_error", status=503))
                    # its requests may now be queued on a group this loop has already passed
                    asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._kick()))
                    break

    async def _publish_outputs(self, outcome: StepOutcome) -> None:
        shards: dict[int, DetokStep] = defaultdict(DetokStep)
        n = self.settings.num_detokenizer_shards
        for req in outcome.updated:
            step = shards[subj.detok_shard(req.request_id, n)]
            if not req.sent_to_detokenizer:
                p = req.sampling_params
                with_prompt_logprobs = req.needs_prompt_logprobs  # all of them came: sent once, here
                step.new_requests.append(
                    DetokNewRequest(
                        request_id=req.request_id,
                        gateway_id=req.gateway_id,
                        prompt_tail_ids=req.prompt_token_ids[-PROMPT_TAIL_TOKENS:],
                        num_prompt_tokens=req.num_prompt_tokens,
                        stop=p.stop,
                        include_stop_str_in_output=p.include_stop_str_in_output,
                        skip_special_tokens=p.skip_special_tokens,
                        min_tokens=p.min_tokens,
                        parent_request_id=req.parent_request_id,
                        index=req.index,
                        prompt_logprobs=PromptLogprobs(start=1, token_ids=req.prompt_token_ids[1:],
                                                       logprobs=req.prompt_logprobs) if with_prompt_logprobs else None,
                        first_prompt_token_id=req.prompt_token_ids[0] if with_prompt_logprobs else None,
                    )
                )
                req.sent_to_detokenizer, req.prompt_logprobs = True, []
            step.updates.append(
                TokenUpdate(
                    request_id=req.request_id,
                    new_token_ids=req.pending_output_ids,
                    finish_reason=req.finish_reason if req.is_finished else None,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=req.num_cached_tokens,
                    logprobs=req.pending_logprobs,
                )
            )
            req.pending_output_ids, req.pending_logprobs = [], []
        for shard, step in shards.items():
            await self.bus.publish(self.subjects.detok(shard), step)

    async def _send_error(self, req: Request, error: ServiceError) -> None:
        """The request's error, to its gateway; a sample of an n > 1 request is reported under
        the client's request id and its index, as its outputs are."""
        delta = RequestDelta(request_id=req.parent_request_id or req.request_id, index=req.index,
                             finished=True, finish_reason="error", error=error)
        await self.bus.publish(subj.gateway(req.gateway_id), GatewayStep(outputs=[delta]))

    def _remove_group(self, group_id: str) -> list[Request]:
        """Drop a group and its steps in flight (their results are then stale); returns its
        requests, routed again."""
        self._forget_steps(group_id)
        return self.scheduler.remove_group(group_id)

    def _forget_steps(self, group_id: str) -> None:
        """Drop what this service tracks about the group's steps in flight."""
        self._step_sent_at.pop(group_id, None)
        self._idle_heartbeat_at.pop(group_id, None)
        self._unanswered_since.pop(group_id, None)

    async def _fail_group(self, group_id: str, error: ServiceError) -> None:
        """A group failed a step: the step's culprit, if known, fails with the error
        (``Scheduler.fail_step``); the group is dropped and its other requests are requeued,
        for another group or for this one when it registers again (its executor does so at
        once after a failed step)."""
        self._forget_steps(group_id)
        failed, moved = self.scheduler.fail_step(group_id)
        for req in failed:
            await self._send_error(req, error)
        await self._release_detokenizer(failed)
        log.warning("group_dropped", group_id=group_id, requeued=len(moved), failed=len(failed),
                    reason=error.message)
        self._note_groups_lost(error)
        await self._kick()

    def _note_groups_lost(self, error: ServiceError) -> None:
        """Start the wait for a group to register again when the last one is gone."""
        if not self.scheduler.groups and self._groups_lost is None:
            self._groups_lost = (time.monotonic(), error)

    async def _fail_waiting_without_groups(self, now: float) -> None:
        """With no group for longer than ``heartbeat_timeout_s`` since the last one went, fail
        the waiting requests (those arriving later too) with its error rather than hang their
        clients; a registration ends this."""
        if self._groups_lost is None or self.scheduler.groups:
            return
        since, error = self._groups_lost
        if now - since <= self.settings.heartbeat_timeout_s or not self.scheduler.waiting:
            return
        unavailable = ServiceError(message=f"no executor group is available (the last one: {error.message})",
                                   type="server_error", code="no_executor", status=503)
        waiting = list(self.scheduler.waiting)
        await self._fail_requests([r.request_id for r in waiting], unavailable)
        log.warning("no_executor_group", failed=len(waiting), reason=error.message)

    async def _watchdog(self) -> None:
        """Drop groups whose heartbeat stopped or whose step never came back."""
        while True:
            await asyncio.sleep(min(0.5, self.settings.heartbeat_interval_s))
            now = time.monotonic()
            for group_id, group in list(self.scheduler.groups.items()):
                if now - group.last_heartbeat > self.settings.heartbeat_timeout_s:
                    moved = self._remove_group(group_id)
                    log.warning("group_heartbeat_lost", group_id=group_id, requeued=len(moved))
                    self._note_groups_lost(ServiceError(message="executor group lost", type="server_error", status=500))
                    await self._kick()
                    continue
                sent = self._step_sent_at.get(group_id)
                if sent and now - sent[0] > self.settings.step_timeout_s:  # the oldest step in flight
                    await self._fail_group(
                        group_id, ServiceError(message="executor step timed out", type="server_error", status=500))
            await self._fail_waiting_without_groups(now)

    async def _watch_peers(self) -> None:
        """Every ``heartbeat_timeout_s``, check the gateways and detokenizer shards of the
        requests held: a gateway gone has its requests aborted, so that they free their blocks
        instead of running to max_tokens for nobody; a detokenizer shard gone has its requests
        failed with a 503 ``request_lost`` (their outputs would go nowhere)."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_timeout_s)
            by_gateway: dict[str, list[str]] = defaultdict(list)
            by_shard: dict[int, list[str]] = defaultdict(list)
            n = self.settings.num_detokenizer_shards
            for req in self.scheduler.requests.values():
                by_gateway[req.gateway_id].append(req.request_id)
                by_shard[subj.detok_shard(req.request_id, n)].append(req.request_id)
            watched = {subj.gateway_ping(g) for g in by_gateway}
            watched |= {subj.ping(self.model_info.name, f"detokenizer.{shard}") for shard in by_shard}
            self._peer_misses = {s: k for s, k in self._peer_misses.items() if s in watched}
            try:
                for gateway_id, request_ids in by_gateway.items():
                    if await self._gone(subj.gateway_ping(gateway_id)):
                        aborted = await self._finish_requests(request_ids, "abort")
                        log.warning("gateway_lost", gateway_id=gateway_id, aborted=len(aborted))
                        await self._kick()
                for shard, request_ids in by_shard.items():
                    if await self._gone(subj.ping(self.model_info.name, f"detokenizer.{shard}")):
                        log.warning("detokenizer_lost", shard=shard, requests=len(request_ids))
                        await self._fail_requests(request_ids, ServiceError(
                            message=f"no detokenizer serves shard {shard} of this model; send the request again",
                            type="server_error", code="request_lost", status=503))
                        await self._kick()
            except Exception:  # never let one round end the watch for the scheduler's lifetime
                log.exception("peer_watch_failed")

    async def _gone(self, ping_subject: str) -> bool:
        """Whether nobody has answered on ``ping_subject`` twice in a row (NATS says there is
        no responder). Twice: a live peer reconnecting after a NATS blip has no subscription
        for a moment. A slow answer, or NATS away, is no verdict."""
        try:
            await self.bus.request(ping_subject, Ping(), Pong, timeout=2.0)
        except nats.errors.NoRespondersError:
            misses = self._peer_misses[ping_subject] = self._peer_misses.get(ping_subject, 0) + 1
            if misses >= 2:
                del self._peer_misses[ping_subject]
                return True
            return False
        except Exception:  # slow, or NATS away: ask again next time
            return False
        self._peer_misses.pop(ping_subject, None)
        return False

    async def _publish_stats(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.bus.publish(self.subjects.stats, self.scheduler.stats())
            except Exception:  # the bus reconnects by itself
                log.warning("stats_publish_failed")
