"""The input file of a batch, line by line: what makes the whole batch fail validation.

As OpenAI: a line that is not a JSON object, lacks ``custom_id`` / ``method`` / ``url`` /
``body``, uses another method than POST, an unknown ``url`` or one that differs from the
batch's ``endpoint``, or repeats a ``custom_id``, fails the batch, with an error naming the
line (1-based). A body that is a JSON object but not a valid request is left to the line
itself: it goes to the error file with the 400 the endpoint would answer.
"""

from __future__ import annotations

import json

from gateway.batch.objects import BATCH_ENDPOINTS, MAX_BATCH_REQUESTS, BatchError, BatchWorkItem

MAX_ERRORS = 100  # errors listed per batch (the rest are counted in the last one's message)


def parse_batch_input(batch_id: str, data: bytes, endpoint: str | None,
                      max_line_bytes: int | None = None) -> tuple[list[BatchWorkItem], list[BatchError]]:
    """The work items of the input file ``data`` for a batch on ``endpoint`` (None: each line's
    own ``url``, as ``run-batch`` takes them), or the errors that fail it (then no item is
    returned). Lines end at ``\n`` only (JSON strings may hold other line separators); blank
    lines are skipped; a line over ``max_line_bytes`` (a NATS message's limit) is an error."""
    items: list[BatchWorkItem] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [BatchError(code="invalid_file", message=f"the input file is not UTF-8: {exc}")]
    for number, raw_bytes in enumerate(data.split(b"\n"), start=1):
        raw = raw_bytes.decode("utf-8").removesuffix("\r")
        if not raw.strip():
            continue
        if max_line_bytes is not None and len(raw_bytes) > max_line_bytes:
            errors.append(BatchError(code="line_too_large", message=f"line {number} is {len(raw_bytes)} bytes; "
                                     f"a line may take at most {max_line_bytes}", line=number))
            continue
        error = _check_line(raw, number, endpoint, seen, items, batch_id)
        if error is not None:
            errors.append(error)
    if not items and not errors:
        errors.append(BatchError(code="empty_file", message="the input file has no request lines"))
    if len(items) > MAX_BATCH_REQUESTS:
        errors.append(BatchError(code="too_many_requests",
                                 message=f"a batch takes at most {MAX_BATCH_REQUESTS} requests, got {len(items)}"))
    if len(errors) > MAX_ERRORS:
        more = len(errors) - MAX_ERRORS + 1
        errors = errors[: MAX_ERRORS - 1] + [BatchError(code="too_many_errors", message=f"and {more} more errors")]
    return ([], errors) if errors else (items, [])


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (errors must not echo a whole line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_line(raw: str, number: int, endpoint: str | None, seen: set[str], items: list[BatchWorkItem],
                batch_id: str) -> BatchError | None:
    try:
        line = json.loads(raw)
    except json.JSONDecodeError as exc:
        return BatchError(code="invalid_json_line", message=f"line {number} is not valid JSON: {exc.msg}", line=number)
    except (ValueError, RecursionError):  # nested too deep, a number too long
        return BatchError(code="invalid_json_line", message=f"line {number} is not JSON this server reads",
                          line=number)
    if not isinstance(line, dict):
        return BatchError(code="invalid_json_line", message=f"line {number} is not a JSON object", line=number)
    for key in ("custom_id", "method", "url", "body"):
        if key not in line:
            return BatchError(code="missing_required_parameter", message=f"line {number} has no {key!r}",
                              param=key, line=number)
    custom_id, url = line["custom_id"], line["url"]
    if not isinstance(custom_id, str) or not custom_id:
        return BatchError(code="invalid_request", message=f"line {number}: custom_id must be a non-empty string",
                          param="custom_id", line=number)
    if line["method"] != "POST":
        return BatchError(code="invalid_request", message=f"line {number}: method must be 'POST'", param="method",
                          line=number)
    if url not in BATCH_ENDPOINTS:
        return BatchError(code="invalid_url", message=f"line {number}: url {_short(url)} is not one of "
                          f"{', '.join(BATCH_ENDPOINTS)}", param="url", line=number)
    if endpoint is not None and url != endpoint:
        return BatchError(code="mismatched_url", message=f"line {number}: url {url!r} differs from the batch's "
                          f"endpoint {endpoint!r}", param="url", line=number)
    if not isinstance(line["body"], dict):
        return BatchError(code="invalid_request", message=f"line {number}: body must be a JSON object",
                          param="body", line=number)
    if custom_id in seen:
        return BatchError(code="duplicate_custom_id", message=f"line {number}: custom_id {_short(custom_id)} appears "
                          "more than once", param="custom_id", line=number)
    seen.add(custom_id)
    items.append(BatchWorkItem(batch_id=batch_id, line=number, custom_id=custom_id, body=line["body"],
                               url=url))
    return None
