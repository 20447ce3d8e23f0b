"""The ``batch`` service: runs batches from JetStream through the engine (its own process,
``pagedllm service batch``; as many replicas as wanted).

Three loops, each on a durable JetStream consumer or the batches bucket (``store.py``):

- validation: takes a batch's creation notice, checks its input file (``validation.py``):
  a bad file fails the batch with errors naming the lines; else it queues every line and the
  batch goes ``in_progress``;
- work: takes lines, at most ``batch_max_in_flight`` at once per replica, and runs each
  through the gateway's ``OpenAIServing`` (the body a direct request would get), as
  *background* requests that the scheduler admits only after interactive ones and preempts
  first. A line's output is stored (``BatchStore.put_result``) before its message is
  acknowledged; a replica killed mid-line leaves it unacknowledged and JetStream delivers it
  again after ``batch_ack_wait_s`` (a running line says it is still in progress meanwhile),
  and a second result of the same line is dropped by JetStream's duplicate detection. A line
  the engine lost (a 5xx: an executor killed, no group left) is delivered again after a short
  delay, up to ``batch_max_attempts`` times, and only then stored as failed. Lines of a batch
  that is cancelling or past its window are acknowledged without running;
- monitor: every ``batch_monitor_interval_s`` updates each running batch's ``request_counts``,
  expires those past their window, and finalizes a batch once none of its lines is left on
  the work queue: the output and error files are written (ids derived from the batch id, so
  writing them twice is harmless) and the status set by compare-and-set.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig

from gateway.batch.lines import jsonl, run_line
from gateway.batch.objects import (
    Batch,
    BatchError,
    BatchErrors,
    BatchLineError,
    BatchRequestCounts,
    BatchRequestOutput,
    BatchWorkItem,
    new_id,
    now,
)
from gateway.batch.store import CREATED_SUBJECT, EVENTS_STREAM, WORK_STREAM, BatchStore, NotFound
from gateway.batch.validation import parse_batch_input
from gateway.serving import OpenAIServing
from shared.bus import Bus
from shared.config import Settings
from shared.engine_client import EngineClient
from shared.logging import get_logger
from shared.model_source import ModelInfo
from shared.service import BusService

log = get_logger(__name__)
STATUS_CACHE_S = 0.5  # how stale a worker's view of a batch's status may be
#: a line answered with one of these is run again (up to ``batch_max_attempts`` deliveries):
#: the engine lost it or could not take it, the request itself may be fine
RETRYABLE_STATUSES = (500, 502, 503, 504)
RENOTICE_AFTER_S = 30  # a batch still validating this long may have lost its creation notice
FINALIZE_TAKEOVER_S = 60  # a batch finalizing this long lost its replica: another one finishes it


class BatchService(BusService):
    """The ``batch`` service (see the module's docstring)."""

    name = "batch"

    def __init__(self, settings: Settings, model_info: ModelInfo, bus: Bus | None = None) -> None:
        super().__init__(settings, model_info, bus)
        self.store: BatchStore | None = None
        self.client: EngineClient | None = None
        self.serving: OpenAIServing | None = None
        self._slots = asyncio.Semaphore(settings.batch_max_in_flight)
        self._status: dict[str, tuple[float, Batch]] = {}
        self._running: set[asyncio.Task] = set()

    async def serve(self) -> None:
        assert self.bus is not None
        try:
            self.store = await asyncio.wait_for(BatchStore(self.bus.nc).setup(), 10)
        except Exception as exc:  # a NATS server without JetStream: nothing to do, but no failure
            log.warning("batch_api_unavailable", error=str(exc) or type(exc).__name__)
            return
        self.client = EngineClient(self.bus, self.model_info.name)
        await self.client.start()
        self.serving = OpenAIServing(self.settings, self.model_info, self.client, background=True)
        js = self.store.js
        self._events = await js.pull_subscribe(CREATED_SUBJECT, durable="batch-validate", stream=EVENTS_STREAM,
                                               config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=60.0))
        self._work = await js.pull_subscribe(
            "pagedllm.batch.work.*", durable="batch-work", stream=WORK_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.settings.batch_ack_wait_s,
                                  max_ack_pending=-1))
        self.spawn(self._forever("validate", self._validate_next))
        self.spawn(self._forever("work", self._work_next))
        self.spawn(self._forever("monitor", self._monitor_all))

    async def on_stop(self) -> None:
        for task in list(self._running):  # unacknowledged: delivered again to a replica
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        for sub in (getattr(self, "_events", None), getattr(self, "_work", None)):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:  # NATS gone: nothing to drain
                    pass
        if self.client is not None:
            await self.client.stop()

    async def _forever(self, what: str, step) -> None:
        """Run ``step()`` again and again; a failure (NATS away, JetStream busy) is logged and
        retried a second later, so no transient trouble ends the service."""
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as exc:
                log.warning("batch_loop_failed", loop=what, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1.0)

    # ---------------------------------------------------------------- validation

    async def _validate_next(self) -> None:
        """Validate the next created batch (acknowledged once done: a crash redoes it)."""
        for msg in await self._events.fetch(1, timeout=1.0):
            await self._validate(msg.data.decode())
            await msg.ack()

    async def _validate(self, batch_id: str) -> None:
        """Check the batch's input file; queue its lines (``in_progress``) or fail it. A file
        this service cannot handle fails its batch, never the service."""
        try:
            batch, _ = await self.store.get_batch(batch_id)
        except NotFound:
            return
        if batch.status != "validating":  # done before a crash, or cancelled meanwhile
            return
        try:
            data = await self.store.file_content(batch.input_file_id)
        except NotFound:
            items, errors = [], [BatchError(code="invalid_file", message=f"file {batch.input_file_id} was deleted",
                                            param="input_file_id")]
        else:
            limit = self.bus.nc.max_payload - 4096  # a queued line is one NATS message
            try:
                items, errors = await asyncio.to_thread(parse_batch_input, batch_id, data, batch.endpoint, limit)
            except Exception as exc:
                log.exception("batch_validation_crashed", batch_id=batch_id)
                items, errors = [], [BatchError(code="invalid_file", message=f"the input file could not be read: "
                                                f"{type(exc).__name__}")]
        if errors:
            def fail(b: Batch) -> Batch | None:
                if b.status != "validating":
                    return None
                return b.model_copy(update=dict(status="failed", failed_at=now(), errors=BatchErrors(data=errors)))
            await self.store.update_batch(batch_id, fail)
            log.info("batch_failed_validation", batch_id=batch_id, errors=len(errors))
            return
        await self.store.enqueue_work(items)

        def start(b: Batch) -> Batch | None:
            if b.status != "validating":
                return None
            return b.model_copy(update=dict(status="in_progress", in_progress_at=now(),
                                            request_counts=BatchRequestCounts(total=len(items))))
        await self.store.update_batch(batch_id, start)
        log.info("batch_started", batch_id=batch_id, lines=len(items))

    # ---------------------------------------------------------------- work

    async def _work_next(self) -> None:
        """Fetch as many lines as there are free slots (``batch_max_in_flight``), run each."""
        await self._slots.acquire()  # at least one free slot, then every other free one
        taken = 1
        while not self._slots.locked():
            await self._slots.acquire()
            taken += 1
        msgs = []
        try:
            msgs = await self._work.fetch(taken, timeout=1.0)
        finally:
            for _ in range(taken - len(msgs)):
                self._slots.release()
        for msg in msgs:
            task = asyncio.create_task(self._run(msg))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, msg) -> None:
        keepalive = asyncio.create_task(self._in_progress(msg))
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        try:
            item = BatchWorkItem.model_validate_json(msg.data)
            batch = await self._batch(item.batch_id)
            # "validating": its lines are queued only once the whole file passed, just before
            # the batch goes in_progress
            if batch is None or batch.status not in ("validating", "in_progress"):
                await msg.ack()  # cancelled or gone: not run
                return
            if batch.expires_at and now() >= batch.expires_at:  # as OpenAI: in the error file
                output = BatchRequestOutput(id=new_id("batch_req"), custom_id=item.custom_id, error=BatchLineError(
                    code="batch_expired", message="This request could not be executed before the completion "
                                                  "window expired."))
                await self.store.put_result(item.batch_id, item.line, output, False)
                await msg.ack()
                return
            output, ok = await run_line(self.serving, batch.endpoint, item.custom_id, item.body)
            status = output.response.status_code if output.response else 500
            if status in RETRYABLE_STATUSES and attempt < self.settings.batch_max_attempts:
                # the engine lost it (an executor gone, the server busy): run it again later
                log.info("batch_line_retried", batch_id=item.batch_id, line=item.line, status=status,
                         attempt=attempt)
                await msg.nak(delay=min(2.0 * attempt, 10.0))
                return
            await self.store.put_result(item.batch_id, item.line, output, ok)
            await msg.ack()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # NATS trouble or a bug: again later, then stored as failed
            log.exception("batch_line_failed", attempt=attempt)
            await self._give_up_or_retry(msg, attempt, exc)
        finally:
            keepalive.cancel()
            self._slots.release()

    async def _give_up_or_retry(self, msg, attempt: int, exc: Exception) -> None:
        """A line that raised: delivered again, or after ``batch_max_attempts`` stored as a 500."""
        try:
            if attempt < self.settings.batch_max_attempts:
                await msg.nak(delay=min(2.0 * attempt, 10.0))
                return
            item = BatchWorkItem.model_validate_json(msg.data)
            error = BatchLineError(code="server_error", message=f"the line failed {attempt} times: "
                                                                f"{type(exc).__name__}")
            await self.store.put_result(item.batch_id, item.line, BatchRequestOutput(
                id=new_id("batch_req"), custom_id=item.custom_id, error=error), False)
            await msg.ack()
        except Exception:  # NATS away: JetStream delivers it again after ack_wait
            log.warning("batch_line_left", attempt=attempt)

    async def _in_progress(self, msg) -> None:
        while True:
            await asyncio.sleep(self.settings.batch_ack_wait_s / 3)
            try:
                await msg.in_progress()
            except Exception:
                return

    async def _batch(self, batch_id: str) -> Batch | None:
        cached = self._status.get(batch_id)
        if cached is not None and time.monotonic() - cached[0] < STATUS_CACHE_S:
            return cached[1]
        try:
            batch, _ = await self.store.get_batch(batch_id)
        except NotFound:
            return None
        self._status[batch_id] = (time.monotonic(), batch)
        return batch

    # ---------------------------------------------------------------- monitor

    async def _monitor_all(self) -> None:
        await asyncio.sleep(self.settings.batch_monitor_interval_s)
        for batch in await self.store.list_batches():
            if batch.status in ("in_progress", "cancelling", "finalizing"):
                await self._monitor(batch)
            elif batch.status == "validating" and now() - batch.created_at > RENOTICE_AFTER_S:
                # its creation notice may never have been published (the gateway died between
                # storing the batch and publishing): again (a duplicate is dropped by JetStream)
                await self.store.notice_created(batch.id)

    async def _monitor(self, batch: Batch) -> None:
        """Counts of a running batch; its end once no line of it is left on the work queue."""
        if batch.status == "finalizing":  # another replica's job, unless it died at it
            if now() - (batch.finalizing_at or 0) > FINALIZE_TAKEOVER_S:
                claimed, won = await self.store.transition(batch.id, lambda b: b.model_copy(update=dict(
                    finalizing_at=now())) if b.status == "finalizing" and b.finalizing_at == batch.finalizing_at
                    else None)
                if won:
                    await self._finalize(claimed)
            return
        completed, failed = await self.store.result_counts(batch.id)
        if await self.store.remaining_work(batch.id):
            if (completed, failed) != (batch.request_counts.completed, batch.request_counts.failed):
                def count(b: Batch) -> Batch | None:
                    if b.status not in ("in_progress", "cancelling"):
                        return None
                    counts = b.request_counts
                    return b.model_copy(update=dict(request_counts=BatchRequestCounts(
                        total=counts.total, completed=max(completed, counts.completed),
                        failed=max(failed, counts.failed))))
                await self.store.update_batch(batch.id, count)
            return
        if batch.status == "in_progress":  # exactly one replica wins this compare-and-set
            batch, won = await self.store.transition(batch.id, lambda b: b.model_copy(update=dict(
                status="finalizing", finalizing_at=now())) if b.status == "in_progress" else None)
            if not won:
                return
        await self._finalize(batch)

    async def _finalize(self, batch: Batch) -> None:
        """Write the output and error files and end the batch: ``completed`` (from
        ``finalizing``; ``expired`` when it passed its window with lines unrun) or ``cancelled``."""
        ok, failed = await self.store.read_results(batch.id)
        suffix = batch.id.removeprefix("batch_")
        output_id = error_id = None
        if ok:
            output_id = (await self.store.put_file(f"{batch.id}_output.jsonl", "batch_output", jsonl(ok),
                                                   file_id=f"file-{suffix}-output")).id
        if failed:
            error_id = (await self.store.put_file(f"{batch.id}_error.jsonl", "batch_output", jsonl(failed),
                                                  file_id=f"file-{suffix}-error")).id
        expired = any(o.error is not None and o.error.code == "batch_expired" for o in failed)

        def end(b: Batch) -> Batch | None:
            if b.status not in ("finalizing", "cancelling"):
                return None
            final = "cancelled" if b.status == "cancelling" else "expired" if expired else "completed"
            stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[final]
            counts = BatchRequestCounts(total=b.request_counts.total, completed=len(ok), failed=len(failed))
            return b.model_copy(update={"status": final, stamp: now(), "output_file_id": output_id,
                                        "error_file_id": error_id, "request_counts": counts})
        batch = await self.store.update_batch(batch.id, end)
        self._status.pop(batch.id, None)
        log.info("batch_finished", batch_id=batch.id, status=batch.status, completed=len(ok), failed=len(failed))
