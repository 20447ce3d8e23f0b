"""GGUF test data written by our own code: random but valid blocks of any kept format
(:func:`random_blocks`), K-quant packers from float weights (:func:`pack_k`: round to nearest,
simpler than llama.cpp's search, the layouts of gguf-py's ``quants.py``, whose ``quantize`` lacks
the K-quants), and a tiny Llama GGUF file with K-quant matrices and a cut of SmolLM2's tokenizer
(:func:`write_tiny_gguf`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from services.executor.layers import gguf as G

#: byte offsets of each format's fp16 fields (scales, mins), the rest of a block being free bits
FP16_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(fmt: G.BlockFormat, n: int, k: int, seed: int, scale: float = 0.002) -> torch.Tensor:
    """``[n, k / block_size * block_bytes]`` uint8 rows of ``fmt`` blocks: random bytes, with
    finite fp16 scales in ``[0, scale)`` (Q4_1's minimum: normal, 0.1 std)."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k // fmt.block_size, fmt.block_bytes), generator=gen, dtype=torch.uint8)
    for i, off in enumerate(FP16_FIELDS[fmt.ggml_type]):
        values = torch.randn if fmt is G.Q4_1 and i == 1 else torch.rand
        factor = 0.1 if fmt is G.Q4_1 and i == 1 else scale
        b[..., off:off + 2] = (values(n, k // fmt.block_size, 1, generator=gen) * factor).half().view(torch.uint8)
    return b.view(n, -1)


def _fp16(v: np.ndarray) -> np.ndarray:  # [B] float -> [B, 2] uint8
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_q4_q5_k(x: np.ndarray, bits: int) -> np.ndarray:  # [B, 256] float32 -> [B, 144 | 176] uint8
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # [B, 8]: w = d sc q - dmin m, m >= 0
    span = np.maximum(sub.max(-1) - lo, 1e-8) / (2**bits - 1)
    d = (span.max(-1) / 63).astype(np.float16).astype(np.float32)  # [B]
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(span / np.maximum(d[:, None], 1e-12)), 1, 63).astype(np.uint8)  # [B, 8]
    mn = np.clip(np.round(-lo / np.maximum(dmin[:, None], 1e-12)), 0, 63).astype(np.uint8)
    step = d[:, None, None] * sc[..., None]
    q = np.clip(np.round((sub + (dmin[:, None] * mn)[..., None]) / step), 0, 2**bits - 1).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=-1)  # [B, 12]
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)  # sub-blocks 2i (low), 2i + 1 (high)
    parts = [_fp16(d), _fp16(dmin), scales]
    if bits == 5:
        high = (q >> 4).astype(np.uint8)  # [B, 8, 32]
        parts.append(np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate(parts + [qs], axis=-1)


def _pack_q6_k(x: np.ndarray) -> np.ndarray:  # [B, 256] float32 -> [B, 210] uint8
    grp = x.reshape(-1, 16, 16)
    amax = np.abs(grp).max(-1)  # [B, 16]
    d = (amax.max(-1) / 32 / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(amax / 32 / np.maximum(d[:, None], 1e-12)), 1, 127).astype(np.int8)
    q = np.clip(np.round(grp / (d[:, None, None] * sc[..., None])), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # element 128 g + 32 s + e
    ql = ((q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)).reshape(-1, 128)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), _fp16(d)], axis=-1)


def pack_k(w: np.ndarray, fmt: G.BlockFormat) -> np.ndarray:
    """``w`` ``[N, K]`` float32 (K a multiple of 256) as ``fmt`` (Q4_K, Q5_K or Q6_K) rows:
    ``[N, K / 256 * block_bytes]`` uint8."""
    n, k = w.shape
    flat = w.reshape(-1, 256).astype(np.float32)
    packed = _pack_q6_k(flat) if fmt is G.Q6_K else _pack_q4_q5_k(flat, 4 if fmt is G.Q4_K else 5)
    assert packed.shape[1] == fmt.block_bytes
    return np.ascontiguousarray(packed.reshape(n, -1))


#: tiny Llama (head_dim 64; every matrix's input a multiple of 256, as the K-quants need)
TINY = dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2, context=512)
#: the format of each matrix (merged layers' shards share one) but for :data:`TINY_LAYER0_V`
TINY_FORMATS = {"token_embd": G.Q6_K, "attn_q": G.Q5_K, "attn_k": G.Q5_K, "attn_v": G.Q5_K,
                "attn_output": G.Q4_K, "ffn_gate": G.Q4_K, "ffn_up": G.Q4_K, "ffn_down": G.Q6_K}
#: layer 0's attn_v, in another format than its q and k (as llama.cpp's Q4_K_M does)
TINY_LAYER0_V = G.Q6_K


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:  # [H D, ...] -> [H D, ...]
    """llama.cpp's converter's q/k row order: Hugging Face row ``h D + j D/2 + i`` is stored at
    ``h D + 2 i + j`` (whole rows: blocks move with them)."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def tiny_hf_config(vocab: int):
    """The ``LlamaConfig`` of :func:`write_tiny_gguf`'s file."""
    from transformers import LlamaConfig

    t = TINY
    return LlamaConfig(vocab_size=vocab, hidden_size=t["hidden"], intermediate_size=t["inter"],
                       num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
                       num_key_value_heads=t["kv_heads"], max_position_embeddings=t["context"], rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def write_tiny_gguf(path: Path, tokenizer_dir: Path, vocab: int = 1024, seed: int = 0, std: float = 0.15,
                    mixed: bool = True) -> dict[str, torch.Tensor]:
    """A Llama GGUF at ``path``: :data:`TINY`'s shapes, random normal weights (``std``) packed in
    :data:`TINY_FORMATS` (tied embeddings; norms F32; q and k rows in llama.cpp's order), and the
    byte-level BPE tokenizer of the Hugging Face directory ``tokenizer_dir`` (SmolLM2's: token 1
    BOS, 2 EOS) cut to its first ``vocab`` tokens and the merges among them (49k token strings
    cost seconds at each parse of the file). ``mixed``: layer 0's attn_v in :data:`TINY_LAYER0_V`.

    Returns the Hugging Face state dict of the weights the file holds (dequantized by
    ``gguf.quants`` to float32), for ``LlamaForCausalLM(tiny_hf_config(vocab))``.
    """
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants

    hf_tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = hf_tok["model"]["vocab"]  # token -> id
    tokens = sorted((t for t in ids if ids[t] < vocab), key=ids.get)
    assert len(tokens) == vocab and hf_tok["model"]["type"] == "BPE"
    special = {a["id"] for a in hf_tok["added_tokens"] if a["special"]}
    known = set(tokens)
    merges = [" ".join(m) for m in hf_tok["model"]["merges"] if "".join(m) in known and set(m) <= known]
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(vocab)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    template = tokenizer_dir / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())
    t = TINY
    writer.add_context_length(t["context"])
    writer.add_embedding_length(t["hidden"])
    writer.add_block_count(t["layers"])
    writer.add_feed_forward_length(t["inter"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_rope_dimension_count(t["hidden"] // t["heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)
    head = t["hidden"] // t["heads"]
    state: dict[str, torch.Tensor] = {}

    def matrix(name: str, hf: str, kind: str, rows: int, cols: int, std_: float = std, heads: int = 0) -> None:
        fmt = TINY_LAYER0_V if mixed and name == "blk.0.attn_v.weight" else TINY_FORMATS[kind]
        raw = pack_k(rng.standard_normal((rows, cols)).astype(np.float32) * std_, fmt)  # HF's row order
        state[hf] = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(fmt.ggml_type)))
        stored = np.ascontiguousarray(llama_cpp_permute(raw, heads)) if heads else raw
        writer.add_tensor(name, stored, raw_dtype=GGMLQuantizationType(fmt.ggml_type))

    def norm(name: str, hf: str) -> None:
        w = (1.0 + 0.2 * rng.standard_normal(t["hidden"])).astype(np.float32)
        state[hf] = torch.from_numpy(w)
        writer.add_tensor(name, w)

    matrix("token_embd.weight", "model.embed_tokens.weight", "token_embd", vocab, t["hidden"], 1.0)
    for i in range(t["layers"]):
        blk, hf = f"blk.{i}.", f"model.layers.{i}."
        norm(blk + "attn_norm.weight", hf + "input_layernorm.weight")
        matrix(blk + "attn_q.weight", hf + "self_attn.q_proj.weight", "attn_q", t["heads"] * head, t["hidden"],
               heads=t["heads"])
        matrix(blk + "attn_k.weight", hf + "self_attn.k_proj.weight", "attn_k", t["kv_heads"] * head, t["hidden"],
               heads=t["kv_heads"])
        matrix(blk + "attn_v.weight", hf + "self_attn.v_proj.weight", "attn_v", t["kv_heads"] * head, t["hidden"])
        matrix(blk + "attn_output.weight", hf + "self_attn.o_proj.weight", "attn_output", t["hidden"],
               t["heads"] * head)
        norm(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        matrix(blk + "ffn_gate.weight", hf + "mlp.gate_proj.weight", "ffn_gate", t["inter"], t["hidden"])
        matrix(blk + "ffn_up.weight", hf + "mlp.up_proj.weight", "ffn_up", t["inter"], t["hidden"])
        matrix(blk + "ffn_down.weight", hf + "mlp.down_proj.weight", "ffn_down", t["hidden"], t["inter"])
    norm("output_norm.weight", "model.norm.weight")
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state
