"""The Files and Batch API's storage on a real nats-server's JetStream: files, compare-and-set
updates of batches, lines queued once, results stored once per custom_id."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest

from gateway.batch.objects import BatchRequestOutput, BatchWorkItem, new_batch
from gateway.batch.store import BatchStore, NotFound
from shared.bus import Bus


@pytest.fixture
async def store(nats_url):
    bus = await Bus.connect(nats_url)
    try:
        yield await BatchStore(bus.nc).setup()
    finally:
        await bus.close()


async def test_files_round_trip_list_newest_first_and_delete(store):
    a = await store.put_file("a.jsonl", "batch", b'{"x": 1}\n')
    b = await store.put_file("b.jsonl", "batch_output", b"\x00" * 300_000)  # several object chunks
    assert (await store.get_file(a.id)).model_dump() == a.model_dump()
    assert a.bytes == 9 and a.id.startswith("file-") and a.object == "file"
    assert await store.file_content(b.id) == b"\x00" * 300_000
    ids = [f.id for f in await store.list_files()]
    for _ in range(20):  # every listing has both (nats-py's KeyValue.keys() left some out under load)
        assert {a.id, b.id} <= {f.id for f in await store.list_files()}
    assert ids.index(b.id) < ids.index(a.id) or a.created_at == b.created_at
    assert [f.id for f in await store.list_files("batch_output") if f.id in (a.id, b.id)] == [b.id]
    await store.delete_file(a.id)
    with pytest.raises(NotFound):
        await store.get_file(a.id)
    with pytest.raises(NotFound):
        await store.file_content(a.id)
    with pytest.raises(NotFound):
        await store.delete_file("file-nope")
    with pytest.raises(NotFound):
        await store.get_file("not a valid key!")


async def test_batch_updates_are_compare_and_set(store, monkeypatch):
    """Ten updates read the same revision (a barrier holds each after its first ``get_batch``)
    and then write together: nine lose the compare-and-set, read again and retry, and the
    batch ends with every update."""
    batch = new_batch("file-1", "/v1/completions", "24h", {"k": "v"})
    await store.create_batch(batch)
    got, revision = await store.get_batch(batch.id)
    assert got == batch and got.expires_at == got.created_at + 24 * 3600

    updates = 10
    barrier = asyncio.Barrier(updates)
    read_once: set[asyncio.Task] = set()
    conflicts = 0
    get_batch, kv_update = store.get_batch, store.batches.update

    async def get_batch_then_meet(batch_id):
        got = await get_batch(batch_id)
        if (task := asyncio.current_task()) not in read_once:  # the first read of each update
            read_once.add(task)
            await barrier.wait()
        return got

    async def update_counting_conflicts(*args, **kwargs):
        nonlocal conflicts
        try:
            return await kv_update(*args, **kwargs)
        except nats.js.errors.KeyWrongLastSequenceError:
            conflicts += 1
            raise

    monkeypatch.setattr(store, "get_batch", get_batch_then_meet)
    monkeypatch.setattr(store.batches, "update", update_counting_conflicts)

    async def bump(i: int) -> None:
        def change(b):
            b.request_counts.completed += 1
            b.metadata[f"u{i}"] = str(i)
            return b
        await store.update_batch(batch.id, change)

    await asyncio.gather(*(bump(i) for i in range(updates)))
    monkeypatch.undo()
    assert len(read_once) == updates
    assert conflicts >= updates - 1  # all read one revision: all but the first writer retried
    final = (await store.get_batch(batch.id))[0]
    assert final.request_counts.completed == updates  # none lost
    assert final.metadata == {"k": "v"} | {f"u{i}": str(i) for i in range(updates)}
    unchanged = await store.update_batch(batch.id, lambda b: None)
    assert unchanged.request_counts.completed == updates
    assert batch.id in [b.id for b in await store.list_batches()]
    with pytest.raises(NotFound):
        await store.get_batch("batch_missing")


async def test_lines_are_queued_once_and_results_stored_once_per_custom_id(store):
    batch = new_batch("file-1", "/v1/completions", "24h", None)
    items = [BatchWorkItem(batch_id=batch.id, line=i + 1, custom_id=f"c{i}", body={"prompt": str(i)}) for i in range(5)]
    await store.enqueue_work(items)
    await store.enqueue_work(items[:3])  # validation run again after a crash
    assert await store.remaining_work(batch.id) == 5
    for i in (3, 0, 4, 0, 1):  # out of order, and c0 twice (a redelivered line)
        out = BatchRequestOutput(id=f"batch_req_{i}", custom_id=f"c{i}")
        await store.put_result(batch.id, i + 1, out, ok=i != 4)
    assert await store.result_counts(batch.id) == (3, 1)
    ok, failed = await store.read_results(batch.id)
    assert [o.custom_id for o in ok] == ["c0", "c1", "c3"] and [o.custom_id for o in failed] == ["c4"]
    assert ok[0].id == "batch_req_0"


async def test_custom_ids_that_headers_would_mangle_are_stored_apart(store):
    """NATS headers strip and fold whitespace: results are keyed by line, not custom_id."""
    batch = new_batch("file-1", "/v1/completions", "24h", None)
    ids = ["a", "a ", "a\n", "x y", "x\ny", " a"]
    for line, custom_id in enumerate(ids, start=1):
        await store.put_result(batch.id, line, BatchRequestOutput(id=f"r{line}", custom_id=custom_id), ok=True)
    assert await store.result_counts(batch.id) == (6, 0)
    ok, _ = await store.read_results(batch.id)
    assert [o.custom_id for o in ok] == ids
