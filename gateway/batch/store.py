"""Where files and batches live: NATS JetStream, through nats-py.

- files: their ``FileObject`` in the key-value bucket ``pagedllm_files``, their bytes in the
  object store ``pagedllm_file_data``, both under the file id;
- batches: their ``Batch`` in the key-value bucket ``pagedllm_batches``, every change a
  compare-and-set on the entry's revision (:meth:`BatchStore.update_batch`), so concurrent
  gateways and batch services never overwrite each other;
- work: a batch's creation notice on the work-queue stream ``PAGEDLLM_BATCH_EVENTS``, each of
  its lines a message on the work-queue stream ``PAGEDLLM_BATCH_WORK`` (subject
  ``pagedllm.batch.work.<batch id>``), read by the batch services' durable pull consumers and
  removed once acknowledged, so the messages left for a batch are exactly its lines not yet
  done (:meth:`BatchStore.remaining_work`);
- results: one message per line on the stream ``PAGEDLLM_BATCH_RESULTS`` (subject
  ``pagedllm.batch.result.<batch id>.ok|error``) published with the message id ``<batch
  id>:<line>``: JetStream drops a second publication of the same line within its
  duplicate window (24 h, the completion window), so a line redelivered after a crash is
  stored once, and the per-subject counts are the batch's ``request_counts``.

All of it is on file storage: a batch survives a restart of nats-server, and of every service.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from gateway.batch.objects import Batch, BatchRequestOutput, BatchWorkItem, FileObject, new_id, now

FILES_BUCKET, DATA_BUCKET, BATCHES_BUCKET = "pagedllm_files", "pagedllm_file_data", "pagedllm_batches"
EVENTS_STREAM, WORK_STREAM, RESULTS_STREAM = "PAGEDLLM_BATCH_EVENTS", "PAGEDLLM_BATCH_WORK", "PAGEDLLM_BATCH_RESULTS"
CREATED_SUBJECT = "pagedllm.batch.created"
DEDUP_WINDOW_S = 24 * 3600.0
# a key that is not there, deleted, or not a valid key (an id no store would make)
_MISSING = (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError, nats.js.errors.InvalidKeyError)


def work_subject(batch_id: str) -> str:
    return f"pagedllm.batch.work.{batch_id}"


def result_subject(batch_id: str, ok: bool) -> str:
    return f"pagedllm.batch.result.{batch_id}.{'ok' if ok else 'error'}"


class NotFound(KeyError):
    """No file or batch of that id."""


class BatchStore:
    """The JetStream buckets and streams of the Files and Batch API (see the module's docstring).

    Raises (every method): ``nats.js.errors.ServiceUnavailableError`` / ``NoRespondersError``
    when the NATS server has no JetStream.
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.js = nc.jetstream()

    async def setup(self) -> BatchStore:
        """Create (or open) every bucket and stream; idempotent, so any process may call it."""
        self.files = await self.js.create_key_value(KeyValueConfig(bucket=FILES_BUCKET, storage=StorageType.FILE))
        self.batches = await self.js.create_key_value(KeyValueConfig(bucket=BATCHES_BUCKET, storage=StorageType.FILE))
        self.data = await self.js.create_object_store(DATA_BUCKET, ObjectStoreConfig(storage=StorageType.FILE))
        for name, subjects, retention in (
            (EVENTS_STREAM, [CREATED_SUBJECT], RetentionPolicy.WORK_QUEUE),
            (WORK_STREAM, ["pagedllm.batch.work.*"], RetentionPolicy.WORK_QUEUE),
            (RESULTS_STREAM, ["pagedllm.batch.result.*.*"], RetentionPolicy.LIMITS),
        ):
            config = StreamConfig(name=name, subjects=subjects, retention=retention, storage=StorageType.FILE,
                                  duplicate_window=DEDUP_WINDOW_S)
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:  # exists with another config: take ours
                await self.js.update_stream(config)
        return self

    # ---------------------------------------------------------------- files

    async def put_file(self, filename: str, purpose: str, data: bytes, file_id: str | None = None) -> FileObject:
        """Store ``data`` as a new file (or as ``file_id``, replacing it: a batch's output)."""
        file = FileObject(id=file_id or new_id("file"), bytes=len(data), created_at=now(), filename=filename,
                          purpose=purpose)
        await self.data.put(file.id, data)
        await self.files.put(file.id, file.model_dump_json().encode())
        return file

    async def get_file(self, file_id: str) -> FileObject:
        """Raises: NotFound."""
        try:
            entry = await self.files.get(file_id)
        except _MISSING:
            raise NotFound(file_id) from None
        return FileObject.model_validate_json(entry.value)

    async def file_content(self, file_id: str) -> bytes:
        """Raises: NotFound."""
        await self.get_file(file_id)
        try:
            return (await self.data.get(file_id)).data or b""
        except nats.js.errors.ObjectNotFoundError:
            raise NotFound(file_id) from None

    async def list_files(self, purpose: str | None = None) -> list[FileObject]:
        """Every file (of ``purpose``), newest first."""
        files = []
        for key in await self._keys(FILES_BUCKET):
            try:
                files.append(await self.get_file(key))
            except NotFound:  # deleted meanwhile
                continue
        return sorted((f for f in files if purpose is None or f.purpose == purpose),
                      key=lambda f: (f.created_at, f.id), reverse=True)

    async def delete_file(self, file_id: str) -> None:
        """Raises: NotFound."""
        await self.get_file(file_id)
        try:
            await self.data.delete(file_id)
        except nats.js.errors.ObjectNotFoundError:
            pass
        await self.files.delete(file_id)

    # ---------------------------------------------------------------- batches

    async def create_batch(self, batch: Batch) -> None:
        """Store a new batch and queue its validation (by a batch service)."""
        await self.batches.create(batch.id, batch.model_dump_json().encode())
        await self.notice_created(batch.id)

    async def notice_created(self, batch_id: str) -> None:
        """Queue the batch's validation (once per duplicate window, however often called)."""
        await self.js.publish(CREATED_SUBJECT, batch_id.encode(), headers={"Nats-Msg-Id": f"created:{batch_id}"})

    async def get_batch(self, batch_id: str) -> tuple[Batch, int]:
        """The batch and its entry's revision. Raises: NotFound."""
        try:
            entry = await self.batches.get(batch_id)
        except _MISSING:
            raise NotFound(batch_id) from None
        return Batch.model_validate_json(entry.value), entry.revision

    async def update_batch(self, batch_id: str, change: Callable[[Batch], Batch | None]) -> Batch:
        """Compare-and-set: apply ``change`` to the current batch and store the result if nobody
        changed the batch meanwhile, else read it again and retry. ``change`` returning None
        leaves the batch as it is. Returns the batch as stored. Raises: NotFound."""
        batch, _ = await self.transition(batch_id, change)
        return batch

    async def transition(self, batch_id: str, change: Callable[[Batch], Batch | None]) -> tuple[Batch, bool]:
        """:meth:`update_batch`, also saying whether ``change`` was applied (this caller won)."""
        while True:
            batch, revision = await self.get_batch(batch_id)
            changed = change(batch.model_copy(deep=True))
            if changed is None:
                return batch, False
            try:
                await self.batches.update(batch_id, changed.model_dump_json().encode(), last=revision)
                return changed, True
            except nats.js.errors.KeyWrongLastSequenceError:
                continue

    async def list_batches(self) -> list[Batch]:
        """Every batch, newest first."""
        batches = []
        for key in await self._keys(BATCHES_BUCKET):
            try:
                batches.append((await self.get_batch(key))[0])
            except NotFound:
                continue
        return sorted(batches, key=lambda b: (b.created_at, b.id), reverse=True)

    # ---------------------------------------------------------------- work and results

    async def enqueue_work(self, items: list[BatchWorkItem]) -> None:
        """Queue a batch's lines; queuing a line twice (validation run again after a crash)
        stores it once (message id ``<batch id>:<line>``)."""
        for item in items:
            await self.js.publish(work_subject(item.batch_id), item.model_dump_json().encode(),
                                  headers={"Nats-Msg-Id": f"{item.batch_id}:{item.line}"})

    async def remaining_work(self, batch_id: str) -> int:
        """Lines of the batch not yet acknowledged (queued or being worked on)."""
        info = await self.js.stream_info(WORK_STREAM, subjects_filter=work_subject(batch_id))
        return (info.state.subjects or {}).get(work_subject(batch_id), 0)

    async def put_result(self, batch_id: str, line: int, output: BatchRequestOutput, ok: bool) -> None:
        """Store one line's output (once per line within the duplicate window; the line number,
        not the ``custom_id``, keys it: NATS headers cannot carry every string)."""
        payload = json.dumps({"line": line, "output": output.model_dump(mode="json")}).encode()
        await self.js.publish(result_subject(batch_id, ok), payload,
                              headers={"Nats-Msg-Id": f"result:{batch_id}:{line}"})

    async def result_counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines of the batch."""
        info = await self.js.stream_info(RESULTS_STREAM, subjects_filter=f"pagedllm.batch.result.{batch_id}.*")
        subjects = info.state.subjects or {}
        return subjects.get(result_subject(batch_id, True), 0), subjects.get(result_subject(batch_id, False), 0)

    async def read_results(self, batch_id: str) -> tuple[list[BatchRequestOutput], list[BatchRequestOutput]]:
        """The batch's (successful, failed) outputs, each in input-file order, one per line."""
        completed, failed = await self.result_counts(batch_id)
        total = completed + failed
        lines: dict[int, tuple[int, bool, BatchRequestOutput]] = {}
        if total:
            sub = await self.js.pull_subscribe(
                f"pagedllm.batch.result.{batch_id}.*", durable=None, stream=RESULTS_STREAM,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                                      inactive_threshold=60.0))
            try:
                received = 0
                while received < total:
                    for msg in await sub.fetch(min(256, total - received), timeout=10):
                        received += 1
                        record = json.loads(msg.data)
                        output = BatchRequestOutput.model_validate(record["output"])
                        lines.setdefault(record["line"], (record["line"], msg.subject.endswith(".ok"), output))
            finally:
                await sub.unsubscribe()
        ordered = sorted(lines.values(), key=lambda x: x[0])
        return [o for _, ok, o in ordered if ok], [o for _, ok, o in ordered if not ok]

    async def _keys(self, bucket: str) -> list[str]:
        """The keys of the key-value ``bucket``'s entries, deleted ones included (the callers skip
        those: ``NotFound``), from the server's per-subject counts of the bucket's stream.

        Not ``KeyValue.keys()``: nats-py 2.x's watcher behind it may signal its end before the
        messages already in flight are handled (a consumer info of 0 pending, none delivered
        yet), so under load it returned some keys only. The server lists up to 100,000 subjects.
        """
        prefix = f"$KV.{bucket}."
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
        return [subject[len(prefix):] for subject in info.state.subjects or {}]
