"""Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window, Qwen2) on a paged KV cache.

Our own implementation in the style of gpt-fast / nano-vllm, numerically following Hugging Face
``modeling_llama`` (RMSNorm in float32, RoPE by ``rotate_half``, SiLU-gated MLP), so float32
outputs match ``transformers`` greedy generation token for token. Flat token layout without a
batch dimension: the new tokens of every sequence of a step are concatenated into T rows, and
the attention backend maps them to the paged cache through :class:`AttentionMetadata`.

Speed on CPU: q/k/v and gate/up are fused into one matmul each (fused at load time), RoPE
cos/sin are computed once per forward and shared by every layer, RoPE rotates q and k in one
go, and layers call the matmuls directly (no per-call module hooks). In bfloat16, steps of
several tokens run on weights prepacked once into oneDNN's blocked layout
(:class:`PackedWeights`) with SiLU and the gate * up product as epilogues of the MLP's gate and
up matmuls; single-token steps use torch's GEMV (:func:`reduced_precision_gemv`). On CPUs
with AVX512-BF16 but no AMX, and on CPUs without bf16 arithmetic (where torch emulates bf16
matmuls), every matmul runs in the native bf16-weight GEMM instead (:class:`PanelWeights`, :meth:`LlamaForCausalLM.use_native_matmuls`). RMSNorm in
bf16 on CPU is the C kernel with the attention residual add fused into it
(:meth:`LlamaForCausalLM.use_native_norms`), else in bf16/fp16 one LayerNorm kernel (:func:`rms_norm`), and the best logits of each row are
recomputed in float32 (:func:`refine_top_logits`) so that bf16 rounding does not decide greedy
ties.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import native, ops
from services.executor.attention import AttentionBackend, AttentionMetadata, get_attention_backend


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    """``cfg.name`` for a transformers config or ``cfg[name]`` for a dict."""
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


# model_type -> the class AutoModelForCausalLM builds for it, for configs without ``architectures``
_CAUSAL_LM_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architectures_of(hf_config: Any) -> list[str]:
    """The config's ``architectures``; without that entry, the causal-LM class of its
    ``model_type`` (as ``AutoModelForCausalLM`` picks it), or ``[]``."""
    archs = _get(hf_config, "architectures") or []
    if not archs and _get(hf_config, "model_type") in _CAUSAL_LM_OF_MODEL_TYPE:
        archs = [_CAUSAL_LM_OF_MODEL_TYPE[_get(hf_config, "model_type")]]
    return list(archs)


def head_dim_of(hf_config: Any) -> int:
    """Per-head size: ``head_dim`` when the config has it, else ``hidden_size // num_attention_heads``."""
    return _get(hf_config, "head_dim") or _get(hf_config, "hidden_size") // _get(hf_config, "num_attention_heads")


def num_kv_heads_of(hf_config: Any) -> int:
    """``num_key_value_heads`` (GQA), defaulting to ``num_attention_heads`` (MHA)."""
    return _get(hf_config, "num_key_value_heads") or _get(hf_config, "num_attention_heads")


def kv_cache_shape(hf_config: Any, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """Shape of one layer's K (and of its V) cache: ``[num_blocks, block_size, Hkv, head_dim]``."""
    return (num_blocks, block_size, num_kv_heads_of(hf_config), head_dim_of(hf_config))


def kv_cache_bytes_per_block(hf_config: Any, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of K and V across all layers (to size the block pool)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * num_kv_heads_of(hf_config) * head_dim_of(hf_config) * elem
    return per_layer * _get(hf_config, "num_hidden_layers")


def check_supported(hf_config: Any) -> None:
    """Refuse what this implementation would compute wrongly.

    Raises:
        ValueError: sliding-window attention (Mistral ``sliding_window`` below
            ``max_position_embeddings``, Qwen2 ``use_sliding_window`` layers), an activation
            other than SiLU, or an unsupported RoPE type.
    """
    max_pos = _get(hf_config, "max_position_embeddings", 0)
    window = _get(hf_config, "sliding_window")
    archs = architectures_of(hf_config)
    if "MistralForCausalLM" in archs and window is not None and window < max_pos:
        raise ValueError(
            f"sliding_window={window} < max_position_embeddings={max_pos}: sliding-window attention "
            "is not supported by this Mistral implementation"
        )
    if "sliding_attention" in (_get(hf_config, "layer_types") or []) or (
        _get(hf_config, "use_sliding_window", False) and window is not None and window < max_pos
    ):
        raise ValueError(f"sliding-window attention layers (sliding_window={window}) are not supported")
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    rope_parameters(hf_config)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings as one flat dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older configs use ``rope_theta``
    plus an optional ``rope_scaling`` dict (``type`` or ``rope_type``). Both are read.

    Raises:
        ValueError: a rope type other than ``default`` / ``llama3``, or per-layer-type RoPE.
    """
    params = _get(hf_config, "rope_parameters") or _get(hf_config, "rope_scaling") or {}
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {sorted(params)}")
    params.setdefault("rope_theta", _get(hf_config, "rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default' and 'llama3')")
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", _get(hf_config, "max_position_embeddings"))
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"llama3 RoPE needs {key!r} in rope parameters")
    return params


def rope_inv_freq(hf_config: Any) -> torch.Tensor:  # [head_dim // 2] float32
    """Inverse frequencies of RoPE (Su et al. 2021), with Llama 3.1 scaling for ``rope_type='llama3'``.

    Same arithmetic as ``transformers.modeling_rope_utils`` (default and ``_compute_llama3_parameters``).
    """
    params = rope_parameters(hf_config)
    dim = head_dim_of(hf_config)
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if params["rope_type"] == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope(
    x: torch.Tensor,  # [T, heads, D], q and k heads side by side
    cos: torch.Tensor,  # [T, 1, D]
    sin_signed: torch.Tensor,  # [T, 1, D], (-sin, +sin) halves
) -> torch.Tensor:  # [T, heads, D]
    """``x * cos + rotate_half(x) * sin`` with the sign of ``rotate_half`` folded into ``sin_signed``."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [T, heads, D], halves exchanged (new tensor)
    return swapped.mul_(sin_signed).add_(x * cos)  # same roundings as HF in every dtype


@contextlib.contextmanager
def reduced_precision_gemv(active: bool) -> Iterator[None]:
    """Route bf16/fp16 ``[1, K] x [K, N]`` matmuls on CPU to torch's GEMV kernel instead of oneDNN.

    For a single row the weights stream from DRAM and torch's reduced-precision GEMV (fp32
    accumulation, same result bit for bit in our measurements) streams them fastest: SmolLM2's
    30 layers take 8.1 ms against 16.7 ms in oneDNN and 12.9 ms in oneDNN on prepacked weights
    (which win only while the weights sit in cache). The switch
    (``torch._C._set_mkldnn_enabled``) is process-global, so it is set only for the duration
    of a single-token forward pass.
    """
    if not active:
        yield
        return
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(previous)


def mkldnn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PackedWeights` can serve this device and dtype (CPU bfloat16 with oneDNN)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedWeights:
    """bf16 weights ``[out, in]`` reordered once into oneDNN's blocked layout (CPU).

    ``F.linear`` on a plain bf16 weight makes oneDNN reorder (re-block) the whole weight on
    every call; :func:`torch.ops.mkldnn._reorder_linear_weight` does it once at load time and
    ``torch.ops.mkldnn._linear_pointwise`` then runs the same GEMM kernels on the prepacked
    copy (what inductor's CPU weight prepacking uses), with optional fused epilogues. Results
    equal ``F.linear`` bit for bit in our measurements. SmolLM2, 64 rows, one thread: a
    layer's four matmuls 2.24 -> 2.04 ms, the 49,152-row lm_head 33.6 -> 22.4 ms (2 threads:
    11.9 -> 9.8 ms). The packed copies are opaque mkldnn tensors held next to (not instead of)
    the parameters, which single-token steps and float32 use.
    """

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.tensors = {name: torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())
                        for name, w in weights.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


_linear_pointwise = torch.ops.mkldnn._linear_pointwise.default
_linear_binary = torch.ops.mkldnn._linear_pointwise.binary


def packed_linear(
    x: torch.Tensor,  # [T, in], contiguous
    packed: torch.Tensor,  # from PackedWeights
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [T, out]
    """``F.linear`` on a prepacked weight."""
    return _linear_pointwise(x, packed, bias, "none", [], "")


PANEL_WEIGHTS = ("qkv", "o", "gate_up", "down")  # a layer's matmuls, as ``<name>_proj_weight``
_PROJ_KEYS = {name: (f"{name}_proj_weight", f"{name}_proj_bias") for name in PANEL_WEIGHTS}


class PanelWeights:
    """bf16 weights ``[out, in]`` laid out once for :func:`kernels.cpu.ops.gemm_bf16w`.

    Used where :func:`kernels.cpu.ops.prefer_native_gemm`. On CPUs without bf16
    arithmetic the native GEMM multiplies in float32 on AVX2 + FMA straight from the bf16
    weights; SmolLM2 shapes on a 2-core AVX2 EPYC (``benchmarks/cpu_gemm.py``): 51-72 GFLOP/s
    at 16-64 rows against 8-11 for torch's emulated bf16 and 5-59 for torch's float32, and
    15-33 GB/s of weights for one row. With AVX512-BF16 (2-core Zen 4) it runs vdpbf16ps tiles:
    340-430 GFLOP/s at 16-64 rows against oneDNN's 130-315, and 70-120 GB/s of weights for
    one row (oneDNN: 12-23 GFLOP/s). A layer's panels replace its matmul
    parameters' storage (:meth:`LlamaDecoderLayer.pack_panels`); the lm_head's are a copy
    of the embedding matrix, which the lookup still needs.
    """

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.panels = {name: ops.pack_bf16_weight(w) for name, w in weights.items()}
        self.out_features = {name: w.shape[0] for name, w in weights.items()}

    def linear(
        self,
        x: torch.Tensor,  # [T, in] bf16, unit stride along in
        name: str,
        bias: torch.Tensor | None,  # [out] bf16
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:  # [T, out]
        """``F.linear(x, weight, bias)`` for the weight called ``name``."""
        return ops.gemm_bf16w(x, self.panels[name], self.out_features[name], bias, out_dtype, validate=False)


class NativeLayers:
    """All decoder layers of a bf16 model in one C call per forward pass
    (``kernels/cpu_llama_layers.c``) on the layers' :class:`PanelWeights`: the same kernels
    and roundings as :meth:`LlamaDecoderLayer.forward` with panels, without ~25 Python-level
    calls per layer. Holds the model's pointer arrays for one set of KV cache tensors.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        layers = list(model.layers)
        first = layers[0]
        a = native.LlamaLayersArgs()
        a.num_layers, a.hidden, a.inter = len(layers), model.hidden_size, first.intermediate_size
        a.num_heads, a.num_kv_heads, a.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        key_cache = kv_caches[0][0]
        a.block_size, a.num_slots = key_cache.shape[1], key_cache.shape[0] * key_cache.shape[1]
        a.eps, a.scale = first.eps, first.scale
        self._arrays = []  # keeps the ctypes pointer arrays alive

        def pointers(values: list[torch.Tensor | None]) -> ctypes.Array:
            arr = (ctypes.c_void_p * len(values))(*[None if v is None else v.data_ptr() for v in values])
            self._arrays.append(arr)
            return ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))

        params = [layer._parameters for layer in layers]
        a.in_norm = pointers([p["input_layernorm_weight"] for p in params])
        a.post_norm = pointers([p["post_attention_layernorm_weight"] for p in params])
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(a, f"{name}_w", pointers([layer.panels.panels[name] for layer in layers]))
            setattr(a, f"{name}_b", pointers([p[f"{name}_proj_bias"] for p in params]))
        a.k_cache = pointers([k for k, _ in kv_caches])
        a.v_cache = pointers([v for _, v in kv_caches])
        self.args = a
        self.key = self.cache_key(kv_caches)
        self._widths = {"x": a.hidden, "qkv": (a.num_heads + 2 * a.num_kv_heads) * a.head_dim,
                        "attn": a.num_heads * a.head_dim, "gate_up": 2 * a.inter, "act": a.inter, "delta": a.hidden}

    @staticmethod
    def applies(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether this model and cache can run here: bf16 panels and the C norms on every
        layer (the per-layer path's kernels), one dense bf16 cache pair per layer, all of one
        shape, head_dim even and within the library's ``max_rope_dim``."""
        shape = kv_caches[0][0].shape if kv_caches else None
        return (
            model.native_matmuls and model.native_norms
            and len(kv_caches) == len(model.layers)
            and all(layer.panels is not None and layer.native_norms for layer in model.layers)
            and model.head_dim % 2 == 0 and model.head_dim <= ops.load().abi.max_rope_dim
            and all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.shape == shape for kv in kv_caches for t in kv)
        )

    @staticmethod
    def cache_key(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, int, tuple[int, ...]]]:
        """What the pointer arrays depend on: each cache pair's addresses and shape."""
        return [(k.data_ptr(), v.data_ptr(), tuple(k.shape)) for k, v in kv_caches]

    def run(
        self,
        h: torch.Tensor,  # [T, hidden] bf16, dense (updated in place: the last layer's residual)
        cos: torch.Tensor,  # [T, 1, D] bf16, dense
        sin: torch.Tensor,  # [T, 1, D] bf16, dense, sign-folded
        slots: torch.Tensor,  # [T] int64 cache slots (< 0: not written)
        rows: Any,  # kernels.cpu.attention_plan.NativeRows covering every row in order
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


def rms_norm(
    x: torch.Tensor,  # [T, n]
    weight: torch.Tensor,  # [n]
    eps: float,
    ln_weight: torch.Tensor | None,  # [2 n] = (weight, zeros), or None
) -> torch.Tensor:  # [T, n], contiguous
    """RMSNorm; with ``ln_weight`` computed as a LayerNorm of ``(x, -x)`` (bf16/fp16 only).

    ``F.rms_norm`` in bf16 is a chain of ~10 small ops (upcast, pow, mean, rsqrt, ...: 12 us
    for one row, 46 us for 64 on SmolLM2) while ``F.layer_norm`` is one fused kernel that
    accumulates in float32. ``(x, -x)`` has mean 0 and variance ``mean(x ** 2)``, so the first
    half of its LayerNorm, scaled by ``weight``, is the RMSNorm (6.7 / 34 us). The mean is 0
    only up to float32 rounding (~1e-7 relative), far below bf16's resolution: outputs equal
    ``F.rms_norm``'s in our measurements but for rare 1-ulp differences. float32 keeps
    ``F.rms_norm`` (bitwise equal to Hugging Face).
    """
    if ln_weight is None:
        return F.rms_norm(x, weight.shape, weight, eps)
    n = x.shape[-1]
    out = F.layer_norm(torch.cat((x, x.neg()), dim=-1), ln_weight.shape, ln_weight, None, eps)[:, :n]
    return out if x.shape[0] == 1 else out.contiguous()


def ln_trick_weight(weight: torch.Tensor) -> torch.Tensor:  # [n] -> [2 n]
    """The LayerNorm weight for :func:`rms_norm`: ``weight`` then zeros."""
    return torch.cat((weight.detach(), torch.zeros_like(weight)))


def add_rms_norm(
    h: torch.Tensor,  # [T, n] the residual stream (contiguous)
    weight: torch.Tensor,  # [n]
    eps: float,
    ln_weight: torch.Tensor | None,  # see rms_norm()
    native: bool,  # bf16 CPU: the C kernel (kernels.ops.add_rms_norm)
    delta: torch.Tensor | None = None,  # [T, n] added to h first (a sublayer's output)
) -> tuple[torch.Tensor, torch.Tensor]:  # (h + delta, RMSNorm(h + delta)), both [T, n]
    """The residual add (when ``delta``) and RMSNorm, in one C pass when ``native``, else
    ``h.add_(delta)`` then :func:`rms_norm`. ``h`` is updated in place either way."""
    if native:
        return h, ops.add_rms_norm(h, weight, eps, delta, validate=False)
    if delta is not None:
        h = h.add_(delta)
    return h, rms_norm(h, weight, eps, ln_weight)


def refine_top_logits(
    logits: torch.Tensor,  # [N, V] float32, upcast from a bf16/fp16 matmul (modified in place)
    hidden: torch.Tensor,  # [N, hidden] bf16/fp16, the matmul's input
    weight: torch.Tensor,  # [V, hidden] bf16/fp16, the matmul's weight
    num: int = 4,
    chunk: int = 1024,
) -> None:
    """Recompute the ``num`` best logits of each row with a float32 result (in place).

    A bf16 matmul accumulates in float32 but rounds its output to 8 significant bits: around
    20 neighbouring logits are 0.125 apart, so the top two often tie (or swap) through that
    last rounding alone, and greedy decoding then follows the rounding (SmolLM2's answer to
    "What is the capital of France?" starts "The" in float32, 25.33 against 25.24, and "L'"
    when both round to 25.25). The dot products of the same bf16 hidden state and weight rows
    in float32 remove that error for the candidates that matter. Candidates: the ``num`` best
    of the row's two best ``chunk``-wide slices (they hold the row's two best logits; found
    with vectorised maxima, as torch's CPU ``topk`` over a long row is slow).
    """
    n, vocab = logits.shape
    if vocab % chunk or vocab < 2 * chunk:
        ids = logits.topk(min(num, vocab), dim=-1).indices  # [N, num]
    else:
        slices = logits.view(n, vocab // chunk, chunk)  # [N, V / chunk, chunk]
        best = slices.amax(dim=-1).topk(2, dim=-1).indices  # [N, 2] the two best slices
        rows = torch.arange(n, device=logits.device).unsqueeze(1)  # [N, 1]
        cand = slices[rows, best].reshape(n, 2 * chunk).topk(num, dim=-1).indices  # [N, num]
        ids = best.gather(1, cand // chunk) * chunk + cand % chunk  # [N, num] vocabulary ids
    rows_w = weight[ids.flatten()].view(n, ids.shape[1], -1).float()  # [N, num, hidden]
    exact = torch.bmm(rows_w, hidden.float().unsqueeze(2)).squeeze(2)  # [N, num] float32
    logits.scatter_(1, ids, exact)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019) via :func:`rms_norm` (the model's final norm).

    In float32 ``F.rms_norm`` is bitwise equal to Hugging Face's ``LlamaRMSNorm``; in bf16/fp16
    both forms here round once where HF rounds twice (normalised value, then product): <= 1 ulp apart.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ln_weight: torch.Tensor | None = None  # set by prepare(): see rms_norm()
        self.native = False  # set by prepare()

    def prepare(self, use_ln_trick: bool, native: bool = False) -> None:
        """Choose the form after loading: the C kernel (bf16 CPU), the LayerNorm form of
        :func:`rms_norm`, or ``F.rms_norm``."""
        self.native = native
        self.ln_weight = ln_trick_weight(self.weight) if use_ln_trick and not native else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        return add_rms_norm(x.contiguous(), self.weight, self.eps, self.ln_weight, self.native)[1]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))`` with fused qkv and gate_up.

    Parameters live directly on the layer (``qkv_proj_weight [(H + 2 Hkv) D, hidden]``,
    ``gate_up_proj_weight [2 I, hidden]``, ...; biases are ``None`` when absent) and the forward
    reads them from ``self._parameters``: ``nn.Module.__getattr__`` costs ~1 us per access,
    which adds up to ~0.5 ms per decode step over 30 layers.
    """

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate_size = inter
        self.scale = self.head_dim**-0.5
        self.eps = cfg["eps"]

        def param(*shape: int, present: bool = True) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False) if present else None

        qkv_rows = self.q_size + 2 * self.kv_size
        self.input_layernorm_weight = param(hidden)
        self.qkv_proj_weight = param(qkv_rows, hidden)  # rows: q | k | v
        self.register_parameter("qkv_proj_bias", param(qkv_rows, present=cfg["qkv_bias"]))
        self.o_proj_weight = param(hidden, self.q_size)
        self.register_parameter("o_proj_bias", param(hidden, present=cfg["o_bias"]))
        self.post_attention_layernorm_weight = param(hidden)
        self.gate_up_proj_weight = param(2 * inter, hidden)  # rows: gate | up
        self.register_parameter("gate_up_proj_bias", param(2 * inter, present=cfg["mlp_bias"]))
        self.down_proj_weight = param(hidden, inter)
        self.register_parameter("down_proj_bias", param(hidden, present=cfg["mlp_bias"]))
        self.packed: PackedWeights | None = None  # set by pack_weights()
        self.panels: PanelWeights | None = None  # set by pack_panels()
        self._released: dict[str, int] = {}  # weights held only by the panels: name -> rows
        self.ln_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # set by prepare_norms()
        self.native_norms = False  # set by prepare_norms()

    def prepare_norms(self, use_ln_trick: bool, native: bool = False) -> None:
        """Choose the norms' form: the C kernel with the residual add fused
        (:func:`kernels.cpu.ops.add_rms_norm`, bf16 on CPU), or the LayerNorm-form weights of
        :func:`rms_norm` (bf16/fp16), or ``F.rms_norm``."""
        p = self._parameters
        self.native_norms = native
        self.ln_weights = (
            (ln_trick_weight(p["input_layernorm_weight"]), ln_trick_weight(p["post_attention_layernorm_weight"]))
            if use_ln_trick and not native else None
        )

    def pack_weights(self) -> None:
        """Prepack this layer's matmul weights for oneDNN (after loading them)."""
        p, inter = self._parameters, self.intermediate_size
        gate_up = p["gate_up_proj_weight"]
        self.packed = PackedWeights({
            "qkv": p["qkv_proj_weight"],
            "o": p["o_proj_weight"],
            "gate": gate_up[:inter],
            "up": gate_up[inter:],
            "down": p["down_proj_weight"],
        })
        bias = p["gate_up_proj_bias"]
        self._gate_bias = None if bias is None else bias[:inter].contiguous()
        self._up_bias = None if bias is None else bias[inter:].contiguous()

    def pack_panels(self) -> None:
        """Lay this layer's bf16 matmul weights out for the native GEMM (:class:`PanelWeights`)
        and release the parameters' storage (the panels hold the same values, so the weights
        are not held twice; :meth:`restore_weights` rebuilds them). The oneDNN copies, unused
        while the panels serve, are dropped too."""
        self.restore_weights()
        p = self._parameters
        self.panels = PanelWeights({name: p[f"{name}_proj_weight"] for name in PANEL_WEIGHTS})
        self.packed = None
        for name in PANEL_WEIGHTS:
            param = p[f"{name}_proj_weight"]
            self._released[name] = param.shape[0]
            param.data = torch.empty((0, param.shape[1]), dtype=param.dtype)

    def restore_weights(self) -> None:
        """Put back the matmul weights that :meth:`pack_panels` released (from the panels)."""
        p = self._parameters
        for name, rows in self._released.items():
            param = p[f"{name}_proj_weight"]
            param.data = ops.unpack_bf16_weight(self.panels.panels[name], rows, param.shape[1])
        self._released = {}

    def _linear(self, x: torch.Tensor, name: str, packed: PackedWeights | None) -> torch.Tensor:
        """``F.linear`` for the matmul called ``name`` (``qkv``, ``o``, ``gate_up``, ``down``) in
        whichever form serves it: the native GEMM's panels (:class:`PanelWeights`, every row
        count), oneDNN's prepacked weights (``packed``, several rows; it holds ``gate`` and
        ``up`` apart, for :meth:`_mlp_packed`, not ``gate_up``) or the parameters."""
        p = self._parameters
        weight, bias = _PROJ_KEYS[name]
        if self.panels is not None:
            return self.panels.linear(x, name, p[bias])
        if packed is not None:
            return packed_linear(x, packed[name], p[bias])
        return F.linear(x, p[weight], p[bias])

    def _mlp_packed(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden] -> [T, hidden]
        """``down(silu(gate(x)) * up(x))`` with SiLU and the product as epilogues of the gate and
        up matmuls: two fewer passes over ``[T, I]`` than a gate_up matmul, ``F.silu`` and a
        multiply (SmolLM2 prefill of 64 prompts 1.96 -> 1.72 s, decode at 64 rows 104 -> 94 ms
        a step; a few us slower for 2-8 rows). The epilogues work on the float32 accumulator,
        so gate and up skip HF's intermediate bf16 roundings (closer to float32, not to HF bf16)."""
        p, w = self._parameters, self.packed
        act = _linear_pointwise(x, w["gate"], self._gate_bias, "swish", [], "")  # silu(gate) [T, I]
        act = _linear_binary(x, act, w["up"], self._up_bias, "mul")  # up * silu(gate) [T, I]
        return packed_linear(act, w["down"], p["down_proj_bias"])

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D], sign-folded
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        """One layer. With panels (where :func:`kernels.cpu.ops.prefer_native_gemm`) every
        matmul runs in the native bf16-weight GEMM, rounded as in HF bf16 (each matmul output,
        SiLU and the product in bf16); else several rows use oneDNN's prepacked weights with
        the MLP's fused epilogues (:meth:`_mlp_packed`), and one row a GEMV on the parameters
        (``reduced_precision_gemv``)."""
        p = self._parameters  # plain dict lookups (see class doc)
        t, nh, nkv, d = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        w = self.packed if t > 1 and self.panels is None else None
        ln = (self.ln_weights if self.panels is None else None) or (None, None)
        _, x = add_rms_norm(h, p["input_layernorm_weight"], self.eps, ln[0], self.native_norms)
        qkv = self._linear(x, "qkv", w)  # [T, (H + 2 Hkv) D]
        qk = apply_rope(qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d), cos, sin)  # [T, H + Hkv, D]
        v = qkv[:, (nh + nkv) * d :].view(t, nkv, d)  # [T, Hkv, D]
        attn = backend.forward(qk[:, :nh], qk[:, nh:], v, key_cache, value_cache, meta, self.scale)  # [T, H, D]
        o = self._linear(attn.reshape(t, nh * d), "o", w)  # [T, hidden]
        # h + o_proj(attn) (summed into o, a fresh tensor), then the post-attention norm
        h, x = add_rms_norm(o, p["post_attention_layernorm_weight"], self.eps, ln[1], self.native_norms, delta=h)
        if w is not None:
            return self._mlp_packed(x).add_(h)
        gate_up = self._linear(x, "gate_up", w)  # [T, 2 I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self._linear(F.silu(gate).mul_(up), "down", w).add_(h)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    Args:
        hf_config: a ``transformers`` config (or its dict) of a supported architecture.
        dtype: parameter / activation / KV cache dtype.
        device: where parameters live (allocated uninitialised; call :meth:`load_weights`).
        attn_backend: an :class:`AttentionBackend` or a name for :func:`get_attention_backend`;
            the runner may replace ``self.attn_backend`` later.

    Raises:
        ValueError: see :func:`check_supported`.
    """

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        attn_backend: AttentionBackend | str = "auto",
    ) -> None:
        super().__init__()
        check_supported(hf_config)
        device = torch.device(device)
        qwen2 = "Qwen2ForCausalLM" in architectures_of(hf_config)
        attention_bias = bool(_get(hf_config, "attention_bias", False))
        cfg = {
            "hidden_size": _get(hf_config, "hidden_size"),
            "intermediate_size": _get(hf_config, "intermediate_size"),
            "num_heads": _get(hf_config, "num_attention_heads"),
            "num_kv_heads": num_kv_heads_of(hf_config),
            "head_dim": head_dim_of(hf_config),
            "eps": _get(hf_config, "rms_norm_eps", 1e-6),
            "qkv_bias": qwen2 or attention_bias,
            "o_bias": attention_bias and not qwen2,
            "mlp_bias": bool(_get(hf_config, "mlp_bias", False)),
        }
        self.hf_config = hf_config
        self.dtype = dtype
        self.num_layers = _get(hf_config, "num_hidden_layers")
        self.vocab_size = _get(hf_config, "vocab_size")
        self.hidden_size = cfg["hidden_size"]
        self.head_dim = cfg["head_dim"]
        self.tie_word_embeddings = bool(_get(hf_config, "tie_word_embeddings", False))
        with torch.device("meta"):  # no init cost: load_weights fills every parameter
            self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype) for _ in range(self.num_layers))
            self.norm = RMSNorm(self.hidden_size, cfg["eps"], dtype)
            self.lm_head = None if self.tie_word_embeddings else nn.Linear(self.hidden_size, self.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device=device)
        if device.type == "cpu" and dtype == torch.float32:
            self._use_input_major_weights()
        self.requires_grad_(False)
        self.inv_freq = rope_inv_freq(hf_config).to(device)  # [D/2] float32, not a parameter
        # prepack the matmul weights for oneDNN once they are loaded (CPU bf16)
        self.use_packed_weights = mkldnn_packing_supported(device, dtype)
        self._lm_head_packed: torch.Tensor | None = None
        self._lm_head_panels: PanelWeights | None = None  # see use_native_matmuls()
        self.native_matmuls = False
        self._native_layers: NativeLayers | None = None  # built at the first forward on a cache
        self._gemv_fast_path = device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        self._on_cpu = device.type == "cpu"
        self.native_norms = False  # see use_native_norms()
        if isinstance(attn_backend, str):
            attn_backend = get_attention_backend(attn_backend, device)
        self.attn_backend = attn_backend

    def _use_input_major_weights(self) -> None:
        """Store every 2-D weight ``[out, in]`` as the transposed view of a contiguous ``[in, out]``.

        float32 on CPU only: MKL's SGEMV streams an ``[in, out]`` matrix about twice as fast for
        one-row inputs (SmolLM2 decode step 52 -> 38 ms, its lm_head 9.7 -> 4.9 ms), larger
        batches run at the same speed, and the embedding lookup from the strided table costs a
        few microseconds per token. Values are unchanged; matmul summation order differs from
        the row-major layout by float32 rounding (~1e-6 relative).
        """
        for module in self.modules():
            for param in module._parameters.values():
                if param is not None and param.dim() == 2:
                    rows, cols = param.shape
                    param.data = torch.empty(cols, rows, dtype=param.dtype, device=param.device).t()

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        """The output projection (the embedding matrix when embeddings are tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin ``[T, 1, D]`` in the model dtype for ``positions [T]`` (HF arithmetic)."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2] float32
        cos = torch.cat((freqs, freqs), dim=-1).cos()  # [T, D]
        sin = freqs.sin()
        sin = torch.cat((-sin, sin), dim=-1)  # [T, D], rotate_half's sign folded in
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer K, V [num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        """Run the decoder over the step's new tokens, writing their K/V into ``kv_caches``."""
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rope_cos_sin(positions)  # [T, 1, D], shared by all layers
        backend = self.attn_backend
        if self.native_matmuls:
            rows = self._native_rows(kv_caches, attn_metadata)
            if rows is not None:  # every row in the C attention kernel: all layers in one C call
                self._native_layers.run(h, cos, sin, attn_metadata.slot_mapping.long(), rows)
                return self.norm(h)
        with reduced_precision_gemv(self._gemv_fast_path and h.shape[0] == 1):
            for layer, (key_cache, value_cache) in zip(self.layers, kv_caches, strict=True):
                h = layer(h, cos, sin, key_cache, value_cache, attn_metadata, backend)
        return self.norm(h)

    def _native_rows(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> Any:
        """The step's attention rows when :class:`NativeLayers` can run the whole step (the
        torch backend's C kernel serves every row), else ``None`` (the per-layer path)."""
        backend = self.attn_backend
        if not getattr(backend, "native", False) or not hasattr(backend, "plan"):
            return None
        if self._native_layers is None or self._native_layers.key != NativeLayers.cache_key(kv_caches):
            self._native_layers = NativeLayers(self, kv_caches) if NativeLayers.applies(self, kv_caches) else None
            if self._native_layers is None:
                return None
        first = self.layers[0]
        probe = torch.empty((1, first.num_heads, first.head_dim), dtype=self.dtype)  # for the plan's checks
        plan = backend.plan(probe, kv_caches[0][0], meta)
        rows = plan.native
        if rows is None or rows.rows is not None or plan.decode is not None or plan.prefills or plan.chunks:
            return None
        return rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [N, hidden]
        """Logits ``[N, vocab]`` float32. The matmul runs in the model dtype, as in HF; in
        bf16/fp16 the few best logits of each row are then recomputed with a float32 result
        (:func:`refine_top_logits`). The native bf16-weight GEMM (:class:`PanelWeights`)
        returns float32 logits directly (no bf16 rounding to refine)."""
        if self._lm_head_panels is not None:  # float32 out: no bf16 rounding of the logits to refine
            return self._lm_head_panels.linear(hidden.contiguous(), "lm_head", None, torch.float32)
        if self._lm_head_packed is not None and hidden.shape[0] > 1:
            logits = packed_linear(hidden.contiguous(), self._lm_head_packed, None)
        else:
            with reduced_precision_gemv(self._gemv_fast_path and hidden.shape[0] == 1):
                logits = F.linear(hidden, self.lm_head_weight)
        logits = logits.float()
        if self.dtype != torch.float32:
            refine_top_logits(logits, hidden, self.lm_head_weight)
        return logits

    def pack_weights(self) -> None:
        """Derive the fast-path weights from the parameters: oneDNN-prepacked matmul weights
        (:class:`PackedWeights`, when ``use_packed_weights``) and the LayerNorm-form norm
        weights of :func:`rms_norm` (bf16/fp16). :meth:`load_weights` calls it; call it again
        after changing weights in place."""
        self._prepare_norms()
        if self.native_matmuls:  # the panels serve every matmul: no oneDNN copies
            self._pack_panels()
            return
        if not self.use_packed_weights:
            return
        for layer in self.layers:
            layer.pack_weights()
        self._lm_head_packed = PackedWeights({"lm_head": self.lm_head_weight})["lm_head"]

    def use_native_matmuls(self, enabled: bool) -> bool:
        """Run every matmul in the native bf16-weight GEMM (:class:`PanelWeights`) when
        ``enabled``, the model is bf16 on a CPU and :func:`kernels.cpu.ops.prefer_native_gemm`
        (torch emulates bf16 there, or our GEMM has AVX512-BF16 and the CPU no AMX). Returns
        whether they now do. SmolLM2 bf16 on 2-core EPYCs: see benchmarks/RESULTS.md
        (2026-12-01, third and fourth sessions)."""
        self.native_matmuls = bool(
            enabled and self.dtype == torch.bfloat16 and self._on_cpu and ops.prefer_native_gemm()
        )
        if self.native_matmuls:
            self._pack_panels()
        else:
            self._drop_panels()
        return self.native_matmuls

    def _drop_panels(self) -> None:
        for layer in self.layers:
            layer.restore_weights()
            layer.panels = None
        self._lm_head_panels = None
        self._native_layers = None

    def _pack_panels(self) -> None:
        self._native_layers = None
        for layer in self.layers:
            layer.pack_panels()
        self._lm_head_panels = PanelWeights({"lm_head": self.lm_head_weight})
        self._lm_head_packed = None  # oneDNN's copy: unused while the panels serve

    def use_native_norms(self, enabled: bool) -> bool:
        """Run the norms (and the attention residual add) in the C kernel
        (:func:`kernels.cpu.ops.add_rms_norm`) when ``enabled``, the model is bf16 on CPU and
        the kernel library builds. Returns whether they now do. SmolLM2 bf16 decode step, 2
        cores, A/B in one process: batch 1 14.33 -> 13.65 ms, batch 64 83.2 -> 79.9 ms."""
        self.native_norms = bool(
            enabled and self.dtype == torch.bfloat16 and self._on_cpu and ops.load() is not None
        )
        self._prepare_norms()
        return self.native_norms

    def _prepare_norms(self) -> None:
        ln_trick = self.dtype in (torch.bfloat16, torch.float16)
        for layer in self.layers:
            layer.prepare_norms(ln_trick, self.native_norms)
        self.norm.prepare(ln_trick, self.native_norms)

    def unpack_weights(self) -> None:
        """Drop the packed and panel copies: back to ``F.linear`` on the parameters (tests, comparisons)."""
        self._drop_panels()
        for layer in self.layers:
            layer.packed = None
        self._lm_head_packed = None
        self.native_matmuls = False

    # ------------------------------------------------------------------ weights

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF checkpoint name -> (our parameter, first row, row count) including fused slices."""
        targets: dict[str, tuple[torch.Tensor, int, int]] = {}

        def add(name: str, param: torch.Tensor, start: int = 0, rows: int | None = None) -> None:
            targets[name] = (param, start, param.shape[0] if rows is None else rows)

        add("model.embed_tokens.weight", self.embed_tokens.weight)
        add("model.norm.weight", self.norm.weight)
        if self.lm_head is not None:
            add("lm_head.weight", self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qs, kvs, inter = layer.q_size, layer.kv_size, layer.intermediate_size
            add(p + "input_layernorm.weight", layer.input_layernorm_weight)
            add(p + "post_attention_layernorm.weight", layer.post_attention_layernorm_weight)
            for s in ("weight", "bias"):
                qkv, o = getattr(layer, f"qkv_proj_{s}"), getattr(layer, f"o_proj_{s}")
                gate_up, down = getattr(layer, f"gate_up_proj_{s}"), getattr(layer, f"down_proj_{s}")
                if qkv is not None:  # fused rows: q | k | v
                    add(p + f"self_attn.q_proj.{s}", qkv, 0, qs)
                    add(p + f"self_attn.k_proj.{s}", qkv, qs, kvs)
                    add(p + f"self_attn.v_proj.{s}", qkv, qs + kvs, kvs)
                if o is not None:
                    add(p + f"self_attn.o_proj.{s}", o)
                if gate_up is not None:  # fused rows: gate | up
                    add(p + f"mlp.gate_proj.{s}", gate_up, 0, inter)
                    add(p + f"mlp.up_proj.{s}", gate_up, inter, inter)
                if down is not None:
                    add(p + f"mlp.down_proj.{s}", down)
        return targets

    @torch.no_grad()
    def load_weights(self, model_dir: Path | str) -> None:
        """Load HF safetensors (one file, or shards listed in ``model.safetensors.index.json``).

        q/k/v and gate/up are copied into their fused parameters; values are cast to the
        model dtype. ``lm_head.weight`` is ignored when embeddings are tied.

        Raises:
            FileNotFoundError: no ``*.safetensors`` in ``model_dir``.
            ValueError: a parameter is missing, has the wrong shape, or the checkpoint holds
                tensors this architecture does not know (e.g. Qwen3's q_norm).
        """
        from safetensors import safe_open

        model_dir = Path(model_dir)
        for layer in self.layers:  # the parameters must have their shapes to be loaded into
            layer.restore_weights()
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        targets = self._weight_targets()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    key = name if name in targets or name.startswith("model.") else "model." + name
                    if key not in targets:
                        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                            continue
                        unexpected.append(name)
                        continue
                    param, start, rows = targets[key]
                    tensor = f.get_tensor(name)
                    dst = param[start : start + rows]
                    if tuple(tensor.shape) != tuple(dst.shape):
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
                    dst.copy_(tensor)
                    loaded.add(key)
        if unexpected:
            raise ValueError(f"{len(unexpected)} unexpected tensors in {model_dir}, e.g. {unexpected[:5]}")
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"{len(missing)} tensors missing from {model_dir}, e.g. {missing[:5]}")
        self.pack_weights()
