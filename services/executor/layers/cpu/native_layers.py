"""Every decoder layer of a bf16 Llama-family model in one C call per step (``kernels/cpu/csrc/cpu_llama_layers.c``).

Where the panels (``panels.py``) or GGUF blocks (``layers/quantization/gguf/``) serve every matmul and the C norms every norm, the per-layer
path is ~25 Python-level calls per layer around C kernels; :class:`NativeLayers` strings the
same kernels together in C with the same roundings, for steps whose every attention row the
backend's C kernel serves (``AttentionBackend.native_rows``), of at most ``max_rows`` tokens
where GGUF blocks in the file's layout serve a matmul. A merged matmul whose shards are GGUF blocks
of different types (``GGUFShardedLinearMethod``: llama.cpp's Q4_K_M files' Q6_K ``attn_v`` beside
Q4_K ``attn_q`` / ``attn_k``) runs there too, one GGUF GEMM per shard into its columns of the
output (the argument block's ``nshard``). Its weights are the layers' own panels or blocks and
norm weights (pointers, no copies).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import nn

from kernels.cpu import native, ops
from kernels.cpu.attention_plan import NativeRows
from services.executor.layers.quantization.gguf import (
    NATIVE_MAX_ROWS,
    GGUFLinearMethod,
    GGUFShardedLinearMethod,
)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V [num_blocks, block_size, Hkv, D]


def _projections(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's four linear layers, by the C argument block's names (in its ``wtype`` order)."""
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}


def _gguf(proj: nn.Module) -> GGUFLinearMethod | None:
    """The layer's GGUF method when the C call can serve it (native, no bias), else None."""
    method = getattr(proj, "quant_method", None)
    return method if isinstance(method, GGUFLinearMethod) and method.native and proj.bias is None else None


def _shards(proj: nn.Module) -> list[tuple[torch.Tensor, GGUFLinearMethod]] | None:
    """A merged layer's shards of GGUF blocks (``GGUFShardedLinearMethod``), each its blocks
    ``[rows, K / block_size * block_bytes]`` uint8 and method, when the C call can serve them
    (every part native, no bias, at most the library's ``max_shards``), else None."""
    method = getattr(proj, "quant_method", None)
    if not (isinstance(method, GGUFShardedLinearMethod) and proj.bias is None
            and all(m.native for m in method.parts) and len(method.parts) <= ops.load().abi.max_shards):
        return None
    return [(part.weight, m) for m, part in zip(method.parts, proj.gguf_shards, strict=True)]


class NativeLayers:
    """The pointer arrays of ``pagedllm_llama_layers_bf16`` for a model's decoder layers and
    one set of KV cache tensors (the caller builds them again when the caches change:
    :meth:`cache_key`; ``services/executor/forward_pass.py`` decides when they run a step)."""

    def __init__(self, layers: Sequence[nn.Module], kv_caches: KVCaches) -> None:
        first = layers[0]
        attn = first.self_attn
        a = native.LlamaLayersArgs()
        a.num_layers, a.hidden, a.inter = len(layers), first.hidden_size, first.mlp.intermediate_size
        a.num_heads, a.num_kv_heads, a.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        key_cache = kv_caches[0][0]
        a.block_size, a.num_slots = key_cache.shape[1], key_cache.shape[0] * key_cache.shape[1]
        a.eps, a.scale = first.input_layernorm.variance_epsilon, attn.attn.scale
        self._arrays = []  # keeps the ctypes pointer arrays alive

        def pointers(values: list[torch.Tensor | None]) -> ctypes.Array:
            arr = (ctypes.c_void_p * len(values))(*[None if v is None else v.data_ptr() for v in values])
            self._arrays.append(arr)
            return ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))

        a.in_norm = pointers([layer.input_layernorm.weight for layer in layers])
        a.post_norm = pointers([layer.post_attention_layernorm.weight for layer in layers])
        projections = [_projections(layer) for layer in layers]
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(a, f"{name}_w", pointers([None if _shards(p[name]) else p[name].weight if _gguf(p[name])
                                              else p[name].panel for p in projections]))
            setattr(a, f"{name}_b", pointers([p[name].bias for p in projections]))
        flat = [p for projs in projections for p in projs.values()]  # [L * 4], in wtype's order
        gguf = [_gguf(p) for p in flat]
        self._wtype = torch.tensor([0 if m is None else m.kernel_type for m in gguf], dtype=torch.int32)
        a.wtype = self._wtype.data_ptr()
        shards = [_shards(p) or [] for p in flat]
        # [L * 4] shard counts, [L * 4 * max_shards] types and rows (0 past a matmul's shards); None: no merged
        # matmul of several GGUF types (nshard NULL)
        self._nshard = self._shard_type = self._shard_rows = None
        if any(shards):
            width = ops.load().abi.max_shards
            padded = [s[i] if i < len(s) else None for s in shards for i in range(width)]
            self._nshard = torch.tensor([len(s) for s in shards], dtype=torch.int32)
            self._shard_type = torch.tensor([s[1].kernel_type if s else 0 for s in padded], dtype=torch.int32)
            self._shard_rows = torch.tensor([s[0].shape[0] if s else 0 for s in padded], dtype=torch.int64)
            a.nshard, a.shard_type, a.shard_rows = (self._nshard.data_ptr(), self._shard_type.data_ptr(),
                                                    self._shard_rows.data_ptr())
            a.shard_w = pointers([s[0] if s else None for s in padded])
        methods = [m for m in gguf if m is not None] + [m for s in shards for _, m in s]
        # GGUF blocks in the file's layout (a weight whose rows are not a multiple of 16): the C kernel unpacks a
        # block once per 8 rows (16 on its int8 path); over NATIVE_MAX_ROWS the per-layer path (a dequantized weight
        # in torch's GEMM) is quicker. The 16-row interleaved int8 kernels (gguf/r16.py: every type, K-quants included)
        # are quicker at every row count.
        self.max_rows = NATIVE_MAX_ROWS if any(not m.r16 for m in methods) else None
        a.k_cache = pointers([k for k, _ in kv_caches])
        a.v_cache = pointers([v for _, v in kv_caches])
        self.args = a
        self._widths = {"x": a.hidden, "qkv": (a.num_heads + 2 * a.num_kv_heads) * a.head_dim,
                        "attn": a.num_heads * a.head_dim, "gate_up": 2 * a.inter, "act": a.inter, "delta": a.hidden}

    @staticmethod
    def applies(layers: Sequence[nn.Module], kv_caches: KVCaches) -> bool:
        """Whether these layers and caches can run here: panels (or GGUF blocks the C kernel
        serves, without bias, of one type or, for a merged layer, one type per shard) on every
        matmul and the C norms on every norm (the per-layer path's kernels), one dense bf16
        cache pair per layer, all of one shape, head_dim even and within the library's
        ``max_rope_dim``."""
        shape = kv_caches[0][0].shape if kv_caches else None
        head_dim = layers[0].self_attn.head_dim
        return (
            len(kv_caches) == len(layers)
            and all(getattr(p, "panel", None) is not None or _gguf(p) is not None or _shards(p) is not None
                    for layer in layers for p in _projections(layer).values())
            and all(layer.input_layernorm.native and layer.post_attention_layernorm.native for layer in layers)
            and head_dim % 2 == 0 and head_dim <= ops.load().abi.max_rope_dim
            and all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.shape == shape for kv in kv_caches for t in kv)
        )

    @staticmethod
    def cache_key(kv_caches: KVCaches) -> list[tuple[int, int, torch.Size]]:
        """What the pointer arrays depend on: each cache pair's addresses and shape (asked every
        step: ``torch.Size`` as it is, half the cost of a tuple copy)."""
        return [(k.data_ptr(), v.data_ptr(), k.shape) for k, v in kv_caches]

    def run(
        self,
        h: torch.Tensor,  # [T, hidden] bf16, dense (updated in place: the last layer's residual)
        cos: torch.Tensor,  # [T, 1, D] bf16, dense
        sin: torch.Tensor,  # [T, 1, D] bf16, dense, sign-folded
        slots: torch.Tensor,  # [T] int64 cache slots (< 0: not written)
        rows: NativeRows,  # covering every row in order
    ) -> torch.Tensor:  # h
        """Run every layer over the step's ``T`` tokens.

        Raises:
            ValueError: a slot outside the cache, lengths that differ from ``T``, or a kernel
                refused its shapes.
        """
        a, t = self.args, h.shape[0]
        if not (slots.shape == (t,) and rows.row_seq.shape == (t,) and rows.row_len.shape == (t,)):
            raise ValueError(f"slots, row_seq and row_len must have the {t} rows of h")
        scratch = torch.empty(t * sum(self._widths.values()), dtype=torch.bfloat16)
        base, offset = scratch.data_ptr(), 0
        for name, width in self._widths.items():
            setattr(a, name, base + offset * 2)
            offset += t * width
        slots = slots.contiguous()
        a.T, a.h, a.cos, a.sin, a.slots = t, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        a.block_index, a.nblk = rows.block_index.data_ptr(), rows.num_blocks
        a.row_seq, a.row_len = rows.row_seq.data_ptr(), rows.row_len.data_ptr()
        a.num_threads = torch.get_num_threads()
        status = ops.load().pagedllm_llama_layers_bf16(ctypes.byref(a))
        if status == 2:
            raise ValueError(f"slot_mapping names a slot outside the cache's {a.num_slots} slots")
        if status:
            raise ValueError(f"native decoder layers failed (status {status}) for {t} tokens")
        return h
