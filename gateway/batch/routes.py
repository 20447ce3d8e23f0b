"""HTTP routes of OpenAI's Files and Batch API (``/v1/files``, ``/v1/batches``), over a
``BatchStore`` that the gateway opens on JetStream (``app.state.batch_store``).

Files: ``POST /v1/files`` (multipart ``file`` and ``purpose``; a file over
``batch_max_file_bytes`` is a 413), ``GET /v1/files`` (``purpose``, ``after``, ``limit``,
``order``), ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``.
Batches: ``POST /v1/batches``, ``GET /v1/batches/{id}``, ``GET /v1/batches`` (``after``,
``limit``), ``POST /v1/batches/{id}/cancel``. The batch's work is the ``batch`` service's
(``worker.py``). Without JetStream on the NATS server these routes answer 503.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import ValidationError

from gateway.batch.objects import (
    TERMINAL_STATUSES,
    Batch,
    BatchList,
    CreateBatchRequest,
    FileDeleted,
    FileList,
    FileObject,
    new_batch,
    now,
)
from gateway.batch.store import BatchStore, NotFound
from gateway.errors import APIError, validation_error

FILE_PURPOSES = ("batch", "batch_output", "assistants", "fine-tune", "vision", "user_data", "evals")
router = APIRouter()


def _store(request: Request) -> BatchStore:
    store = getattr(request.app.state, "batch_store", None)
    if store is None:
        raise APIError.of(503, "the Files and Batch API need JetStream on the NATS server, which this gateway "
                               "could not open", code="service_unavailable")
    return store


def _not_found(kind: str, object_id: str) -> APIError:
    return APIError.of(404, f"No such {kind}: '{object_id}'", param="id", code="not_found")


def _page(items: list, after: str | None, limit: int) -> tuple[list, bool]:
    """OpenAI's cursor pagination: the ``limit`` items after the one whose id is ``after``."""
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return items[:limit], len(items) > limit


# ---------------------------------------------------------------- files


@router.post("/v1/files", response_model=FileObject)
async def create_file(request: Request) -> FileObject:
    """Upload a file (multipart: ``file``, ``purpose``)."""
    store = _store(request)
    limit = request.app.state.settings.batch_max_file_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit + 64 * 1024:
        raise APIError.of(413, f"the file is larger than the {limit} bytes allowed", code="file_too_large")
    form = await request.form(max_part_size=1 << 20)  # plain fields; the file part is spooled to disk
    upload, purpose = form.get("file"), form.get("purpose")
    if upload is None or isinstance(upload, str):
        raise APIError.of(400, "a multipart 'file' field is required", param="file")
    if purpose not in FILE_PURPOSES:
        raise APIError.of(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}", param="purpose")
    data = await upload.read()
    if len(data) > limit:
        raise APIError.of(413, f"the file is larger than the {limit} bytes allowed", code="file_too_large")
    return await store.put_file(upload.filename or "upload.jsonl", str(purpose), data)


@router.get("/v1/files", response_model=FileList)
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(10000, ge=1, le=10000),
                     order: Literal["asc", "desc"] = "desc") -> FileList:
    files = await _store(request).list_files(purpose)
    if order == "asc":
        files.reverse()
    page, more = _page(files, after, limit)
    return FileList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                    has_more=more)


@router.get("/v1/files/{file_id}", response_model=FileObject)
async def retrieve_file(request: Request, file_id: str) -> FileObject:
    try:
        return await _store(request).get_file(file_id)
    except NotFound:
        raise _not_found("file", file_id) from None


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    try:
        data = await _store(request).file_content(file_id)
    except NotFound:
        raise _not_found("file", file_id) from None
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", response_model=FileDeleted)
async def delete_file(request: Request, file_id: str) -> FileDeleted:
    try:
        await _store(request).delete_file(file_id)
    except NotFound:
        raise _not_found("file", file_id) from None
    return FileDeleted(id=file_id)


# ---------------------------------------------------------------- batches


@router.post("/v1/batches", response_model=Batch)
async def create_batch(request: Request) -> Batch:
    """Create a batch (``validating``); the ``batch`` service validates and runs it."""
    store = _store(request)
    try:
        body = CreateBatchRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    try:
        file = await store.get_file(body.input_file_id)
    except NotFound:
        raise _not_found("file", body.input_file_id) from None
    if file.purpose != "batch":
        raise APIError.of(400, f"file {file.id} has purpose {file.purpose!r}; a batch's input needs 'batch'",
                          param="input_file_id")
    batch = new_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    await store.create_batch(batch)
    return batch


@router.get("/v1/batches/{batch_id}", response_model=Batch)
async def retrieve_batch(request: Request, batch_id: str) -> Batch:
    try:
        return (await _store(request).get_batch(batch_id))[0]
    except NotFound:
        raise _not_found("batch", batch_id) from None


@router.get("/v1/batches", response_model=BatchList)
async def list_batches(request: Request, after: str | None = None,
                       limit: int = Query(20, ge=1, le=100)) -> BatchList:
    page, more = _page(await _store(request).list_batches(), after, limit)
    return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                     has_more=more)


@router.post("/v1/batches/{batch_id}/cancel", response_model=Batch)
async def cancel_batch(request: Request, batch_id: str) -> Batch:
    """``cancelling`` (lines not started are skipped, running ones finish; the batch service
    then ends it ``cancelled`` with the results it has); a batch still validating is
    ``cancelled`` at once. Cancelling an ended batch is a 400, as OpenAI's."""
    def cancel(b: Batch) -> Batch | None:
        if b.status in TERMINAL_STATUSES or b.status in ("cancelling", "finalizing"):
            return None
        if b.status == "validating":
            return b.model_copy(update=dict(status="cancelled", cancelling_at=now(), cancelled_at=now()))
        return b.model_copy(update=dict(status="cancelling", cancelling_at=now()))

    try:
        batch, applied = await _store(request).transition(batch_id, cancel)
    except NotFound:
        raise _not_found("batch", batch_id) from None
    if not applied and batch.status != "cancelling":  # ended, or finalizing: too late
        raise APIError.of(400, f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id")
    return batch
