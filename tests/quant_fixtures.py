"""Quantized checkpoints packed by our own code from random weights (GPTQ, AWQ, compressed-tensors
int4 / int8, FP8), each with the float32 weight it stands for (round to nearest, so the test's
reference is exactly what the checkpoint holds), and a tiny Llama checkpoint rewritten in any of
these formats (``quantize_checkpoint``) beside its dequantized float32 twin.

The packers follow the layouts as documented (research notes, section 4), written apart from
the loaders in ``services/executor/layers/quantization/``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers ``0 .. 2^bits - 1`` packed ``32 / bits`` to an int32 along ``dim``, lowest bits first."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    packed = (v << (torch.arange(per) * bits)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def _groups(w: torch.Tensor, group: int) -> int:
    return w.shape[1] if group == -1 else group


def gptq(w: torch.Tensor, group: int = 32, desc_act: bool = False, v2: bool = False,
         seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors of ``w`` ``[N, K]`` (asymmetric round to nearest per group, so zero points
    vary) and the weight they hold. ``desc_act``: input rows assigned to groups in a random
    order (g_idx = perm position // G)."""
    n, k = w.shape
    g = _groups(w, group)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // g  # row order[j] is the j-th of the act order
    ngroups = k // g
    wt = w.t()  # [K, N]
    lo = torch.stack([wt[g_idx == i].min(0).values for i in range(ngroups)])  # [groups, N]
    hi = torch.stack([wt[g_idx == i].max(0).values for i in range(ngroups)])
    scales = ((hi - lo) / 15).clamp_min(1e-4).half().float()
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (wt / scales[g_idx] + zeros[g_idx]).round().clamp(0, 15)  # [K, N]
    deq = ((q - zeros[g_idx]) * scales[g_idx]).t().contiguous()
    stored_zeros = zeros if v2 else (zeros - 1) % 16  # v1 stores z - 1 (z = 0 wraps to 15)
    return {"qweight": pack_int32(q, 4, 0), "qzeros": pack_int32(stored_zeros, 4, 1),
            "scales": scales.half(), "g_idx": g_idx.to(torch.int32)}, deq


def awq(w: torch.Tensor, group: int = 32) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AWQ GEMM tensors of ``w`` ``[N, K]`` (outputs packed in the interleaved order)."""
    n, k = w.shape
    g = _groups(w, group)
    wt = w.t().reshape(k // g, g, n)  # [groups, G, N]
    lo, hi = wt.min(1).values, wt.max(1).values
    scales = ((hi - lo) / 15).clamp_min(1e-4).half().float()
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (wt / scales[:, None] + zeros[:, None]).round().clamp(0, 15)
    deq = ((q - zeros[:, None]) * scales[:, None]).reshape(k, n).t().contiguous()

    def interleave(t: torch.Tensor) -> torch.Tensor:  # [..., N]: nibble i of each int32 holds output ORDER[i]
        return t.reshape(*t.shape[:-1], n // 8, 8)[..., AWQ_ORDER].reshape(t.shape)
    return {"qweight": pack_int32(interleave(q.reshape(k, n)), 4, 1), "qzeros": pack_int32(interleave(zeros), 4, 1),
            "scales": scales.half()}, deq


def compressed(w: torch.Tensor, bits: int, group: int | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors pack-quantized tensors (symmetric; ``group`` None: per channel)."""
    n, k = w.shape
    g = k if group is None else group
    wg = w.reshape(n, k // g, g)
    qmax = 2 ** (bits - 1) - 1
    scales = (wg.abs().amax(-1) / qmax).clamp_min(1e-4)  # [N, groups]
    q = (wg / scales[..., None]).round().clamp(-qmax - 1, qmax)
    deq = (q * scales[..., None]).reshape(n, k)
    return {"weight_packed": pack_int32((q + 2 ** (bits - 1)).reshape(n, k), bits, 1),
            "weight_scale": scales, "weight_shape": torch.tensor([n, k])}, deq


def fp8(w: torch.Tensor, per_channel: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """FP8 e4m3 weight and its scale (per tensor ``[1]``, or per channel ``[N, 1]``)."""
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = amax / 448.0
    q = (w / (scale if per_channel else scale[0])).to(torch.float8_e4m3fn)
    deq = q.float() * (scale if per_channel else scale[0])
    return {"weight": q, "weight_scale": scale}, deq


def quantize(w: torch.Tensor, fmt: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w`` ``[N, K]`` in format ``fmt`` (a key of ``QUANT_CONFIGS``): its tensors and the weight they hold."""
    if fmt in ("gptq", "gptq-desc-act", "gptq_v2"):
        return gptq(w, -1 if fmt == "gptq_v2" else 32, desc_act=fmt == "gptq-desc-act", v2=fmt == "gptq_v2", seed=seed)
    if fmt == "awq":
        return awq(w, 32)
    if fmt in ("ct-w4a16", "ct-w8a16"):
        return compressed(w, 4, 32) if fmt == "ct-w4a16" else compressed(w, 8, None)
    return fp8(w, per_channel=fmt == "ct-fp8")


def _act_order_seed(name: str) -> int:
    """GPTQ's act order comes from a layer's inputs: q, k, v share one, gate and up another."""
    parts = name.split(".")
    layer = int(parts[parts.index("layers") + 1])
    kind = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "out_proj": 1, "gate_proj": 2, "up_proj": 2,
            "fc1": 2, "down_proj": 3, "fc2": 3, "qkv_proj": 0, "gate_up_proj": 2}
    return 4 * layer + kind[parts[-2]]


#: the decoder linears quantized (Llama / Gemma names, OPT's out_proj, fc1, fc2, Phi-3's fused qkv_proj, gate_up_proj)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj", "fc1", "fc2",
           "qkv_proj", "gate_up_proj")


def quantize_checkpoint(src: Path, dst: Path, dequantized: Path, fmt: str) -> None:
    """Rewrite the float32 checkpoint in ``src`` with every decoder linear in ``fmt`` into
    ``dst`` (config.json with its ``quantization_config``), and the weights it holds,
    dequantized to float32, as a plain checkpoint into ``dequantized``."""
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    quant, plain = {}, {}
    for name, t in sorted(tensors.items()):
        if not (name.endswith(".weight") and name.split(".")[-2] in LINEARS):
            quant[name] = plain[name] = t
            continue
        packed, deq = quantize(t, fmt, _act_order_seed(name))
        for key, value in packed.items():
            quant[f"{name[: -len('.weight')]}.{key}"] = value
        plain[name] = deq
    config["quantization_config"] = QUANT_CONFIGS[fmt]
    for d, data in ((dst, quant), (dequantized, plain)):
        d.mkdir(parents=True, exist_ok=True)
        save_file(data, d / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    del config["quantization_config"]
    (dequantized / "config.json").write_text(json.dumps(config))
    for file in src.iterdir():
        if file.name not in ("model.safetensors", "config.json") and file.is_file():
            shutil.copy(file, dst / file.name)
            shutil.copy(file, dequantized / file.name)


def _ct(weights: dict, fmt: str = "pack-quantized") -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


QUANT_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
    "gptq-desc-act": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq_v2"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "ct-w4a16": _ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}),
    "ct-w8a16": _ct({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}),
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "ct-fp8": _ct({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}, "float-quantized"),
}
