"""OpenAI's Files and Batch API with the official ``openai`` SDK against ``pagedllm serve``
(the ``batch`` service among its processes), and fault drills on real processes: the batch
service, the executor and nats-server (file store) restarted mid-batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from processes import clean_env, start_serve, start_service, stop_all

from shared.config import DEFAULT_MODEL_NAME
from shared.nats_server import EmbeddedNats, free_port

MODEL = DEFAULT_MODEL_NAME
CHAT = "/v1/chat/completions"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello.",
             "Name a fruit.", "What colour is the sky?"]


def chat_line(custom_id: str, content: str, max_tokens: int = 8, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 240):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    return batch


def comparable(body: dict) -> dict:
    """A response body without what differs between two identical requests: id, time, and the
    prompt tokens found in the prefix cache (the second one hits what the first computed)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    out["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return out


@pytest.fixture(scope="module")
def served(smollm2_path):
    proc, port, _ = start_serve(
        smollm2_path.parent, "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--log-level",
        "WARNING", "--batch-monitor-interval-s", "0.2", "--batch-max-file-bytes", "200000",
        "--batch-max-in-flight", "8")
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def test_upload_create_poll_download_with_the_sdk(served):
    """Each greedy line's body equals the same request sent directly; an invalid body is its
    line's 400 in the error file; list, retrieve and delete."""
    client = served
    lines = [chat_line(f"q{i}", q) for i, q in enumerate(QUESTIONS)]
    lines.append({**chat_line("bad", "x"), "body": {"model": MODEL, "messages": [], "temperature": "hot"}})
    file = client.files.create(file=("questions.jsonl", jsonl(lines)), purpose="batch")
    assert (file.object, file.purpose, file.bytes, file.filename) == ("file", "batch", len(jsonl(lines)),
                                                                      "questions.jsonl")
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"job": "sdk"})
    assert batch.status == "validating" and batch.metadata == {"job": "sdk"}
    batch = wait_for(client, batch.id, ("completed", "failed"))
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (7, 6, 1)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.expires_at
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(len(QUESTIONS))]
    for o, line in zip(out, lines, strict=False):
        assert o["id"].startswith("batch_req_") and o["error"] is None and o["response"]["status_code"] == 200
        direct = client.chat.completions.create(**line["body"]).model_dump(mode="json", exclude_unset=True)
        assert comparable(o["response"]["body"]) == comparable(direct), o["custom_id"]
        assert o["response"]["request_id"] == o["response"]["body"]["id"]
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400 and errors[0]["error"]["message"]
    assert errors[0]["response"]["body"]["error"]["param"] in ("messages", "temperature")
    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert file.id in [f.id for f in client.files.list(purpose="batch").data]
    assert client.files.delete(file.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)  # ended batches cannot be cancelled


def test_cancel_stops_new_work_and_keeps_what_finished(served):
    client = served
    lines = [chat_line(f"c{i}", f"Count from 1 to 100, number {i}:", max_tokens=48, ignore_eos=True)
             for i in range(40)]
    file = client.files.create(file=("many.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    wait_for(client, batch.id, ("in_progress",), 60)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at
    batch = wait_for(client, batch.id, ("cancelled",), 120)
    done = batch.request_counts.completed
    assert batch.cancelled_at and batch.request_counts.total == 40 and done < 40
    if done:
        out = client.files.content(batch.output_file_id).text.splitlines()
        assert len(out) == done and len({json.loads(x)["custom_id"] for x in out}) == done


def test_bad_input_fails_validation_naming_lines_and_oversized_files_are_413(served):
    client = served
    lines = [chat_line("a", "hi"), {**chat_line("b", "hi"), "url": "/v1/completions"}, chat_line("a", "again")]
    file = client.files.create(file=("bad.jsonl", jsonl(lines) + b"{oops\n"), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    batch = wait_for(client, batch.id, ("failed",), 60)
    assert batch.failed_at and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "mismatched_url"), (3, "duplicate_custom_id"),
                                                            (4, "invalid_json_line")]
    with pytest.raises(openai.APIStatusError) as exc:
        client.files.create(file=("big.jsonl", b"x" * 300_000), purpose="batch")
    assert exc.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.content is not None  # the server still serves


@pytest.mark.timeout(900)
def test_a_batch_survives_kill_9_of_the_batch_service_and_executor_and_a_nats_restart(smollm2_path, tmp_path):
    """A 300-line batch on real processes and a nats-server with a file store: the batch
    service and the executor are killed with -9 and started again, and nats-server is
    restarted, while it runs (after 50, 150 and 250 lines: ~50 lines, three times the 16 in
    flight, are left after the last); it completes with every custom_id exactly once, each
    line's greedy body equal to the same request sent directly."""
    nats_port, http_port = free_port(), free_port()
    store = tmp_path / "jetstream"
    server = EmbeddedNats(port=nats_port, store_dir=store).start()
    env = clean_env(PAGEDLLM_NATS_URL=server.url, PAGEDLLM_MODEL=str(smollm2_path), PAGEDLLM_DTYPE="float32",
                    PAGEDLLM_KV_CACHE_MEMORY_BYTES=str(64 << 20), PAGEDLLM_PORT=str(http_port),
                    PAGEDLLM_LOG_LEVEL="WARNING", PAGEDLLM_BATCH_MONITOR_INTERVAL_S="0.3",
                    PAGEDLLM_BATCH_ACK_WAIT_S="6", PAGEDLLM_BATCH_MAX_IN_FLIGHT="16",
                    PAGEDLLM_HEARTBEAT_INTERVAL_S="0.5", PAGEDLLM_HEARTBEAT_TIMEOUT_S="3")
    names = ("scheduler", "tokenizer", "detokenizer", "executor", "gateway", "batch")
    procs = {name: start_service(name, env) for name in names}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the stack did not start"
            time.sleep(0.5)
        lines = [chat_line(f"id-{i}", QUESTIONS[i % len(QUESTIONS)] + f" ({i})", max_tokens=4) for i in range(300)]
        file = client.files.create(file=("three-hundred.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")

        def progress(at_least: int) -> None:
            deadline = time.monotonic() + 240
            while client.batches.retrieve(batch.id).request_counts.completed < at_least:
                assert time.monotonic() < deadline, client.batches.retrieve(batch.id)
                time.sleep(0.2)

        progress(50)
        procs["batch"].send_signal(signal.SIGKILL)  # lines it held are delivered again
        procs["batch"].wait(10)
        procs["batch"] = start_service("batch", env)
        progress(150)
        procs["executor"].send_signal(signal.SIGKILL)  # running lines: 503, retried
        procs["executor"].wait(10)
        procs["executor"] = start_service("executor", env)
        progress(250)
        assert client.batches.retrieve(batch.id).status == "in_progress"  # the restart comes mid-batch
        server.stop()  # nats-server restarts on its file store (store_dir is kept)
        time.sleep(1.0)
        server = EmbeddedNats(port=nats_port, store_dir=store, token=server.token).start()
        batch = wait_for(client, batch.id, ("completed", "failed"), 600)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == \
            (300, 300, 0)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert [o["custom_id"] for o in out] == [f"id-{i}" for i in range(300)]  # each once, in input order
        assert batch.error_file_id is None
        for i in (0, 1, 249, 299):
            direct = client.chat.completions.create(**lines[i]["body"]).model_dump(mode="json", exclude_unset=True)
            assert comparable(out[i]["response"]["body"]) == comparable(direct)
    finally:
        stop_all(procs.values(), timeout=20)
        server.stop()


def test_run_batch_offline_writes_one_line_per_request(smollm2_path, tmp_path):
    """``pagedllm run-batch -i in.jsonl -o out.jsonl``: OpenAI's output lines in input order,
    the greedy text equal to ``LLM.chat``'s, a bad body as its line's error."""
    lines = [chat_line(f"r{i}", q) for i, q in enumerate(QUESTIONS[:3])]
    lines.append({**chat_line("bad", "x"), "body": {"messages": [{"role": "user", "content": "x"}], "n": 0}})
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
    env["PAGEDLLM_CACHE_DIR"] = str(smollm2_path.parent)
    proc = subprocess.run([sys.executable, "-m", "pagedllm.cli", "run-batch", "-i", str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl"), "--dtype", "float32"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 succeeded, 1 failed" in proc.stdout
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["r0", "r1", "r2", "bad"]
    assert out[3]["response"]["status_code"] == 400 and out[3]["error"] is not None
    from pagedllm import LLM, SamplingParams

    with LLM(model=str(smollm2_path), dtype="float32", kv_cache_memory_bytes=32 << 20) as llm:
        ref = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS[:3]],
                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out[:3]] == \
        [r.outputs[0].text for r in ref]
    bad = subprocess.run([sys.executable, "-m", "pagedllm.cli", "run-batch", "-i", str(Path(__file__)),
                          "-o", str(tmp_path / "x.jsonl")], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "line 1" in bad.stderr
