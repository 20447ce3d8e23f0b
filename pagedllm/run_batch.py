"""``pagedllm run-batch -i in.jsonl -o out.jsonl [--model M]``: vLLM's offline batch command.

Reads OpenAI batch input lines (``{"custom_id", "method": "POST", "url", "body"}``, ``url``
``/v1/chat/completions`` or ``/v1/completions``, one per line), runs them on the offline
engine (the ``LLM``'s embedded NATS and services) through the gateway's ``OpenAIServing`` (the
bodies a server would answer), with a progress bar, and writes one output line per input line,
in input order, in OpenAI's batch output format (a failed line has its ``error`` and its
error ``response``). A file that is not a valid batch input (a bad line, a duplicate
``custom_id``) stops the command before anything runs, naming the line.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from gateway.batch.objects import BATCH_ENDPOINTS, BatchRequestOutput
from gateway.batch.validation import parse_batch_input
from gateway.batch.worker import run_line

MAX_IN_FLIGHT = 256  # lines submitted at once (the scheduler batches them)


def read_batch_input(path: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """``(url, custom_id, body)`` per line of ``path``.

    Raises:
        ValueError: the file is not a valid batch input (the message names the line).
    """
    data = path.read_bytes()
    urls: dict[int, str] = {}
    for number, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        try:
            line = json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError:
            continue  # parse_batch_input names it
        if isinstance(line, dict) and line.get("url") in BATCH_ENDPOINTS:
            urls[number] = line["url"]
    items, errors = [], []
    for endpoint in BATCH_ENDPOINTS:  # each line checked against its own url; ids unique across both
        found, errs = parse_batch_input("run-batch", data, endpoint)
        items.extend(i for i in found if urls.get(i.line) == endpoint)
        errors.extend(e for e in errs if e.code != "mismatched_url" and e.code != "empty_file")
    if errors or not items:
        first = errors[0].message if errors else "the input file has no request lines"
        raise ValueError(f"{path}: {first}" + (f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""))
    ids = [i.custom_id for i in items]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: a custom_id appears more than once")
    return [(urls[i.line], i.custom_id, i.body) for i in sorted(items, key=lambda i: i.line)]


def run_batch(input_path: Path, output_path: Path, use_tqdm: bool = True, **engine_kwargs: Any) -> tuple[int, int]:
    """Run the batch in ``input_path`` on an offline ``LLM(**engine_kwargs)``; write ``output_path``.

    Returns:
        (lines that succeeded, lines that failed).

    Raises:
        ValueError: the input is not a valid batch file; an invalid engine setting.
    """
    from gateway.serving import OpenAIServing
    from pagedllm.llm import LLM

    lines = read_batch_input(input_path)
    with LLM(**engine_kwargs) as llm:
        serving = OpenAIServing(llm.settings, llm.model_info, llm._client)

        async def run_all() -> list[tuple[BatchRequestOutput, bool]]:
            slots = asyncio.Semaphore(MAX_IN_FLIGHT)
            bar = _progress(len(lines), use_tqdm)

            async def one(url: str, custom_id: str, body: dict) -> tuple[BatchRequestOutput, bool]:
                async with slots:
                    out = await run_line(serving, url, custom_id, body)
                if bar is not None:
                    bar.update(1)
                return out

            try:
                return list(await asyncio.gather(*(one(*line) for line in lines)))
            finally:
                if bar is not None:
                    bar.close()

        results = llm._services.run(run_all())
    output_path.write_text("".join(out.model_dump_json() + "\n" for out, _ in results))
    ok = sum(1 for _, good in results if good)
    return ok, len(results) - ok


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Running batch", unit="req")
