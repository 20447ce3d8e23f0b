"""Tensor-parallel executor groups end to end: greedy tokens equal one rank's in float32, for
prompts of different lengths generated together, on tiny random models and on SmolLM2; the
engine's features under TP=2 give TP=1's outputs; a rank killed mid-run ends every request
and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from processes import clean_env, left_running, start_serve, start_service, stop_all
from transformers import LlamaConfig, Qwen2Config

from pagedllm import LLM, SamplingParams
from shared.nats_server import free_port

sys.path.insert(0, str(Path(__file__).parent))
from test_llm_parity import PROMPTS, tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def generate(path: Path, tp: int, prompts: list[str], params: SamplingParams | list[SamplingParams] = GREEDY,
             outputs: list | None = None, **kwargs) -> tuple[list, object]:
    """Token ids of every output of every prompt, and the engine's stats after the run (the
    pool checked empty again); the ``RequestOutput``s are appended to ``outputs``."""
    kwargs.setdefault("kv_cache_memory_bytes", 16 << 20)
    with LLM(model=str(path), dtype="float32", tensor_parallel_size=tp, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert all(g.num_free_blocks == g.num_blocks for g in stats.groups), stats  # no block leaked
    if outputs is not None:
        outputs.extend(outs)
    return [[c.token_ids for c in o.outputs] for o in outs], stats


TINY_LLAMA = LlamaConfig(
    vocab_size=49152, hidden_size=64, intermediate_size=120, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    architectures=["LlamaForCausalLM"], initializer_range=0.2,
)


# TINY_LLAMA (8 heads, 2 KV heads) on two ranks: test_engine_features_under_tp2_give_tp1_outputs
@pytest.mark.parametrize(("config", "tp"), [
    pytest.param(Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
        architectures=["Qwen2ForCausalLM"], initializer_range=0.2), 2, id="qwen2-qkv-bias-tied-tp2"),
    pytest.param(LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, architectures=["LlamaForCausalLM"],
        initializer_range=0.2), 2, id="llama-multi-query-kv-head-replicated-tp2"),
])
def test_tiny_models_give_one_rank_greedy_tokens(tmp_path, smollm2_path, config, tp):
    path = tiny_model(tmp_path, smollm2_path, config)
    one, _ = generate(path, 1, PROMPTS)
    assert len({tuple(o[0]) for o in one}) == len(PROMPTS)  # the prompts' outputs differ: the test can fail
    many, _ = generate(path, tp, PROMPTS)
    assert many == one


@pytest.fixture(scope="module")
def smollm2_tp1(smollm2_path):
    return generate(smollm2_path, 1, PROMPTS, GREEDY, kv_cache_memory_bytes=32 << 20)[0]


@pytest.mark.parametrize("tp", [pytest.param(3, id="tp3-one-kv-head-per-rank"),
                                pytest.param(2, id="tp2-kv-groups-2-and-1")])
def test_smollm2_gives_one_rank_greedy_tokens(smollm2_path, smollm2_tp1, tp):
    many, _ = generate(smollm2_path, tp, PROMPTS, GREEDY, kv_cache_memory_bytes=32 << 20)
    assert many == smollm2_tp1


def test_engine_features_under_tp2_give_tp1_outputs(tmp_path, smollm2_path):
    """The tiny Llama (8 heads, 2 KV heads: 4 heads and 1 KV head a rank) with n > 1
    (copy-on-write of the shared last block), seeded sampling, prefix caching (a long prompt
    asked twice), chunked prefill (48-token steps) and preemption (a 14-block pool) together,
    beside the greedy ``PROMPTS``: TP=2's outputs are TP=1's, token for token; so are log probabilities and prompt
    log probabilities (rank 0's gathered logits), up to float32 summation order."""
    path = tiny_model(tmp_path, smollm2_path, TINY_LLAMA)
    long_prompt = PROMPTS[7]
    prompts = PROMPTS + [long_prompt, long_prompt + " Indeed,"]
    params = [GREEDY] * len(PROMPTS) + [
        SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, n=2, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    ]
    kwargs = dict(num_gpu_blocks_override=14, block_size=16, max_num_batched_tokens=48)
    outs_one, outs_many = [], []
    one, stats_one = generate(path, 1, prompts, params, outs_one, **kwargs)
    assert len({tuple(o[0]) for o in one[:len(PROMPTS)]}) == len(PROMPTS)  # greedy outputs differ: the test can fail
    many, stats_many = generate(path, 2, prompts, params, outs_many, **kwargs)
    assert many == one
    a, b = outs_one[-1], outs_many[-1]
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) > 40
    for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs,
                    strict=True):
        assert list(x) == list(y)  # the same token ids, in the same order
        for token in x:
            # a token deep in the tail may trade places with a neighbour 1e-6 away
            assert x[token].rank == y[token].rank or (x[token].rank > 20 and abs(x[token].rank - y[token].rank) <= 3)
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)
    assert len(one[-2]) == 3 and len(set(map(tuple, one[-2]))) > 1  # seeded samples that differ
    for stats in (stats_one, stats_many):
        assert stats.num_preemptions > 0
        assert stats.groups[0].prefix_cache_hits > 0


def _serve_tp2(smollm2_path) -> tuple[subprocess.Popen, int]:
    proc, port, _ = start_serve(smollm2_path.parent, "--tensor-parallel-size", "2", "--kv-cache-memory-bytes",
                                str(32 << 20), "--log-level", "WARNING")
    return proc, port


def _stream(port: int, prompt: str, out: dict, max_tokens: int = 400) -> None:
    """One streamed completion: its text, finish reason or error event, and whether it ended."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    out.update(text="", finish_reason=None, error=None, done=False, status=None)
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                else:
                    out["text"] += event["choices"][0]["text"]
                    out["finish_reason"] = event["choices"][0]["finish_reason"] or out["finish_reason"]
    except httpx.HTTPError as exc:  # the server went away mid-stream
        out["error"] = {"transport": type(exc).__name__}


def test_kill_9_of_a_rank_restarts_the_group_and_every_stream_completes(smollm2_path):
    """``pagedllm serve --tensor-parallel-size 2`` with 8 streams running: ``kill -9`` of rank 1
    takes the group down (rank 0 sees its collective fail or the process exit, tells the
    scheduler and exits); serve's supervisor starts the executor, both ranks, again; the
    streams' requests are recomputed on it and every one completes, none hangs; once serve
    has stopped, no process of the stack (the killed group's included) is left."""
    proc, port = _serve_tp2(smollm2_path)
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
        executors = [p for p in tree if "executor" in " ".join(p.cmdline())]
        rank1 = [p for p in executors if p.ppid() != proc.pid]
        assert len(executors) == 2 and len(rank1) == 1, [p.cmdline() for p in executors]
        outs = [{} for _ in range(8)]
        # 48 tokens: the kill comes at their first ones, and the step it breaks fails at once
        threads = [threading.Thread(target=_stream, args=(port, PROMPTS[i], outs[i], 48)) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while sum(bool(o.get("text")) for o in outs) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(bool(o.get("text")) for o in outs) >= 4, outs  # they are running
        rank1[0].send_signal(signal.SIGKILL)
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        assert proc.poll() is None  # serve carries on
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    for out in outs:
        assert out["status"] == 200 and out["error"] is None and out["finish_reason"] == "length", out
    stderr = proc.stderr.read()
    assert "tensor-parallel" in stderr and "service_died" in stderr and "service_restarting" in stderr, \
        stderr[-3000:]
    alive = left_running(tree)
    assert not alive, alive


def _service(name: str, env: dict[str, str], group: str | None = None, tp: int = 1, **settings: str) -> subprocess.Popen:
    e = dict(env, PAGEDLLM_TENSOR_PARALLEL_SIZE=str(tp), **{f"PAGEDLLM_{k.upper()}": v for k, v in settings.items()})
    if group:
        e["PAGEDLLM_GROUP_ID"] = group
    return start_service(name, e, stderr=subprocess.PIPE)


@pytest.mark.timeout(600)
async def test_a_group_losing_a_rank_is_dropped_its_requests_recomputed_elsewhere_or_failed_503(
        nats_url, smollm2_path):
    """Services as processes, groups "ga" (TP=2) and "gb" (TP=1). ``kill -9`` of ga's rank 1
    while it runs requests: ga's rank 0 exits, the scheduler drops ga and recomputes its
    requests on gb, every output equal to an undisturbed run, no block held. Then with "gc"
    (TP=2, its two ranks started by hand as on two machines: ``--tensor-parallel-rank`` and a
    master port) the only group left, ``kill -9`` of its rank 1 fails every request with the
    retryable 503 ``no_executor`` once ``executor_wait_timeout_s`` (1 s here) has passed without
    a group. No rank process is left behind."""
    import asyncio
    import uuid

    from shared.bus import Bus
    from shared.engine_client import EngineClient
    from shared.messages import SamplingParams as WireParams
    from shared.messages import SchedulerStats, StatsQuery
    from shared.pings import wait_engine_ready
    from shared.subjects import Subjects

    model = f"tp-{uuid.uuid4().hex[:6]}"
    env = clean_env(PAGEDLLM_NATS_URL=nats_url, PAGEDLLM_MODEL=str(smollm2_path), PAGEDLLM_SERVED_MODEL_NAME=model,
                    PAGEDLLM_DTYPE="float32", PAGEDLLM_KV_CACHE_MEMORY_BYTES=str(32 << 20),
                    PAGEDLLM_HEARTBEAT_INTERVAL_S="0.5", PAGEDLLM_HEARTBEAT_TIMEOUT_S="3",
                    PAGEDLLM_EXECUTOR_WAIT_TIMEOUT_S="1", PAGEDLLM_LOG_LEVEL="WARNING")
    procs = {name: _service(name, env) for name in ("scheduler", "tokenizer", "detokenizer")}
    procs["ga"] = _service("executor", env, "ga", tp=2)
    procs["gb"] = _service("executor", env, "gb")
    bus = await Bus.connect(nats_url)
    client = EngineClient(bus, model)
    await client.start()
    params = WireParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def stats() -> SchedulerStats:
        return await bus.request(Subjects(model).stats_get, StatsQuery(), SchedulerStats, timeout=5)

    async def until(predicate, timeout: float = 120) -> SchedulerStats:
        deadline = time.monotonic() + timeout
        while not predicate(s := await stats()):
            assert time.monotonic() < deadline, s
            await asyncio.sleep(0.05)
        return s

    async def run_all() -> list[tuple[list[int], object]]:
        ids = [f"tp-{uuid.uuid4().hex}" for _ in PROMPTS]
        for rid, prompt in zip(ids, PROMPTS, strict=True):
            assert (await client.submit(rid, prompt=prompt, sampling_params=params)).error is None

        async def collect(rid: str) -> tuple[list[int], object]:
            tokens, error = [], None
            async for delta in client.stream(rid):
                tokens.extend(delta.token_ids)
                error = delta.error or error
            return tokens, error

        return list(await asyncio.gather(*(collect(r) for r in ids)))

    def rank1_of(group: str) -> psutil.Process:
        children = psutil.Process(procs[group].pid).children()
        assert len(children) == 1 and "executor" in " ".join(children[0].cmdline())
        return children[0]

    try:
        await wait_engine_ready(bus, model, num_detokenizer_shards=1, timeout=240)
        await until(lambda s: len(s.groups) == 2, 240)
        baseline = await run_all()
        assert all(err is None and len(toks) == 24 for toks, err in baseline)
        rank1 = rank1_of("ga")
        task = asyncio.create_task(run_all())
        await until(lambda s: any(g.group_id == "ga" and g.num_running > 0 for g in s.groups), 60)
        rank1.send_signal(signal.SIGKILL)
        again = await asyncio.wait_for(task, 300)
        assert again == baseline
        assert procs["ga"].wait(30) != 0  # rank 0 ended with its group
        stderr = procs["ga"].stderr.read()
        assert "tensor-parallel" in stderr and "group ga" in stderr, stderr[-3000:]
        s = await until(lambda s: s.num_running == 0 and s.num_waiting == 0)
        assert [g.group_id for g in s.groups] == ["gb"]
        assert all(g.num_free_blocks == g.num_blocks for g in s.groups)

        master = dict(tensor_parallel_master_addr="127.0.0.1", tensor_parallel_master_port=str(free_port()))
        procs["gc"] = _service("executor", env, "gc", tp=2, tensor_parallel_rank="0", **master)
        procs["gc1"] = _service("executor", env, "gc", tp=2, tensor_parallel_rank="1", **master)
        await until(lambda s: len(s.groups) == 2, 240)
        assert psutil.Process(procs["gc"].pid).children() == []  # rank 0 started no rank itself
        procs["gb"].send_signal(signal.SIGTERM)  # stops cleanly: gc is the last group
        assert procs["gb"].wait(30) == 0
        await until(lambda s: [g.group_id for g in s.groups] == ["gc"])
        task = asyncio.create_task(run_all())
        await until(lambda s: s.num_running > 0, 60)
        procs["gc1"].send_signal(signal.SIGKILL)
        failed = await asyncio.wait_for(task, 120)
        for tokens, error in failed:
            assert error is not None and error.status == 503 and error.code == "no_executor", (tokens, error)
        assert procs["gc"].wait(30) != 0
        s = await until(lambda s: s.num_running == 0 and s.num_waiting == 0)
        assert s.groups == []
    finally:
        await client.stop()
        await bus.close()
        stop_all(procs.values())
    def ours(p: psutil.Process) -> bool:  # a process of this test's stack still running
        try:
            return (p.info["environ"] or {}).get("PAGEDLLM_SERVED_MODEL_NAME") == model and p.status() != "zombie"
        except psutil.Error:
            return False

    leftovers = [p for p in psutil.process_iter(["cmdline", "environ"]) if ours(p)]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]
