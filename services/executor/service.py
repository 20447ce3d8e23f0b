"""The executor service: one executor group (tensor-parallel size 1) over NATS.

It loads the model, allocates the paged KV cache, registers with the scheduler (retrying
until the scheduler answers), heartbeats, and runs each ``StepPlan`` it receives in order,
answering with a ``StepResult``. It never allocates blocks: it writes and reads exactly the
blocks the plan names.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import nats.errors
import structlog

from services.executor.model_runner import ModelRunner
from shared.bus import Bus
from shared.config import Settings
from shared.messages import (
    Heartbeat,
    HeartbeatAck,
    RegisterAck,
    RegisterGroup,
    ServiceError,
    StepPlan,
    StepResult,
)
from shared.model_source import ModelInfo
from shared.service import answer_pings, refuse_if_served
from shared.subjects import Subjects

log = structlog.get_logger("executor")


def default_group_id() -> str:
    """A group id unique per process: ``<hostname>-<pid>`` (replicas of a compose service
    each get their own)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{socket.gethostname()}-{os.getpid()}")


class ExecutorService:
    """Runs the model for one executor group (``settings.group_id``)."""

    name = "executor"

    def __init__(self, settings: Settings, model_info: ModelInfo, bus: Bus | None = None) -> None:
        self.settings = settings
        self.model_info = model_info
        self.subjects = Subjects(model_info.name)
        self.group_id = settings.group_id or default_group_id()
        self.bus = bus
        self._own_bus = bus is None
        self.runner: ModelRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self.registered = asyncio.Event()
        # Every torch call runs on this one thread: OpenMP keeps one thread team per calling
        # thread, and teams of several threads spin against each other on a small CPU.
        self._torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-torch")
        self._pinging = False
        self._plans: asyncio.Queue[StepPlan] = asyncio.Queue()  # received, run in order by _run_steps
        self._first_step_id = 0  # of this registration (RegisterAck.next_step_id): older plans are stale
        self._holding_plan = False  # _run_steps took a plan and has not finished with it
        self._last_step_id = 0  # the newest plan received (Heartbeat.last_step_id)
        self._rejoin = False  # register again once the running step is done (the scheduler dropped us)

    async def start(self) -> None:
        """Load the model, connect (if needed), serve the group's step subject and start
        registering with the scheduler.

        Raises:
            ServiceConflictError: another executor already serves this group id (both would
                run every step and answer it twice).
        """
        loop = asyncio.get_running_loop()
        self.runner = await loop.run_in_executor(self._torch_thread, ModelRunner, self.settings, self.model_info)
        if self.bus is None:
            self.bus = await Bus.connect(self.settings.nats_url, name=f"executor-{self.group_id}")
        group_ping = f"{self.name}.{self.group_id}"
        await refuse_if_served(self.bus, self.model_info.name, group_ping, f"executor of group {self.group_id!r}",
                               advice="give each executor its own --group-id (PAGEDLLM_GROUP_ID)")
        await self.bus.subscribe(self.subjects.step(self.group_id), StepPlan, self._on_step)
        # answered from now on (registered or not, re-registering included): a second executor
        # of this group id would take this group's steps too
        await answer_pings(self.bus, self.model_info.name, group_ping)
        self._tasks = [asyncio.create_task(self._register_and_heartbeat()), asyncio.create_task(self._run_steps())]

    async def stop(self) -> None:
        """Tell the scheduler the group is going (its requests are requeued at once rather
        than after ``heartbeat_timeout_s``), then stop."""
        if self.registered.is_set() and self.bus is not None:
            try:
                await self.bus.request(self.subjects.heartbeat,
                                       Heartbeat(group_id=self.group_id, time=time.time(), stopping=True),
                                       HeartbeatAck, timeout=1.0)
            except Exception:  # no scheduler, or NATS gone: its watchdog notices the silence
                pass
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._own_bus and self.bus is not None:
            await self.bus.close()
        self._torch_thread.shutdown(wait=False)

    async def _register(self) -> None:
        msg = RegisterGroup(
            group_id=self.group_id,
            model=self.model_info.name,
            num_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            tensor_parallel_size=1,
            max_model_len=self.model_info.max_model_len,
        )
        while True:
            try:
                ack = await self.bus.request(self.subjects.register, msg, RegisterAck, timeout=2.0)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                await asyncio.sleep(0.2)
                continue
            if not ack.accepted:
                raise RuntimeError(f"scheduler refused group {self.group_id}: {ack.error}")
            log.info("group_registered", group_id=self.group_id, num_blocks=msg.num_blocks)
            self._first_step_id = ack.next_step_id
            if not self.registered.is_set() and not self._pinging:
                self._pinging = True
                await answer_pings(self.bus, self.model_info.name, self.name)
            self.registered.set()
            return

    async def _register_and_heartbeat(self) -> None:
        await self._register()
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self._heartbeat()

    async def _heartbeat(self) -> None:
        """Say we are alive; if the scheduler no longer knows the group (it dropped it after a
        step timed out, or it restarted), register again, after the running step if any."""
        msg = Heartbeat(group_id=self.group_id, time=time.time(),
                        idle=self._plans.empty() and not self._holding_plan, last_step_id=self._last_step_id)
        try:
            ack = await self.bus.request(self.subjects.heartbeat, msg, HeartbeatAck,
                                         timeout=max(1.0, self.settings.heartbeat_interval_s))
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return  # the scheduler is busy or away: its own watchdog decides
        if ack.known or not self.registered.is_set():
            return
        log.warning("group_unknown_to_scheduler", group_id=self.group_id, holding_plan=self._holding_plan)
        if self._holding_plan:  # _run_steps rejoins once done with it
            self._rejoin = True
        else:
            self._start_rejoin()

    def _start_rejoin(self) -> None:
        """Forget every request (the scheduler recomputes them) and register again."""
        self._rejoin = False
        self.runner.requests.clear()
        self.registered.clear()
        self._tasks.append(asyncio.create_task(self._register()))

    async def _on_step(self, plan: StepPlan) -> None:
        self._last_step_id = max(self._last_step_id, plan.step_id)
        self._plans.put_nowait(plan)

    async def _run_steps(self) -> None:
        """Run the received plans one at a time, in order. While the group registers again
        after a failed step, plans wait; then those planned for the previous registration
        (async scheduling keeps one more in flight; its requests are gone on both sides)
        are dropped by step id, which does not depend on what arrives first, the
        registration's answer or the new registration's first plan."""
        while True:
            plan = await self._plans.get()
            self._holding_plan = True
            try:
                await self.registered.wait()
                if plan.step_id >= self._first_step_id:
                    await self._execute(plan)
                else:
                    log.info("stale_step_dropped", step_id=plan.step_id, first_step_id=self._first_step_id)
            finally:
                self._holding_plan = False
            if self._rejoin:  # the step failed, or the scheduler dropped the group meanwhile:
                self._start_rejoin()  # start clean and join again (its requests are recomputed)

    async def _execute(self, plan: StepPlan) -> None:
        """Run one plan on the torch thread and publish its result (a failure as an error
        result, after which the group registers again)."""
        t0 = time.perf_counter()
        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._torch_thread, self.runner.execute, plan)
        except Exception as exc:  # the scheduler drops the group and requeues its requests
            log.exception("step_failed", step_id=plan.step_id)
            result = StepResult(
                step_id=plan.step_id,
                group_id=self.group_id,
                error=ServiceError(message=f"executor step failed: {exc}", type="server_error", status=500),
            )
        result.execute_time_s = time.perf_counter() - t0
        await self.bus.publish(self.subjects.result, result)
        if result.error is not None:  # the scheduler drops this group
            self._rejoin = True
