"""The ranks of one tensor-parallel executor group, and how each step reaches all of them.

Design (vLLM's): rank 0 is the executor service. It alone talks to NATS: it receives each
``StepPlan``, and before running it sends it to the other ranks through the group's CPU
process group (:class:`RankMessage`, one gloo broadcast); then every rank runs the step's
forward together, rank 0 gathers the logits, samples and answers the scheduler. The tokens it
sampled ride on its next message, so the other ranks' request state follows rank 0's with no
extra collective per step. The other ranks (:func:`serve_rank`) do nothing but wait for rank
0's next message; rank 0 sends a keep-alive every heartbeat interval (queued behind a running
step), so a rank that waits longer than the group's timeout knows rank 0 is gone. Before
serving, the ranks compare their settings (:func:`check_same_settings`): ranks started by hand
with different ones would compute different things.

Failure story: on gloo a rank whose process dies closes its sockets, and the collective every
other rank is in (or enters next) raises at once. The other ranks exit; rank 0 publishes the
step's error (if one was running), tells the scheduler its group is stopping and exits, so the
scheduler recomputes the group's requests on another group, or fails them with a 503
``no_executor`` when none is left. Rank 0 also notices, off its step thread, a rank process it
started that exits, or a rank whose liveness counter in the rendezvous store stops moving (every
rank counts from its own thread: ``TensorParallelGroup.beat``), which covers ranks on other
machines and NCCL, whose collectives do not fail at once; it then aborts the group and exits
without waiting for its step thread. After a failure rank 0 sends nothing more to the group
(its ranks may be inside a collective of the failed step). A rank that hangs without dying is
detected after the group's timeout (``step_timeout_s``). The rank processes rank 0 started die
with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Literal

import msgspec
from transformers import AutoConfig

from services.executor.device import resolve_device
from services.executor.model_runner import ModelRunner
from services.executor.models.hf_config import config_value, num_kv_heads_of
from services.executor.parallel.group import TensorParallelGroup
from services.executor.parallel.partition import attention_heads
from services.executor.structured_output import StructuredOutputManager
from shared.bus import decode, encode
from shared.config import Settings
from shared.logging import get_logger
from shared.messages import StepPlan, StepResult
from shared.model_source import ModelInfo

log = get_logger("executor")


class RankMessage(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Rank 0 -> every other rank of its group, through the process group.

    ``kind``: ``"step"`` (run ``plan``), ``"reset"`` (forget every request: the group registers
    again), ``"keepalive"`` (nothing to do) or ``"stop"``. ``sampled``: the tokens rank 0
    sampled in the previous step, by request id, appended before anything else.
    """

    kind: Literal["step", "reset", "keepalive", "stop"]
    plan: StepPlan | None = None
    sampled: dict[str, int] = {}



def connect_rank(settings: Settings, rank: int, master_port: int) -> TensorParallelGroup:
    """Join this process's group as ``rank`` (device: its own GPU on CUDA).

    Raises:
        RuntimeError: the other ranks did not come within ``step_timeout_s``.
    """
    device = resolve_device(settings.device)
    if device.type == "cuda":
        import torch

        if settings.tensor_parallel_rank is None and torch.cuda.device_count() < settings.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={settings.tensor_parallel_size} needs one GPU per rank; this "
                             f"machine has {torch.cuda.device_count()}")
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return TensorParallelGroup.connect(rank, settings.tensor_parallel_size, settings.tensor_parallel_master_addr,
                                       master_port, device, settings.step_timeout_s,
                                       rendezvous_timeout_s=min(settings.step_timeout_s, 120.0))


#: the settings every rank of a group must share (the rest are each process's own)
SHARED_SETTINGS = ("tensor_parallel_size", "dtype", "block_size", "num_gpu_blocks_override", "kv_cache_memory_bytes",
                   "attention_backend", "native_cpu_kernels", "max_model_len", "seed")


def check_same_settings(tp: TensorParallelGroup, settings: Settings, model_info: ModelInfo) -> None:
    """Compare this rank's settings and model with rank 0's.

    Raises:
        ValueError: they differ (the message names what differs); rank 0 then sees this rank
            leave the group.
    """
    mine = {name: str(getattr(settings, name)) for name in SHARED_SETTINGS}
    mine["model"] = model_info.name
    first = json.loads(tp.broadcast_bytes(json.dumps(mine).encode() if tp.is_first_rank else None))
    differ = [f"{k}: rank 0 has {first.get(k)!r}, rank {tp.rank} {v!r}" for k, v in mine.items() if first.get(k) != v]
    if differ:
        raise ValueError("the ranks of a tensor-parallel group must share their settings; " + "; ".join(differ))


def start_beating(tp: TensorParallelGroup, interval_s: float) -> None:
    """Count this rank's liveness in the store every ``interval_s``, from a daemon thread."""
    def beat() -> None:
        while True:
            try:
                tp.beat()
            except Exception:  # the store (rank 0) is gone: the collectives say so too
                return
            time.sleep(interval_s)

    threading.Thread(target=beat, name="tp-liveness", daemon=True).start()


class TensorParallelDriver:
    """Rank 0's runner: what :class:`ModelRunner` does, on every rank of the group.

    Each call is sent to the other ranks first, then run here; call it from one thread only
    (the collectives of the ranks must come in the same order).
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.tp = runner.tp
        self._sampled: dict[str, int] = {}  # by the last step: sent with the next message
        self.num_blocks, self.block_size = runner.num_blocks, runner.block_size
        self.broken = False  # a call failed: the ranks may be anywhere in it, send nothing more

    @property
    def structured(self) -> StructuredOutputManager:
        """Rank 0's grammar matchers (the other ranks hold none)."""
        return self.runner.structured

    def _send(self, message: RankMessage) -> None:
        """Broadcast ``message``; a failed broadcast breaks the group for good.

        Raises:
            RuntimeError: the group failed (now or earlier).
        """
        if self.broken:
            raise RuntimeError("the tensor-parallel group failed earlier")
        try:
            self.tp.broadcast_bytes(encode(message))
        except BaseException:
            self.broken = True
            raise

    def execute(self, plan: StepPlan) -> StepResult:
        """:meth:`ModelRunner.execute` on every rank; the result is rank 0's.

        Raises:
            RuntimeError: a collective failed (a rank died): the group cannot go on.
        """
        self._send(RankMessage("step", plan, self._sampled))
        self._sampled = {}
        try:
            result = self.runner.execute(plan)
        except BaseException:  # the other ranks may be anywhere inside the step
            self.broken = True
            raise
        self._sampled = dict(result.sampled_token_ids)
        return result

    def reset(self) -> None:
        """:meth:`ModelRunner.reset` on every rank."""
        self._send(RankMessage("reset"))
        self._sampled = {}
        self.runner.reset()

    def keepalive(self) -> None:
        """Tell the waiting ranks that rank 0 is alive (raises if one is not)."""
        self._send(RankMessage("keepalive"))

    def stop(self) -> None:
        """Ask the other ranks to exit (not after a failure: they may be inside a collective)."""
        if not self.broken:
            try:
                self._send(RankMessage("stop"))
            except Exception:
                pass


def serve_rank(runner: ModelRunner) -> None:
    """The loop of a rank other than 0: run what rank 0 sends until it says stop.

    Raises:
        RuntimeError: a collective failed (rank 0 or another rank died, or the group's
            timeout passed): the caller exits.
    """
    while True:
        message = decode(runner.tp.broadcast_bytes(None), RankMessage)
        if message.sampled:
            runner.append_sampled(message.sampled)
        if message.kind == "step":
            runner.execute(message.plan)
        elif message.kind == "reset":
            runner.reset()
        elif message.kind == "stop":
            return


def run_rank(settings: Settings, model_info: ModelInfo) -> None:
    """A rank other than 0, in this process (``pagedllm service executor`` with
    ``tensor_parallel_rank`` >= 1): join the group, load this rank's part, serve rank 0.

    Raises:
        RuntimeError: the group failed (see :func:`serve_rank`).
    """
    rank = settings.tensor_parallel_rank
    if settings.tensor_parallel_master_port is None:
        raise ValueError("a tensor-parallel rank other than 0 needs tensor_parallel_master_port (rank 0's)")
    tp = connect_rank(settings, rank, settings.tensor_parallel_master_port)
    start_beating(tp, settings.heartbeat_interval_s)
    check_same_settings(tp, settings, model_info)
    runner = ModelRunner(settings, model_info, tp)
    log.info("tp_rank_serving", tp_rank=rank, tp_size=tp.world_size)
    serve_rank(runner)
    log.info("tp_rank_stopped", tp_rank=rank)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (rank 0's rendezvous when none is set)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankProcesses:
    """Ranks 1..N-1 of a group as child processes of rank 0 on this machine (``pagedllm
    service executor --tensor-parallel-rank K``), each dying with its parent."""

    def __init__(self, settings: Settings, master_port: int) -> None:
        from shared.nats_server import die_with_parent

        base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, settings.tensor_parallel_size):
            rank_settings = settings.model_copy(update=dict(tensor_parallel_rank=rank,
                                                            tensor_parallel_master_port=master_port))
            env = {**base, **rank_settings.to_env()}
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.cli", "service", "executor"], env=env,
                preexec_fn=lambda: die_with_parent(signal.SIGKILL))

    def exited(self) -> tuple[int, int] | None:
        """``(rank, exit code)`` of a rank process that has exited, if any."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return rank, proc.returncode
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to exit (after rank 0's stop message), then kill what is left."""
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def check_splittable(model_info: ModelInfo, tp_size: int) -> None:
    """Refuse at once, before any rank starts, a model whose heads cannot be split.

    Raises:
        ValueError: :func:`~services.executor.parallel.partition.attention_heads`'s message.
    """
    hf_config = AutoConfig.from_pretrained(model_info.path)
    heads, kv_heads = config_value(hf_config, "num_attention_heads"), num_kv_heads_of(hf_config)
    for rank in range(tp_size):
        attention_heads(heads, kv_heads, tp_size, rank)
