"""The scheduler service: the step loop of every executor group, over NATS.

recv (submit / abort / fail / register / heartbeat / grammar ready / step result) ->
``Scheduler`` (no I/O) -> send (``CompileGrammar`` for the grammars a group was asked for,
``StepPlan``s to every group with room in flight, one ``DetokStep`` per detokenizer shard,
errors to gateways: ``Outputs``). Each group steps independently, while the other
groups compute: with async scheduling it gets its next plan as soon as it has been sent the
previous one (two in flight), else when its last result arrives. The liveness policy (lost
steps, heartbeats, peers gone) is ``Liveness``; ``Watchdog`` (``watchdog.py``) carries out
its verdicts and watches the groups and the peers, through this service's ``WatchdogActions``
(``kick``, ``finish_requests``, ``fail_requests``, ``send_error``, ``release_detokenizer``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from services.scheduler.group import registration_error
from services.scheduler.liveness import Liveness, Verdict
from services.scheduler.outputs import Outputs
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.watchdog import Watchdog
from shared.bus import AnyMessage, Bus
from shared.config import Settings
from shared.logging import get_logger
from shared.messages import (
    AbortRequests,
    CompileGrammar,
    FailRequests,
    FinishReason,
    GrammarReady,
    Heartbeat,
    HeartbeatAck,
    RegisterAck,
    RegisterGroup,
    RequestsKnown,
    RequestsQuery,
    SchedulerStarted,
    SchedulerStats,
    ServiceError,
    StatsQuery,
    StepResult,
    SubmitRequest,
)
from shared.model_source import ModelInfo
from shared.service import BusService, Exclusive

log = get_logger(__name__)
PLAN_MARGIN_BYTES = 64 << 10  # of NATS max_payload, for plan fields Request.new_request_bytes omits


class SchedulerService(BusService):
    """Owns the ``Scheduler`` and drives it from NATS messages."""

    name = "scheduler"

    def __init__(self, settings: Settings, model_info: ModelInfo, bus: Bus | None = None) -> None:
        super().__init__(settings, model_info, bus)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                policy=settings.scheduling_policy,
                enable_prefix_caching=settings.enable_prefix_caching,
                async_scheduling=settings.async_scheduling,
            ),
            # above every step id a scheduler before this one planned (microseconds since the
            # epoch): an executor re-registering with this one drops the older plans it holds
            first_step_id=time.time_ns() // 1000,
        )
        self.liveness = Liveness(settings.heartbeat_timeout_s, settings.step_timeout_s,
                                 settings.executor_wait_timeout_s)
        self.outputs = Outputs(self.subjects, settings.num_detokenizer_shards)
        self.watchdog = Watchdog(self, self.scheduler, self.liveness, shard_of=self.outputs.shard,
                                 model=model_info.name, heartbeat_interval_s=settings.heartbeat_interval_s)
        self.stopping = False  # stop() began: no plan is sent any more (its requests are about to fail)
        self.instance_id = uuid.uuid4().hex

    def exclusive(self) -> Exclusive:
        return Exclusive(self.name, "scheduler")

    async def serve(self) -> None:
        s, b = self.subjects, self.bus
        # plans stay under the server's max_payload, with room for the fields not estimated
        max_payload = b.nc.max_payload
        self.scheduler.config = dataclasses.replace(
            self.scheduler.config, max_plan_bytes=max(max_payload // 2, max_payload - PLAN_MARGIN_BYTES))
        await self.subscribe(s.submit, SubmitRequest, self._on_submit)
        await self.subscribe(s.abort, AbortRequests, self._on_abort)
        await self.subscribe(s.fail, FailRequests, self._on_fail)
        await self.subscribe(s.register, RegisterGroup, self._on_register)
        await self.subscribe(s.heartbeat, Heartbeat, self._on_heartbeat)
        await self.subscribe(s.result, StepResult, self._on_result)
        await self.subscribe(s.grammar_ready, GrammarReady, self._on_grammar_ready)
        await self.subscribe(s.stats_get, StatsQuery, self._on_stats_query)
        await self.subscribe(s.requests_get, RequestsQuery, self._on_requests_query)
        for loop in (self.watchdog.watch_groups(), self._publish_stats(), self.watchdog.watch_peers(b)):
            self.spawn(loop)
        # the gateways resubmit what a scheduler before this one took with it
        await b.publish(s.scheduler_started, SchedulerStarted(instance_id=self.instance_id))

    async def start(self) -> None:
        await super().start()
        log.info("scheduler_started", model=self.model_info.name)

    async def stop(self) -> None:
        """Stop: messages still pending are handled (results, submits), but no plan goes out
        any more; then every request held fails (``on_stop``)."""
        self.stopping = True
        await super().stop()

    async def on_stop(self) -> None:
        """Every request still held fails at once with a 503 ``request_lost`` (its state goes
        with the scheduler), rather than when its client's liveness check notices; no new
        request is taken meanwhile (the subscriptions are drained)."""
        if not self.scheduler.requests:
            return
        await self.fail_requests(list(self.scheduler.requests), ServiceError(
            message="the scheduler stopped before this request finished; send it again",
            type="server_error", code="request_lost", status=503))
        try:
            await self.bus.flush()
        except Exception:  # NATS already gone: the clients' liveness checks end the requests
            log.warning("stop_notify_failed")

    # ------------------------------------------------------------------ handlers

    async def _on_submit(self, msg: SubmitRequest) -> None:
        req = Request.from_submit(msg, self.model_info.max_model_len, self.model_info.eos_token_ids, time.time())
        error = self.scheduler.add_request(req)
        if error is not None:
            log.info("request_rejected", request_id=req.request_id, reason=error.message)
            await self.send_error(req, error)
            return
        log.debug("request_queued", request_id=req.request_id, prompt_tokens=req.num_prompt_tokens)
        if msg.spec.notify_accepted:
            if self.scheduler.groups:
                await self._send(self.outputs.accepted([req]))
            else:  # a group registering may still refuse it (larger than its pool): say so then
                req.acceptance_due = True
        await self.kick()

    async def _on_abort(self, msg: AbortRequests) -> None:
        for req in await self.finish_requests(msg.request_ids, msg.reason):
            log.info("request_aborted", request_id=req.request_id, reason=msg.reason)
        await self.kick()

    async def _on_fail(self, msg: FailRequests) -> None:
        """A detokenizer lost these requests' state: their clients must hear it."""
        await self.fail_requests(msg.request_ids, msg.error)
        await self.kick()

    async def _on_register(self, msg: RegisterGroup) -> RegisterAck:
        if (error := registration_error(msg, self.model_info.name, self.model_info.max_model_len)) is not None:
            log.error("group_refused", group_id=msg.group_id, reason=error.message)
            return RegisterAck(group_id=msg.group_id, accepted=False, error=error)
        requeued = self.watchdog.remove_group(msg.group_id)
        refused = self.scheduler.add_group(msg.group_id, msg.num_blocks, msg.block_size)
        self.liveness.group_registered(msg.group_id, time.monotonic())
        log.info("group_registered", group_id=msg.group_id, num_blocks=msg.num_blocks,
                 block_size=msg.block_size, requeued=len(requeued), refused=len(refused))
        for req, error in refused:  # waited for a group, but too big for every pool
            await self.send_error(req, error)
        due = [req for req in self.scheduler.requests.values() if req.acceptance_due]  # routed now: they stay
        for req in due:
            req.acceptance_due = False
        await self._send(self.outputs.accepted(due))
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.kick()))
        return RegisterAck(group_id=msg.group_id, accepted=True, next_step_id=self.scheduler.next_step_id)

    async def _on_heartbeat(self, msg: Heartbeat) -> HeartbeatAck:
        """Note the group alive. A stopping group, or one whose step in flight was lost, is
        dropped (``Watchdog.drop_group``) and told it is unknown."""
        group = self.scheduler.groups.get(msg.group_id)
        if group is None:
            return HeartbeatAck(group_id=msg.group_id, known=False)
        oldest = group.in_flight[0].plan.step_id if group.in_flight else None
        verdict = self.liveness.heartbeat(msg.group_id, time.monotonic(), idle=msg.idle,
                                          last_step_id=msg.last_step_id, stopping=msg.stopping, oldest_step_id=oldest)
        if verdict is None:
            # a CompileGrammar or its answer lost (a NATS reconnect) only delays its requests
            await self._ask_grammars(msg.group_id, list(group.grammars_asked))
            return HeartbeatAck(group_id=msg.group_id, known=True)
        lost = {} if verdict is Verdict.GROUP_STOPPED else {"step_id": oldest, "lost": verdict.value}
        await self.watchdog.drop_group(msg.group_id, verdict, **lost)
        return HeartbeatAck(group_id=msg.group_id, known=False)

    async def _on_result(self, result: StepResult) -> None:
        if not self.scheduler.is_in_flight(result.group_id, result.step_id):
            log.info("stale_step_result", group_id=result.group_id, step_id=result.step_id)
            return  # a dropped group's, or sent before it registered again
        self.liveness.result_received(result.group_id, time.monotonic())
        if result.error is not None:
            log.error("step_failed", group_id=result.group_id, error=result.error.message)
            await self.watchdog.fail_group(result.group_id, result.error)
            return
        outcome = self.scheduler.update_from_output(result)
        await self.kick()  # the executor computes the next step while the outputs go out
        await self._send(self.outputs.detok_steps(outcome.updated))
        for req in outcome.finished:
            log.info("request_finished", request_id=req.request_id, finish_reason=req.finish_reason,
                     output_tokens=len(req.output_token_ids), preemptions=req.num_preemptions)

    async def _on_grammar_ready(self, msg: GrammarReady) -> None:
        """A group compiled a grammar: its requests waiting for it may start; or it does not
        compile: they fail with its error."""
        failed = self.scheduler.grammar_ready(msg.group_id, msg.key, msg.error)
        if msg.error is not None:
            log.warning("grammar_failed", group_id=msg.group_id, key=msg.key, requests=len(failed),
                        reason=msg.error.message)
            await self.fail_requests([r.request_id for r in failed], msg.error)
        await self.kick()

    async def _on_requests_query(self, msg: RequestsQuery) -> RequestsKnown:
        held = self.scheduler.requests
        parents = {r.parent_request_id for r in held.values() if r.parent_request_id}
        return RequestsKnown(known=[rid for rid in msg.request_ids if rid in held or rid in parents])

    async def _on_stats_query(self, _: StatsQuery) -> SchedulerStats:
        return self.scheduler.stats()

    # ------------------------------------------------------------------ actions

    async def kick(self) -> None:
        """Ask each group for the grammars its new requests wait for (``CompileGrammar``), then
        send every group that has work and room in flight its next plans (one at a time, or
        with async scheduling up to two: the executor finds step N + 1 queued when it finishes
        step N). Nothing once stopping."""
        if self.stopping:
            return
        for group_id, group in list(self.scheduler.groups.items()):
            keys, group.to_compile = group.to_compile, []
            await self._ask_grammars(group_id, keys)
        for group_id in list(self.scheduler.groups):
            while self.scheduler.can_schedule(group_id):
                plan = self.scheduler.schedule(group_id)
                if plan is None:
                    break
                self.liveness.step_sent(group_id, time.monotonic())
                try:
                    await self.bus.publish(self.subjects.step(group_id), plan)
                except Exception as exc:  # too large, or NATS gone: the planned step never leaves
                    moved = self.watchdog.remove_group(group_id)  # the executor registers again (heartbeat)
                    log.error("step_send_failed", group_id=group_id, step_id=plan.step_id,
                              error=repr(exc), requeued=len(moved))
                    self.watchdog.note_group_dropped(ServiceError(
                        message=f"sending a step failed: {exc!r}", type="server_error", status=503))
                    # its requests may now be queued on a group this loop has already passed
                    asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.kick()))
                    break

    async def _ask_grammars(self, group_id: str, keys: list[str]) -> None:
        """Publish a ``CompileGrammar`` per key still asked of the group (a lost one is asked
        again at the group's next heartbeat)."""
        group = self.scheduler.groups.get(group_id)
        for key in keys:
            if group is None or (params := group.grammars_asked.get(key)) is None:
                continue
            try:
                await self.bus.publish(self.subjects.compile(group_id),
                                       CompileGrammar(group_id=group_id, key=key, structured_outputs=params))
            except Exception as exc:  # NATS away: asked again at the next heartbeat
                log.warning("compile_ask_failed", group_id=group_id, key=key, error=repr(exc))

    async def _send(self, messages: dict[str, AnyMessage]) -> None:
        for subject, message in messages.items():
            await self.bus.publish(subject, message)

    async def send_error(self, req: Request, error: ServiceError) -> None:
        await self._send(self.outputs.error(req, error))

    async def release_detokenizer(self, reqs: list[Request]) -> None:
        """``Outputs.released``: the shards drop the text state of these requests."""
        try:
            await self._send(self.outputs.released(reqs))
        except Exception:  # NATS away: the state stays until that detokenizer restarts
            log.warning("detokenizer_release_failed", requests=len(reqs))

    async def finish_requests(self, request_ids: list[str], reason: FinishReason) -> list[Request]:
        """``Scheduler.abort`` (blocks free at once), then tell the detokenizer shards to drop
        the state of those they had. Returns the finished requests."""
        done = self.scheduler.abort(request_ids, reason)
        await self.release_detokenizer(done)
        return done

    async def fail_requests(self, request_ids: list[str], error: ServiceError) -> None:
        """Finish each of these requests still held, with every sample of its n > 1 request
        (the client's stream ends at the error), then send ``error`` to its gateway. Ids not
        held are ignored."""
        held = [self.scheduler.requests[rid] for rid in request_ids if rid in self.scheduler.requests]
        families = list(dict.fromkeys(req.parent_request_id or req.request_id for req in held))
        for req in await self.finish_requests(families, "error"):
            log.warning("request_failed", request_id=req.request_id, code=error.code, reason=error.message)
        for req in held:
            try:
                await self.send_error(req, error)
            except Exception:  # NATS away: the client's liveness check ends it
                log.warning("error_send_failed", request_id=req.request_id)

    # ------------------------------------------------------------------ loops

    async def _publish_stats(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.bus.publish(self.subjects.stats, self.scheduler.stats())
            except Exception:  # the bus reconnects by itself
                log.warning("stats_publish_failed")
