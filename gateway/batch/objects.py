"""The Files and Batch API's objects, as OpenAI's reference defines them.

``FileObject``, ``Batch`` (with ``request_counts``, ``errors`` and every timestamp), the list
envelopes, the request of ``POST /v1/batches``, and a batch's lines: the input line
(``{"custom_id", "method", "url", "body"}``) and the output line (``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
#: statuses after which a batch never changes again
TERMINAL_STATUSES = ("failed", "completed", "expired", "cancelled")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
MAX_BATCH_REQUESTS = 50_000


def new_id(prefix: str) -> str:
    """``<prefix>_<32 hex>``, or ``file-<24 hex>`` for files (OpenAI's shapes)."""
    if prefix == "file":
        return f"file-{uuid.uuid4().hex[:24]}"
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    """Unix seconds, OpenAI's timestamps."""
    return int(time.time())


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"  # deprecated by OpenAI, still sent
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based line number of the input file


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class CreateBatchRequest(BaseModel):
    """``POST /v1/batches``. ``output_expires_after`` is accepted and not enforced."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("metadata takes at most 16 pairs, keys of up to 64 characters and values of up to 512")
        return v


class BatchWorkItem(BaseModel):
    """One line of a batch, as queued for the batch service (JetStream work queue)."""

    batch_id: str
    line: int  # 1-based, in the input file
    custom_id: str
    body: dict[str, Any]
    url: str = "/v1/chat/completions"  # the line's endpoint (a batch's lines all have the batch's)


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchLineError(BaseModel):
    code: str
    message: str


class BatchRequestOutput(BaseModel):
    """A line of a batch's output or error file."""

    id: str
    custom_id: str
    response: BatchResponse | None = None
    error: BatchLineError | None = None


def new_batch(input_file_id: str, endpoint: str, completion_window: str, metadata: dict[str, str] | None) -> Batch:
    """A batch just created (``validating``), expiring after its completion window."""
    created = now()
    return Batch(id=new_id("batch"), endpoint=endpoint, input_file_id=input_file_id,
                 completion_window=completion_window, status="validating", created_at=created,
                 expires_at=created + COMPLETION_WINDOW_S[completion_window], metadata=metadata)
