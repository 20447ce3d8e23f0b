"""The executor service: one executor group over NATS.

It loads the model, allocates the paged KV cache, registers with the scheduler (retrying
until the scheduler answers), heartbeats, and runs each ``StepPlan`` it receives in order,
answering with a ``StepResult``. It never allocates blocks: it writes and reads exactly the
blocks the plan names.

With ``tensor_parallel_size`` N > 1 it is rank 0 of the group: it starts ranks 1..N-1 as child
processes (unless ``tensor_parallel_rank`` says the ranks are started by hand), drives them
(``tp_group/ranks.py``) and ends when one of them does (``tp_group/rank_zero.py``: forming,
watching and stopping the ranks): a group missing a rank cannot run a step, so the scheduler
is told the group stops and recomputes its requests elsewhere.
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor

import nats.errors

from services.executor.model_runner import ModelRunner
from services.executor.tp_group.rank_zero import RankZero
from services.executor.tp_group.ranks import TensorParallelDriver
from shared.bus import Bus, RemoteError
from shared.config import Settings
from shared.logging import get_logger
from shared.messages import (
    CompileGrammar,
    GrammarReady,
    Heartbeat,
    HeartbeatAck,
    RegisterAck,
    RegisterGroup,
    ServiceError,
    StepPlan,
    StepResult,
)
from shared.model_source import ModelInfo
from shared.service import BusService, Exclusive, FatalServiceError
from shared.structured_output import StructuredOutputError

log = get_logger(__name__)


def default_group_id() -> str:
    """A group id unique per process: ``<hostname>-<pid>`` (replicas of a compose service
    each get their own)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{socket.gethostname()}-{os.getpid()}")


class ExecutorState(enum.Enum):
    """Where an executor stands with the scheduler."""

    REGISTERING = "registering"  # the first registration: plans wait; pings on "executor" not answered yet
    SERVING = "serving"  # registered: plans run in arrival order
    # the scheduler dropped the group (a failed step, or a heartbeat's answer) while a plan was
    # held: register again once done with it
    REJOIN_PENDING = "rejoin_pending"
    # registering again with no request state: plans wait, then those planned for the previous
    # registration are dropped (step id below RegisterAck.next_step_id)
    REJOINING = "rejoining"
    STOPPING = "stopping"


class ExecutorService(BusService):
    """Runs the model for one executor group (``settings.group_id``).

    ``state`` says where it stands with the scheduler (``ExecutorState``); ``wait_registered``
    returns once it serves.
    """

    name = "executor"

    def __init__(self, settings: Settings, model_info: ModelInfo, bus: Bus | None = None) -> None:
        super().__init__(settings, model_info, bus)
        self.group_id = settings.group_id or default_group_id()
        self.runner: ModelRunner | TensorParallelDriver | None = None
        self.tp_size = settings.tensor_parallel_size
        self.rank_zero: RankZero | None = None  # the group's other ranks, when tp_size > 1
        # Every torch call runs on this one thread: OpenMP keeps one thread team per calling
        # thread, and teams of several threads spin against each other on a small CPU.
        self._torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-torch")
        self._plans: asyncio.Queue[StepPlan] = asyncio.Queue()  # received, run in order by _run_steps
        self.state = ExecutorState.REGISTERING
        self._serving = asyncio.Event()  # set exactly while SERVING: plans wait on it
        self._first_step_id = 0  # of this registration (RegisterAck.next_step_id): older plans are stale
        self._last_step_id = 0  # the newest plan received (Heartbeat.last_step_id)
        self._held_step_id: int | None = None  # the plan _run_steps holds (waiting to run, or running)
        self._compiling: dict[str, asyncio.Task] = {}  # grammar key -> its CompileGrammar being answered

    @property
    def connection_name(self) -> str:
        return f"{self.name}-{self.group_id}"

    def exclusive(self) -> Exclusive:
        return Exclusive(f"{self.name}.{self.group_id}", f"executor of group {self.group_id!r}",
                         advice="give each executor its own --group-id (PAGEDLLM_GROUP_ID)")

    def ping_names(self) -> tuple[str, ...]:
        # answered from now on (registered or not, re-registering included): a second executor
        # of this group id would take this group's steps too; "executor" once registered
        return (f"{self.name}.{self.group_id}",)

    async def load(self) -> None:
        """Load the model (this rank's part of it, the other ranks started first).

        Raises:
            ValueError: the model's heads cannot be split over ``tensor_parallel_size`` ranks;
                ``tensor_parallel_rank`` >= 1 (that rank runs as ``pagedllm service executor``).
            FatalServiceError: a rank process exited while the group was forming.
        """
        loop = asyncio.get_running_loop()
        if self.tp_size == 1:
            self.runner = await loop.run_in_executor(self._torch_thread, ModelRunner, self.settings, self.model_info)
            return
        self.rank_zero = RankZero(self.settings, self.model_info, self.group_id, self._torch_thread)
        self.runner = await self.rank_zero.form()
        self.spawn(self.rank_zero.watch())  # keep-alives from now on: the ranks wait for rank 0

    async def serve(self) -> None:
        await self.subscribe(self.subjects.step(self.group_id), StepPlan, self._on_step)
        await self.subscribe(self.subjects.compile(self.group_id), CompileGrammar, self._on_compile)

    async def start(self) -> None:
        """Load the model, connect (if needed), serve the group's step subject and start
        registering with the scheduler.

        Raises:
            ServiceConflictError: another executor already serves this group id (both would
                run every step and answer it twice).
        """
        await super().start()
        self.spawn(self._register_and_heartbeat())
        self.spawn(self._run_steps())

    async def stop(self) -> None:
        """Tell the scheduler the group is going (its requests are requeued at once rather
        than after ``heartbeat_timeout_s``), then stop."""
        registered = self.state in (ExecutorState.SERVING, ExecutorState.REJOIN_PENDING)
        self._enter(ExecutorState.STOPPING)
        if registered and self.bus is not None:
            try:
                await self.bus.request(self.subjects.heartbeat, Heartbeat(group_id=self.group_id, stopping=True),
                                       HeartbeatAck, timeout=1.0)
            except Exception:  # no scheduler, or NATS gone: its watchdog notices the silence
                pass
        await super().stop()
        for task in list(self._compiling.values()):  # their GrammarReady would go nowhere
            task.cancel()
        self._compiling.clear()
        if self.runner is not None:  # the grammar threads: queued compiles and masks cancelled
            self.runner.structured.close()
        if self.rank_zero is not None:  # the other ranks exit
            await self.rank_zero.stop()
        self._torch_thread.shutdown(wait=False)

    async def wait_registered(self) -> None:
        """Return once the group is registered and runs its plans (``ExecutorState.SERVING``)."""
        await self._serving.wait()

    def _enter(self, state: ExecutorState) -> None:
        self.state = state
        if state is ExecutorState.SERVING:
            self._serving.set()
        else:
            self._serving.clear()

    async def _register(self) -> None:
        """Register with the scheduler, retrying until it answers.

        Raises:
            FatalServiceError: the scheduler refused the group (an empty pool, or another model
                or ``max_model_len`` than the scheduler's): the service ends (``run_service``).
        """
        msg = RegisterGroup(
            group_id=self.group_id,
            model=self.model_info.name,
            num_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            max_model_len=self.model_info.max_model_len,
        )
        while True:
            try:
                ack = await self.bus.request(self.subjects.register, msg, RegisterAck, timeout=2.0)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                await asyncio.sleep(0.2)
                continue
            except RemoteError as exc:  # the scheduler's handler failed: try again, at a timeout's pace
                log.warning("group_register_failed", group_id=self.group_id, error=exc.error.message)
                await asyncio.sleep(2.0)
                continue
            if not ack.accepted:
                raise FatalServiceError(f"scheduler refused group {self.group_id}: "
                                        f"{ack.error.message if ack.error else 'no reason given'}")
            if self.state is ExecutorState.STOPPING:
                return
            log.info("group_registered", group_id=self.group_id, num_blocks=msg.num_blocks)
            self._first_step_id = ack.next_step_id
            if self.state is ExecutorState.REGISTERING:  # the first time: ready to serve
                await self.answer_pings(self.name)
            self._enter(ExecutorState.SERVING)
            return

    async def _register_and_heartbeat(self) -> None:
        await self._register()
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self._heartbeat()

    async def _heartbeat(self) -> None:
        """Say we are alive; if the scheduler no longer knows the group (it dropped it after a
        step timed out, or it restarted), register again, after the running step if any."""
        msg = Heartbeat(group_id=self.group_id, idle=self._plans.empty() and self._held_step_id is None,
                        last_step_id=self._last_step_id)
        try:
            ack = await self.bus.request(self.subjects.heartbeat, msg, HeartbeatAck,
                                         timeout=max(1.0, self.settings.heartbeat_interval_s))
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, RemoteError):
            return  # the scheduler is busy or away: its own watchdog decides
        if ack.known or self.state is not ExecutorState.SERVING:
            return
        holding = self._held_step_id is not None
        log.warning("group_unknown_to_scheduler", group_id=self.group_id, holding_plan=holding)
        if holding:  # _run_steps rejoins once done with it
            self._enter(ExecutorState.REJOIN_PENDING)
        else:
            await self._start_rejoin()

    async def _start_rejoin(self) -> None:
        """Forget every request (the scheduler recomputes them; on every rank) and register again."""
        self._enter(ExecutorState.REJOINING)
        await asyncio.get_running_loop().run_in_executor(self._torch_thread, self.runner.reset)
        self.spawn(self._register())

    async def _on_step(self, plan: StepPlan) -> None:
        self._last_step_id = max(self._last_step_id, plan.step_id)
        self._plans.put_nowait(plan)

    async def _on_compile(self, msg: CompileGrammar) -> None:
        """Compile a grammar on the structured-output worker thread, off the step loop, and
        answer ``GrammarReady`` when done (a repeat while it compiles is ignored)."""
        if msg.key not in self._compiling:
            self._compiling[msg.key] = asyncio.ensure_future(self._compile_grammar(msg))

    async def _compile_grammar(self, msg: CompileGrammar) -> None:
        error = None
        try:
            await asyncio.wrap_future(self.runner.structured.prepare(msg.structured_outputs))
        except StructuredOutputError as exc:
            error = ServiceError(message=str(exc), param=exc.param)
        except Exception as exc:  # the tokenizer's backend failed to load, ...
            log.exception("grammar_compile_failed", key=msg.key)
            error = ServiceError(message=f"compiling the structured output grammar failed: {exc}",
                                 type="server_error", status=500)
        finally:
            self._compiling.pop(msg.key, None)
        try:
            await self.bus.publish(self.subjects.grammar_ready, GrammarReady(group_id=self.group_id, key=msg.key,
                                                                             error=error))
        except Exception as exc:  # NATS away: the scheduler asks again at a heartbeat
            log.warning("grammar_ready_send_failed", key=msg.key, error=repr(exc))

    async def _run_steps(self) -> None:
        """Run the received plans one at a time, in order. While the group registers again
        after a failed step, plans wait; then those planned for the previous registration
        (async scheduling keeps one more in flight; its requests are gone on both sides)
        are dropped by step id, which does not depend on what arrives first, the
        registration's answer or the new registration's first plan."""
        while True:
            plan = await self._plans.get()
            self._held_step_id = plan.step_id
            try:
                await self._serving.wait()
                if plan.step_id >= self._first_step_id:
                    await self._execute(plan)
                else:
                    log.info("stale_step_dropped", step_id=plan.step_id, first_step_id=self._first_step_id)
            finally:
                self._held_step_id = None
            # the step failed, or the scheduler dropped the group meanwhile: start clean and join
            # again (its requests are recomputed)
            if self.state is ExecutorState.REJOIN_PENDING:
                await self._start_rejoin()

    async def _execute(self, plan: StepPlan) -> None:
        """Run one plan on the torch thread and publish its result (a failure as an error
        result, after which the group registers again)."""
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
        await self.bus.publish(self.subjects.result, result)
        if result.error is not None and self.tp_size > 1:  # the ranks may be anywhere in the step
            raise FatalServiceError(f"tensor-parallel group {self.group_id} failed a step: {result.error.message}")
        if result.error is not None and self.state is not ExecutorState.STOPPING:  # the scheduler drops us
            self._enter(ExecutorState.REJOIN_PENDING)
