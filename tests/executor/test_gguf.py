"""GGUF blocks kept quantized (services/executor/layers/quantization/gguf/): the torch dequantization
against ``gguf.quants.dequantize``, and the linear method's torch path against ``F.linear``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from gguf_fixtures import pack_k, random_blocks
from torch import nn

from kernels.cpu import quant_ops
from services.executor.layers.quantization import gguf as G
from services.executor.layers.quantization.gguf import r16 as gguf_r16

FORMATS = [G.Q4_0, G.Q4_1, G.Q8_0, G.Q4_K, G.Q5_K, G.Q6_K]


def quantized(fmt: G.BlockFormat, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Random ``[n, k]`` weights quantized by ``gguf.quants`` (the K-quants: by our packer):
    (the uint8 blocks, gguf's dequantization)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = pack_k(w, fmt) if fmt.block_size == 256 else quants.quantize(w, GGMLQuantizationType(fmt.ggml_type))
    return torch.from_numpy(raw), quants.dequantize(raw, GGMLQuantizationType(fmt.ggml_type))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_block_layout_matches_gguf(fmt):
    k = 3 * fmt.block_size
    blocks, reference = quantized(fmt, 6, k)
    assert blocks.shape == (6, 3 * fmt.block_bytes)
    assert fmt.block_bytes == quants.GGML_QUANT_SIZES[GGMLQuantizationType(fmt.ggml_type)][1]
    torch.testing.assert_close(G.dequantize(blocks, fmt), torch.from_numpy(reference), rtol=0, atol=0)
    torch.testing.assert_close(G.dequantize(blocks, fmt, torch.bfloat16), torch.from_numpy(reference).bfloat16(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q5_K, G.Q6_K], ids=lambda f: f.name)
def test_k_quant_random_blocks_dequantize_as_gguf(fmt):
    """Every bit pattern of the quants and scales (random bytes, finite fp16 scales) reads as gguf reads it."""
    blocks = random_blocks(fmt, 5, 512, seed=fmt.ggml_type)
    reference = quants.dequantize(blocks.numpy(), GGMLQuantizationType(fmt.ggml_type))
    torch.testing.assert_close(G.dequantize(blocks, fmt), torch.from_numpy(reference), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_method_torch_path(fmt, dtype):
    k = 2 * fmt.block_size
    blocks, reference = quantized(fmt, 10, k, seed=1)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    layer = nn.Module()
    method = G.GGUFLinearMethod(fmt, dtype, native=False)
    method.install(layer, blocks, k)
    w = torch.from_numpy(reference).to(dtype)
    torch.testing.assert_close(method.apply(layer, x), F.linear(x, w), rtol=0, atol=0)
    logits = method.apply_logits(layer, x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(x.float(), torch.from_numpy(reference)), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([9, 0, 4])
    torch.testing.assert_close(method.embed(layer, ids), w[ids], rtol=0, atol=0)


def test_install_refuses_partial_rows():
    blocks, _ = quantized(G.Q4_1, 2, 64)
    with pytest.raises(ValueError, match="not rows of 96 elements"):
        G.GGUFLinearMethod(G.Q4_1, torch.float32).install(nn.Module(), blocks, 96)


def test_sharded_method_multiplies_each_shard_in_its_format():
    """q | k | v in Q5_K, Q5_K and Q6_K (a Q4_K_M file's mix): the outputs of each shard's
    blocks side by side, plus the bias."""
    shards = [quantized(fmt, rows, 256, seed=i) for i, (fmt, rows) in enumerate(((G.Q5_K, 8), (G.Q5_K, 4),
                                                                                  (G.Q6_K, 4)))]
    layer = nn.Module()
    method = G.GGUFShardedLinearMethod([G.Q5_K, G.Q5_K, G.Q6_K], torch.float32)
    method.install(layer, [blocks for blocks, _ in shards], 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(16)
    weight = torch.cat([torch.from_numpy(ref) for _, ref in shards])  # [16, 256]
    torch.testing.assert_close(method.apply(layer, x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert layer.weight.numel() == 0 and len(layer.gguf_shards) == 3


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_native_method_keeps_16_row_groups_interleaved(fmt, kernel_library, interleaved_gguf):
    """With the native kernels a weight of a multiple of 16 rows, of any type, is held in gguf_r16's
    layout (same bytes, same size): its dequantized weight and embedding rows are the file's, and
    bf16 activations of more than NATIVE_MAX_ROWS rows take the int8 kernel (Q4_0 / Q4_1 / Q8_0:
    equal to the file layout's int8 kernel up to float32 rounding; the K-quants, whose file layout
    multiplies in float32: within the int8 activations' bound of the float32 product); 24 rows stay
    in the file's layout."""
    k = 2 * fmt.block_size
    blocks, reference = quantized(fmt, 48, k, seed=3)
    layer = nn.Module()
    method = G.GGUFLinearMethod(fmt, torch.bfloat16, native=True)
    method.install(layer, blocks, k)
    assert method.r16 and method.kernel_type == fmt.ggml_type | 0x100
    assert layer.weight.shape == blocks.shape and not torch.equal(layer.weight, blocks)
    assert torch.equal(gguf_r16.unpack_rows(layer.weight, fmt), blocks)
    torch.testing.assert_close(method.weight(layer, torch.float32), torch.from_numpy(reference), rtol=0, atol=0)
    ids = torch.tensor([47, 0, 17, 16])
    torch.testing.assert_close(method.embed(layer, ids), torch.from_numpy(reference)[ids].bfloat16(), rtol=0, atol=0)
    x = torch.randn(G.NATIVE_MAX_ROWS + 5, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = method.apply_logits(layer, x)
    if fmt.block_size == 32:
        expected = quant_ops.gemm_gguf(x, blocks, fmt, k, torch.float32)  # the file layout's int8 kernel
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    else:  # |x - d_a qa| <= d_a / 2 per element, d_a = max |x| / 127 per 32-element block
        weight = torch.from_numpy(reference).double()  # [48, k]
        da = x.double().view(x.shape[0], -1, 32).abs().amax(-1) / 127
        bound = 0.5 * torch.einsum("mb,nb->mn", da, weight.abs().view(48, -1, 32).sum(-1))
        assert ((out.double() - x.double() @ weight.t()).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    other = nn.Module()
    plain = G.GGUFLinearMethod(fmt, torch.bfloat16, native=True)
    plain.install(other, blocks[:24], k)
    assert not plain.r16 and torch.equal(other.weight, blocks[:24])


def test_moe_experts_keep_gate_up_only_with_both_formats_kept_and_down_on_its_own():
    """``kept_formats``: gate | up is one matmul, kept only when gate and up both are; down apart.
    ``GGUFMoEMethod`` refuses formats that keep half of gate | up, or nothing (dense ``w13`` / ``w2``)."""
    from services.executor.layers.quantization.gguf import GGUFMoEMethod, kept_formats

    assert kept_formats((G.Q4_K, G.Q8_0, None)) == (G.Q4_K, G.Q8_0, None)
    assert kept_formats((G.Q4_K, None, G.Q6_K)) == (None, None, G.Q6_K)
    assert kept_formats((None, G.Q4_K, None)) == (None, None, None)
    for fmts in ((G.Q4_K, None, G.Q6_K), (None, None, None)):
        with pytest.raises(ValueError, match=r"each of gate \| up and down is kept whole or not, and one of them must be"):
            GGUFMoEMethod(fmts, torch.float32)
