"""The layer library (services/executor/layers/): weight loaders, linear methods, the kernel
selection, the fast module base, and the safetensors loader's errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from services.executor.layers.activation import SiluAndMul
from services.executor.layers.cpu.onednn import GemvLinearMethod, OneDNNLinearMethod, mkldnn_packing_supported
from services.executor.layers.cpu.panels import PanelLinearMethod
from services.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from services.executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from services.executor.layers.selection import select_kernels, use_linear_method
from services.executor.layers.utils import FastModule
from services.executor.model_loader import loader


def test_qkv_weight_loader_puts_each_shard_in_its_rows():
    layer = QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=1, bias=True)
    assert layer.weight.shape == (12, 8) and (layer.q_size, layer.kv_size) == (8, 2)
    q, k, v = torch.randn(8, 8), torch.randn(2, 8), torch.randn(2, 8)
    for shard, w in (("v", v), ("q", q), ("k", k)):  # any order
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, w[:, 0], shard)
    assert torch.equal(layer.weight, torch.cat((q, k, v))) and torch.equal(layer.bias, torch.cat((q, k, v))[:, 0])
    with pytest.raises(ValueError, match=r"checkpoint shape \(3, 8\) != expected \(2, 8\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(3, 8), "k")
    merged = torch.randn(12, 8)
    layer.weight.weight_loader(layer.weight, merged)  # an already merged checkpoint tensor
    assert torch.equal(layer.weight, merged)


def test_merged_column_weight_loader_and_silu_and_mul():
    layer = MergedColumnParallelLinear(4, [3, 3], bias=False)
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    x = torch.randn(5, 4)
    merged = F.linear(x, torch.cat((gate, up)))
    assert torch.equal(layer(x), merged)
    # silu(gate) * up of the merged product (a [5, 3] GEMM may sum in another order than the
    # [5, 6] one: on an AVX-512 Zen 4 they differ in the last bit)
    torch.testing.assert_close(layer.forward_act(x, SiluAndMul()), F.silu(merged[:, :3]) * merged[:, 3:], atol=0, rtol=0)
    torch.testing.assert_close(layer.forward_act(x, SiluAndMul()), F.silu(F.linear(x, gate)) * F.linear(x, up))


def test_input_major_weights_keep_values_and_outputs():
    """float32 on CPU: the weight becomes the transposed view of a contiguous [in, out] copy,
    values and F.linear's result unchanged up to float32 summation order; processing twice
    (a reload) changes nothing."""
    layer = RowParallelLinear(16, 8, bias=True)
    w, b = torch.randn(8, 16), torch.randn(8)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    use_linear_method(layer, UnquantizedLinearMethod(input_major=True))
    assert layer.weight.stride() == (1, 8) and torch.equal(layer.weight, w)
    use_linear_method(layer, UnquantizedLinearMethod(input_major=True))
    assert layer.weight.stride() == (1, 8)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not mkldnn_packing_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16")
def test_onednn_method_matches_plain_linear_and_restores():
    layer = MergedColumnParallelLinear(64, [32, 32], bias=True, params_dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(64, 64))
    layer.bias.data.copy_(torch.randn(64))
    x = torch.randn(7, 64).to(torch.bfloat16)
    plain = layer(x)
    use_linear_method(layer, OneDNNLinearMethod())
    assert layer.packed is None and len(layer.packed_parts) == 2  # gate and up apart, for the epilogues
    torch.testing.assert_close(layer(x), plain, atol=0, rtol=0)  # several rows: F.linear on the parameters
    fused = layer.forward_act(x, SiluAndMul())
    torch.testing.assert_close(fused, SiluAndMul()(plain), atol=3e-2, rtol=3e-2)
    use_linear_method(layer, UnquantizedLinearMethod())
    assert layer.packed_parts is None


def test_kernel_selection_by_device_and_dtype(monkeypatch):
    from kernels.cpu import ops

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    f32 = select_kernels(torch.float32, cpu, native_norms=True, native_matmuls=True)
    assert isinstance(f32.linear_method, UnquantizedLinearMethod) and f32.linear_method.input_major
    assert (f32.layer_norm_form, f32.final_norm_form, f32.single_row_gemv) == ("torch", "torch", False)
    gpu = select_kernels(torch.bfloat16, cuda, native_norms=True, native_matmuls=True)
    assert type(gpu.linear_method) is UnquantizedLinearMethod and not gpu.linear_method.input_major
    assert (gpu.layer_norm_form, gpu.final_norm_form, gpu.single_row_gemv) == ("layer_norm", "layer_norm", False)
    fp16 = select_kernels(torch.float16, cpu)
    assert type(fp16.linear_method) is GemvLinearMethod and fp16.single_row_gemv
    monkeypatch.setattr(ops, "load", lambda: object())
    monkeypatch.setattr(ops, "prefer_native_gemm", lambda: True)
    native = select_kernels(torch.bfloat16, cpu, native_norms=True, native_matmuls=True)
    assert isinstance(native.linear_method, PanelLinearMethod) and native.native_matmuls and native.native_norms
    panels_only = select_kernels(torch.bfloat16, cpu, native_matmuls=True)  # the layers' norms leave the LN form
    assert (panels_only.layer_norm_form, panels_only.final_norm_form) == ("torch", "layer_norm")
    monkeypatch.setattr(ops, "load", lambda: None)
    off = select_kernels(torch.bfloat16, cpu, native_norms=True)
    assert not off.native_norms and off.final_norm_form == "layer_norm"


def test_fast_module_attributes_follow_the_registered_ones():
    class Block(FastModule):
        def __init__(self) -> None:
            super().__init__()
            self.proj = RowParallelLinear(4, 4)
            self.scale = nn.Parameter(torch.ones(4), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * self.scale

    block = Block()
    assert type(block).__call__ is Block.forward  # no hook dispatch
    assert block.__dict__["proj"] is block._modules["proj"] and block.__dict__["scale"] is block._parameters["scale"]
    block.to(torch.float64)  # conversions keep the plain attributes on the registered parameters
    assert block.__dict__["scale"] is block._parameters["scale"] and block.scale.dtype == torch.float64
    block.scale = nn.Parameter(torch.full((4,), 2.0, dtype=torch.float64), requires_grad=False)
    assert block.scale is block._parameters["scale"] and float(block.scale[0]) == 2.0
    del block.proj
    assert "proj" not in block.__dict__ and "proj" not in block._modules


def test_tied_lm_head_shares_the_embedding_and_refines_bf16_logits():
    embed = VocabParallelEmbedding(3000, 16, torch.bfloat16)
    embed.weight.data.copy_(torch.randn(3000, 16))
    head = ParallelLMHead(3000, 16, torch.bfloat16)
    head.tie_weights(embed)
    assert head.weight is embed.weight
    hidden = torch.randn(2, 16).to(torch.bfloat16)
    logits = head.compute_logits(hidden)
    exact = hidden.float() @ embed.weight.float().t()
    assert logits.dtype == torch.float32 and torch.equal(logits.argmax(-1), exact.argmax(-1))
    top = exact.topk(2, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=1e-5)


def _checkpoint(path, tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


class _Tiny(FastModule):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(4, 2, 2, 1)
        self.norm_weight = nn.Parameter(torch.empty(4), requires_grad=False)


def test_loader_reports_unexpected_missing_and_misshaped_tensors(tmp_path):
    mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v")]
    model = nn.Module()
    model.model = _Tiny()
    good = {"model.qkv_proj.weight".replace("qkv", n): torch.ones(r, 4) for n, r in (("q", 4), ("k", 2), ("v", 2))}
    _checkpoint(tmp_path, {**good, "norm_weight": torch.full((4,), 3.0)})  # a name without "model."
    loader.load_weights(model, tmp_path, mapping, skip=lambda name: False)
    assert torch.equal(model.model.qkv_proj.weight, torch.ones(8, 4)) and float(model.model.norm_weight[0]) == 3.0
    _checkpoint(tmp_path, {**good, "model.norm_weight": torch.ones(4), "model.q_norm.weight": torch.ones(2)})
    with pytest.raises(ValueError, match=r"1 unexpected tensors in .*'model.q_norm.weight'"):
        loader.load_weights(model, tmp_path, mapping, skip=lambda name: False)
    loader.load_weights(model, tmp_path, mapping, skip=lambda name: "q_norm" in name)  # skipped
    _checkpoint(tmp_path, {k: v for k, v in good.items() if "v_proj" not in k} | {"model.norm_weight": torch.ones(4)})
    with pytest.raises(ValueError, match=r"1 tensors missing from .*'model.v_proj.weight'"):
        loader.load_weights(model, tmp_path, mapping, skip=lambda name: False)
    _checkpoint(tmp_path, {**good, "model.norm_weight": torch.ones(5)})
    with pytest.raises(ValueError, match=r"model.norm_weight: checkpoint shape \(5,\) != expected \(4,\)"):
        loader.load_weights(model, tmp_path, mapping, skip=lambda name: False)
