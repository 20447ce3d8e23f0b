"""Attention metadata of one step and the attention backends the model layers call.

The runner builds one :class:`AttentionMetadata` per forward pass (flat vLLM V1 layout); every
attention layer calls ``backend.forward(query, key, value, key_cache, value_cache, meta, scale)``,
which writes the new tokens' K/V into that layer's paged cache and attends.

Backends (:func:`get_attention_backend`):
    "torch"     :class:`TorchBackend`, the fast CPU path (``kernels/cpu/torch_attention.py``); the
                default on CPU ("auto").
    "reference" :class:`ReferenceBackend`, ``kernels/reference.py`` (the oracle), slow.
    "triton"    :class:`TritonBackend`, ``kernels/triton/`` (one launch per layer for the mixed
                batch); the default on CUDA ("auto"). On CPU tensors only under
                ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import reference
from kernels.cpu import attention_plan, ops
from kernels.cpu import torch_attention as torch_attn


@dataclass
class AttentionMetadata:
    """Where the new tokens of one step go in the paged cache and what they attend to.

    Tensors (on the model's device):
        slot_mapping:    [T] int64, cache slot of each new token (``block_id * block_size + off``);
                         a negative slot means "do not write" (padding).
        query_start_loc: [B+1] int32, sequence b's new tokens are rows ``qsl[b]:qsl[b+1]``.
        seq_lens:        [B] int32, cached context + new tokens of each sequence.
        block_tables:    [B, max_blocks] int32, logical -> physical block ids (padding ignored).
    Host-side copies (so backends plan without device syncs):
        query_lens, seq_lens_list: the same lengths as Python lists.
        max_query_len, max_seq_len: their maxima.
        num_decodes: sequences with exactly one new token (computed when not given).
        num_prompt_tokens: each sequence's prompt length (None: not known), for what depends on
            the whole prompt while it is prefilled in chunks (LongRoPE's choice of factors).
    ``backend_state`` is filled by a backend on the first layer with data derived from this
    metadata (gather indices, masks) and reused by the other layers of the same forward pass.
    Sequences may come in any order (the runner puts decodes first, which saves a copy).
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_lens: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    num_decodes: int | None = None
    num_prompt_tokens: list[int] | None = None
    backend_state: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_decodes is None:
            self.num_decodes = sum(1 for q in self.query_lens if q == 1)

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences in the step."""
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens in the step."""
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        num_prompt_tokens: Sequence[int] | None = None,
    ) -> AttentionMetadata:
        """Build the metadata from host lists (tests, simple drivers).

        Args:
            query_lens: new tokens of each sequence.
            seq_lens: cached context + new tokens of each sequence (``>= query_lens``).
            block_tables: physical block ids of each sequence, enough for ``seq_lens``.
            block_size: tokens per cache block.
            num_prompt_tokens: each sequence's prompt length, when known.
        """
        query_lens, seq_lens = list(map(int, query_lens)), list(map(int, seq_lens))
        max_blocks = max((len(t) for t in block_tables), default=0) or 1
        table = torch.zeros((len(block_tables), max_blocks), dtype=torch.int32)
        slots: list[int] = []
        for b, (blocks, q_len, seq_len) in enumerate(zip(block_tables, query_lens, seq_lens, strict=True)):
            if len(blocks) * block_size < seq_len or q_len > seq_len:
                raise ValueError(f"sequence {b}: {len(blocks)} blocks cannot hold {seq_len} tokens")
            table[b, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len))
        qsl = [0]
        for q_len in query_lens:
            qsl.append(qsl[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_prompt_tokens=None if num_prompt_tokens is None else list(map(int, num_prompt_tokens)),
        )


class AttentionBackend(ABC):
    """Writes a layer's new K/V into its paged cache, then computes paged causal attention."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, H, D], dtype of query
        """Cache the new tokens' K/V at ``meta.slot_mapping`` and return the attention output.

        ``sliding_window`` w: a token attends to the last w positions, itself included
        (Mistral, Gemma 2's local layers); ``soft_cap`` c: scores become ``c * tanh(s / c)``
        before the softmax (Gemma 2). Their semantics are :func:`kernels.reference.paged_attention`'s.
        """


    def native_rows(
        self,
        meta: AttentionMetadata,
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], one layer's
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,  # the queries'
    ) -> attention_plan.NativeRows | None:
        """The step's rows when this backend's C kernel attends every one of them, in order
        (the CPU fast path that runs every decoder layer in one C call needs that), else ``None``."""
        return None


class ReferenceBackend(AttentionBackend):
    """``kernels.reference``: one sequence at a time in float32. Slow; the oracle."""

    name = "reference"

    def forward(self, query, key, value, key_cache, value_cache, meta, scale, sliding_window=None, soft_cap=None):
        reference.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        return reference.paged_attention(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            sliding_window, soft_cap,
        )


class TorchBackend(AttentionBackend):
    """``kernels.cpu.torch_attention``: the CPU default.

    With ``native`` (and a C compiler to build it), decodes and short prefills / chunks run in
    the native C kernel (``kernels.cpu.ops``), the rest in torch ops (block gathers and
    batched decode matmuls, batched prefill SDPA). The per-forward plan (indices, masks) is
    cached in ``meta.backend_state`` under ``("torch", num_kv_heads, block_size, native)``, so
    only the first layer builds it.
    """

    name = "torch"

    def __init__(self, native: bool = True) -> None:
        self.native = native
        if native:
            ops.load()  # build the C kernel now, not during the first step

    def forward(self, query, key, value, key_cache, value_cache, meta, scale, sliding_window=None, soft_cap=None):
        plan = self.plan(query, key_cache, meta)
        if sliding_window is None and soft_cap is None:
            return torch_attn.paged_attention(query, key, value, key_cache, value_cache, plan, scale)
        # a window or a soft cap: one sequence at a time in float32 (the oracle's arithmetic)
        torch_attn.write_kv(key, value, key_cache, value_cache, plan)
        return reference.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, scale, sliding_window, soft_cap)

    def native_rows(self, meta, key_cache, num_heads, head_dim, dtype) -> attention_plan.NativeRows | None:
        if not self.native:
            return None
        probe = torch.empty((1, num_heads, head_dim), dtype=dtype)  # the query's shape for the plan's checks
        plan = self.plan(probe, key_cache, meta)
        rows = plan.native
        if rows is None or rows.rows is not None or plan.decode is not None or plan.prefills or plan.chunks:
            return None
        return rows

    def plan(self, query, key_cache, meta) -> attention_plan.TorchAttentionPlan:
        """This step's plan for queries shaped like ``query`` ``[T, H, D]``: built by the
        first layer (or by :meth:`native_rows`), then reused."""
        plan = meta.backend_state.get(("torch", key_cache.shape[2], key_cache.shape[1], self.native))
        if plan is None:  # first layer of the step: decide and check once
            plan = self._first_plan(query, key_cache, meta)
        return plan

    def _first_plan(self, query, key_cache, meta) -> attention_plan.TorchAttentionPlan:
        """Build this step's plan (first layer), deciding once whether the C kernel serves it."""
        native = self.native and ops.supports(query, key_cache)
        plan = attention_plan.build_plan(
            meta.query_lens, meta.seq_lens_list, meta.block_tables, meta.slot_mapping,
            key_cache.shape[1], key_cache.shape[2], native=native,
        )
        if plan.native is not None and plan.native.block_index.numel():
            # the C kernel reads block ids unchecked: refuse a bad plan here, once per step
            top = int(plan.native.block_index.max())
            if top >= key_cache.shape[0] or int(plan.native.block_index.min()) < 0:
                raise ValueError(f"block table names block {top} outside the cache's {key_cache.shape[0]} blocks")
        meta.backend_state[("torch", key_cache.shape[2], key_cache.shape[1], self.native)] = plan
        return plan


class TritonBackend(AttentionBackend):
    """``kernels.triton.cache`` + ``kernels.triton.attention``: one launch per layer for the
    mixed batch; the CUDA default. On CPU tensors it needs ``TRITON_INTERPRET=1`` set before
    triton is first imported (tests only). Triton is imported when the backend is built."""

    name = "triton"

    def __init__(self) -> None:
        from kernels.triton import attention as triton_attention
        from kernels.triton import cache as triton_cache

        self._attention = triton_attention.paged_attention
        self._cache = triton_cache.reshape_and_cache

    def forward(self, query, key, value, key_cache, value_cache, meta, scale, sliding_window=None, soft_cap=None):
        self._cache(key, value, key_cache, value_cache, meta.slot_mapping)
        return self._attention(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            sliding_window, soft_cap, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
        )


# factory(device, native_cpu_kernels) -> backend
BackendFactory = Callable[[torch.device, bool], AttentionBackend]
_BACKENDS: dict[str, BackendFactory] = {
    "torch": lambda device, native_cpu_kernels: TorchBackend(native=native_cpu_kernels),
    "reference": lambda device, native_cpu_kernels: ReferenceBackend(),
    "triton": lambda device, native_cpu_kernels: TritonBackend(),
}


def get_attention_backend(
    name: str, device: torch.device | str, native_cpu_kernels: bool = True
) -> AttentionBackend:
    """The attention backend called ``name`` for ``device``.

    ``"auto"`` is ``"torch"`` on CPU and ``"triton"`` on CUDA. ``native_cpu_kernels=False``
    keeps the torch backend on torch ops (no C kernel).

    Raises:
        ValueError: unknown backend name.
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    factory = _BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return factory(device, native_cpu_kernels)
