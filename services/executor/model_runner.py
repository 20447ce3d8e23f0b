"""ModelRunner: turns a ``StepPlan`` into flat tensors, runs the model, samples.

Per step it builds (vLLM V1 flat layout, decodes first):
    input_ids[T] int64, positions[T] int64, slot_mapping[T] int64,
    block_tables[B, max_blocks] int32, seq_lens[B] int32, query_start_loc[B+1] int32
and samples one token for each request whose computed tokens reach its known tokens.
The runner keeps each request's tokens and block table between steps, so a plan carries
only what changed (``request_states.py``: that state, the plan's diffs applied to it, the
n > 1 forks). How each step's forward pass runs, layer by layer or every decoder layer in one
C call, is the runner's choice (``forward_pass.py``), made once per step.

Under tensor parallelism every rank runs a runner over its part of the model and of the KV
cache (``tp_group/``: the rank processes that drive the runners): all of them run every step's
forward together (the layers' collectives, ``parallel/``), rank 0 alone gets the gathered
logits and samples; the other ranks learn the sampled tokens from rank 0's next message
(:meth:`ModelRunner.append_sampled`).
"""

from __future__ import annotations

import inspect
import json
import time
from concurrent import futures
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from kernels.cpu import native
from services.executor.attention import AttentionMetadata, get_attention_backend
from services.executor.cpu_threads import CpuThreadGovernor
from services.executor.device import resolve_device
from services.executor.forward_pass import ForwardPass
from services.executor.model_loader import quantization_config
from services.executor.models import get_model_class, kv_cache_bytes_per_block, kv_cache_shape
from services.executor.models.base import QUANTIZED_ARCHITECTURES
from services.executor.parallel.group import SINGLE_RANK, TensorParallelGroup, use_tp_group
from services.executor.request_states import CachedRequestState, fork_states, update_states
from services.executor.sampler import Sampler, compute_logprobs
from services.executor.sampling_columns import SamplingColumns
from services.executor.structured_output import StructuredOutputManager
from shared.config import DEFAULT_CPU_KV_CACHE_BYTES, Settings, kernel_cache_dir
from shared.logging import get_logger
from shared.messages import PromptLogprobs, SampleLogprobs, StepPlan, StepResult
from shared.model_source import ModelInfo

log = get_logger("executor")
PROMPT_LOGITS_ROWS = 256  # prompt rows whose logits are computed at once (prompt_logprobs)


def resolve_dtype(setting: str, model_path: Path) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (``torch_dtype``/``dtype`` in config.json)."""
    if setting != "auto":
        return getattr(torch, setting)
    config = json.loads((model_path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


class ModelRunner:
    """Owns the model weights, the paged KV cache tensors and the per-request state (of one
    tensor-parallel rank: ``tp``, default a single rank; its device is ``tp.device`` then).

    Raises:
        ValueError: the model's heads cannot be split over ``tp``'s ranks; a KV cache budget
            smaller than one block.
    """

    def __init__(self, settings: Settings, model_info: ModelInfo, tp: TensorParallelGroup | None = None) -> None:
        self.settings = settings
        self.model_info = model_info
        self.tp = tp or SINGLE_RANK
        self.device = self.tp.device if self.tp.world_size > 1 else resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, model_info.path)
        self.block_size = settings.block_size
        self.hf_config = AutoConfig.from_pretrained(model_info.path)
        native_cpu = settings.native_cpu_kernels and self.device.type == "cpu"
        if native_cpu:  # prepare-model built it, else now
            native.load(kernel_cache_dir(settings.cache_dir))
        model_cls = get_model_class(self.hf_config)
        quant = quantization_config(model_info.path, self.hf_config, settings.quantization)  # ValueError naming it
        quant_kwargs = {} if quant is None else {"quant_config": quant}
        if quant is not None and "quant_config" not in inspect.signature(model_cls).parameters:
            raise ValueError(f"{quant.name} quantization is not supported for {model_cls.__name__} "
                             f"(quantized checkpoints: {QUANTIZED_ARCHITECTURES})")
        t0 = time.perf_counter()
        self.attn_backend = get_attention_backend(
            settings.attention_backend, self.device, native_cpu_kernels=settings.native_cpu_kernels
        )
        # its kernels are chosen here, once (services/executor/layers/selection.py); its layers
        # take this rank's part (services/executor/parallel/)
        with torch.device(self.device), use_tp_group(self.tp):
            self.model = model_cls(self.hf_config, dtype=self.dtype, device=self.device, attn_backend=self.attn_backend,
                                   native_cpu_kernels=settings.native_cpu_kernels, **quant_kwargs)
        self.model.load_weights(model_info.path)
        self.model.eval()
        self.forward_pass = ForwardPass(self.model)
        self.num_blocks = self._num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.sampler = Sampler(settings.seed, self.device, model_info.eos_token_ids, native_kernels=native_cpu)
        self.requests: dict[str, CachedRequestState] = {}
        # their sampling parameters, one row each, written when they join (host tensors off the
        # first rank, which alone samples)
        self.sampling_columns = SamplingColumns(model_info.vocab_size, model_info.eos_token_ids,
                                                self.device if self.tp.is_first_rank else torch.device("cpu"),
                                                settings.max_num_seqs)
        # the grammar matchers of structured outputs: rank 0's, which samples
        self.structured = StructuredOutputManager(model_info.path, model_info.vocab_size, model_info.eos_token_ids)
        self.cpu_threads = self._cpu_thread_governor()
        log.info(
            "model_loaded",
            model=str(model_info.path),
            tp_rank=self.tp.rank,
            tp_size=self.tp.world_size,
            dtype=str(self.dtype),
            device=str(self.device),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            native_matmuls=self.model.native_matmuls,
            native_norms=self.model.native_norms,
            load_s=round(time.perf_counter() - t0, 2),
        )

    def reset(self) -> None:
        """Forget every request's state (the group registers again: the scheduler recomputes
        its requests from their first token). The KV cache keeps its content; nothing reads
        it again before a plan writes it."""
        self.requests.clear()
        self.sampling_columns.clear()
        self.structured.clear()

    def append_sampled(self, sampled_token_ids: dict[str, int]) -> None:
        """Append the tokens rank 0 sampled for these requests in the previous step (the
        other ranks of a tensor-parallel group, before running the next one)."""
        for request_id, token in sampled_token_ids.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.token_ids.append(token)

    def _cpu_thread_governor(self) -> CpuThreadGovernor | None:
        """On CPU: apply ``cpu_threads`` to the calling (model) thread, and adapt it to the
        cores other processes leave free when ``adaptive_cpu_threads`` (see cpu_threads.py)."""
        if self.device.type != "cpu":
            return None
        # the ranks of a group on one machine share its cores
        threads = self.settings.cpu_threads or max(1, torch.get_num_threads() // self.tp.world_size)
        torch.set_num_threads(threads)
        if not self.settings.adaptive_cpu_threads or threads == 1:
            return None
        return CpuThreadGovernor(threads)

    # ------------------------------------------------------------------ KV cache

    def _num_blocks(self) -> int:
        """The pool's blocks: what fits this rank's budget (``kv_cache_memory_bytes`` is per
        rank, as vLLM's is per GPU), the least over the ranks so that a block id means the same
        slots on every rank."""
        if self.settings.num_gpu_blocks_override is not None:
            return self.tp.min_over_ranks(self.settings.num_gpu_blocks_override)
        per_block = kv_cache_bytes_per_block(self.hf_config, self.block_size, self.dtype,
                                             self.model.num_kv_heads_per_rank)
        budget = self.settings.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.8)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = self.tp.min_over_ranks(budget // per_block)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} is smaller than one block ({per_block} bytes)")
        return num_blocks

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = kv_cache_shape(self.hf_config, num_blocks, self.block_size, self.model.num_kv_heads_per_rank)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.hf_config.num_hidden_layers)
        ]

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` gets ``src``'s K/V in every layer, before the step."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    # ------------------------------------------------------------------ step

    def _prepare_inputs(
        self, states: list[CachedRequestState], query_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[CachedRequestState]]:
        """The step's flat inputs: input_ids [T] int64, positions [T] int64, the attention
        metadata, the token row that samples for each request that samples, and those requests.

        Built in numpy (a few microseconds per array, cheaper than small torch ops); a
        pure decode step takes a shortcut (one token per request, all of them sampling).
        """
        bs = self.block_size
        num_seqs = len(states)
        starts = [s.num_computed_tokens for s in states]
        seq_lens = [st + n for st, n in zip(starts, query_lens, strict=True)]
        # the sequences whose computed tokens reach their known tokens sample one token
        samples = [i for i, (s, sl) in enumerate(zip(states, seq_lens, strict=True)) if sl == len(s.token_ids)]
        if query_lens[-1] == 1:  # decodes come first, so every sequence decodes one token
            ids_list = [s.token_ids[st] for s, st in zip(states, starts, strict=True)]
            pos = np.array(starts, dtype=np.int64)  # [T]
            rows = np.arange(num_seqs)  # [T] sequence of each token
            logits_rows = samples  # token row == sequence
        else:
            ids_list = []
            for s, st, n in zip(states, starts, query_lens, strict=True):
                ids_list.extend(s.token_ids[st : st + n])
            ends = np.cumsum(query_lens)  # [B] one past each sequence's last token row
            rows = np.repeat(np.arange(num_seqs), query_lens)  # [T]
            offset = np.repeat(np.array(starts, dtype=np.int64) - (ends - query_lens), query_lens)
            pos = np.arange(len(ids_list), dtype=np.int64) + offset  # [T] absolute positions
            logits_rows = [int(ends[i]) - 1 for i in samples]
        sample_states = [states[i] for i in samples]
        max_blocks = max(len(s.block_ids) for s in states)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)  # [B, max_blocks]
        for i, s in enumerate(states):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        slot_mapping = block_tables[rows, pos // bs].astype(np.int64) * bs + pos % bs  # [T]
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            query_lens=list(query_lens),
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_prompt_tokens=[s.num_prompt_tokens for s in states],
        )
        input_ids = torch.tensor(ids_list, dtype=torch.int64, device=dev)  # [T]
        return input_ids, torch.from_numpy(pos).to(dev), meta, logits_rows, sample_states

    def _prompt_logprobs(
        self, hidden: torch.Tensor, states: list[CachedRequestState], query_lens: list[int]
    ) -> dict[str, PromptLogprobs]:
        """The log probabilities of the prompt tokens that this step's rows predict (row of
        position p -> prompt token p + 1), for the requests that want them; before the step's
        ``num_computed_tokens`` are counted. The logits are computed ``PROMPT_LOGITS_ROWS``
        rows at a time (a long prefill chunk would need ``rows * vocab`` float32 at once)."""
        out: dict[str, PromptLogprobs] = {}
        row = 0
        for state, n in zip(states, query_lens, strict=True):
            k = state.sampling_params.prompt_logprobs
            first, end = state.num_computed_tokens, min(state.num_computed_tokens + n, state.num_prompt_tokens - 1)
            if state.wants_prompt_logprobs and k is not None and end > first:
                targets = state.token_ids[first + 1 : end + 1]
                entries: list[SampleLogprobs] = []
                for i in range(0, end - first, PROMPT_LOGITS_ROWS):
                    rows = torch.arange(row + i, row + min(end - first, i + PROMPT_LOGITS_ROWS), device=self.device)
                    logits = self.model.compute_logits(hidden[rows])  # [R, V] f32; None off rank 0
                    if logits is None:
                        continue
                    chunk = targets[i : i + PROMPT_LOGITS_ROWS]
                    entries.extend(lp for lp in compute_logprobs(logits, chunk, [k] * len(chunk)) if lp is not None)
                out[state.request_id] = PromptLogprobs(start=first + 1, token_ids=targets, logprobs=entries)
            row += n
        return out if self.tp.is_first_rank else {}

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Returns the sampled token id of each request that got one, and its
        log probabilities where the request asks for them (``SamplingParams.logprobs``).

        Raises:
            KeyError: the plan names a request this runner never received.
        """
        if self.cpu_threads is not None:
            self.cpu_threads.before_step()
        update_states(self.requests, self.sampling_columns, plan, self.sampler, self.structured,
                      self.model_info.vocab_size, self.tp.is_first_rank)
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        # decodes first, then prefills (the order attention backends expect)
        order = sorted(plan.num_scheduled_tokens.items(), key=lambda kv: kv[1] != 1)
        if not order:
            return StepResult(step_id=plan.step_id, group_id=plan.group_id)
        states = [self.requests[rid] for rid, _ in order]
        input_ids, positions, meta, logits_rows, sample_states = self._prepare_inputs(states, [n for _, n in order])
        # the constrained rows' bitmask is filled while the model runs (a fork adds rows after it)
        early_mask = (self.structured.bitmask_async([s.request_id for s in sample_states])
                      if sample_states and not plan.forks and self.tp.is_first_rank else None)
        try:
            return self._run(plan, order, states, input_ids, positions, meta, logits_rows, sample_states, early_mask)
        except BaseException:
            if early_mask is not None:  # not left filling masks under the recovery's clear()
                early_mask.cancel()
                futures.wait([early_mask])
            raise

    def _run(self, plan: StepPlan, order: list[tuple[str, int]], states: list[CachedRequestState],
             input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_rows: list[int],
             sample_states: list[CachedRequestState],
             early_mask: futures.Future[tuple[torch.Tensor, list[int]] | None] | None) -> StepResult:
        """:meth:`execute` from the forward pass on: the model, the logits, the sample."""
        hidden = self.forward_pass(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        result = StepResult(step_id=plan.step_id, group_id=plan.group_id)
        if any(s.wants_prompt_logprobs for s in states):
            result.prompt_logprobs = self._prompt_logprobs(hidden, states, [n for _, n in order])
        for state, (_, n) in zip(states, order, strict=True):
            state.num_computed_tokens += n
        if not sample_states:
            return result
        if plan.forks:
            fork_states(self.requests, self.sampling_columns, plan.forks, sample_states, logits_rows, self.sampler,
                        self.structured, self.model_info.vocab_size, self.tp.is_first_rank)
        if logits_rows != list(range(hidden.shape[0])):  # else every row samples (pure decode)
            hidden = hidden[torch.tensor(logits_rows, device=self.device)]
        logits = self.model.compute_logits(hidden)  # [N, V] f32
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            return result
        sample_ids = [s.request_id for s in sample_states]
        # [R, ceil(V / 32)] of the constrained rows: filled during the forward pass, or now for a
        # step that forked samples (without a fork, no early mask means no constrained row)
        if early_mask is not None:
            bitmask = early_mask.result()
        else:
            bitmask = self.structured.bitmask(sample_ids) if plan.forks else None
        sampling = self.sampling_columns.gather([s.sampling_row for s in sample_states])
        tokens = self.sampler.sample_rows(logits, sampling, [s.token_ids for s in sample_states],
                                          [s.num_prompt_tokens for s in sample_states], bitmask=bitmask)
        if bitmask is not None:
            self.structured.accept(sample_ids, tokens)
        for state, tok in zip(sample_states, tokens, strict=True):
            state.token_ids.append(tok)
            result.sampled_token_ids[state.request_id] = tok
        # a beam-search row returns the top continuations its scheduler picks the next beams from
        num_top = sampling.num_top()
        if num_top is not None:
            for state, lp in zip(sample_states, compute_logprobs(logits, tokens, num_top), strict=True):
                if lp is not None:
                    result.logprobs[state.request_id] = lp
        return result
