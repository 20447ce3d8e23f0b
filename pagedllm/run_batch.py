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
from pathlib import Path
from typing import Any

from gateway.batch.lines import run_line
from gateway.batch.objects import BatchRequestOutput
from gateway.batch.validation import parse_batch_input

MAX_IN_FLIGHT = 256  # lines submitted at once (the scheduler batches them)


def read_batch_input(path: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """``(url, custom_id, body)`` per line of ``path`` (each line with its own ``url``).

    Raises:
        ValueError: the file is not a valid batch input (the message names the line).
    """
    items, errors = parse_batch_input("run-batch", path.read_bytes(), None)
    if errors:
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        raise ValueError(f"{path}: {errors[0].message}{more}")
    return [(item.url, item.custom_id, item.body) for item in items]


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
