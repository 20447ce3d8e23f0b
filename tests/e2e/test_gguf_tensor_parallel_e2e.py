"""A GGUF file served with tensor parallelism (``LLM(model="...gguf", tensor_parallel_size=N)``),
its matrices kept in their blocks on every rank: greedy tokens equal one rank's, in float32.

The files are written by ``tests/gguf_files.py`` as llama.cpp's converter writes them (q / k
rows permuted, merged layers' shards in different formats in some layers): a Llama with
K-quants where whole rows are split (q, k, v, gate, up, the tied embedding) and ``o_proj`` in
Q8_0, 4 heads / 2 KV heads over 2 ranks; and an untied Llama of 9 heads / 3 KV heads in the
32-element formats only, over 3 ranks (hidden size 288: no K-quant fits it), whose vocabulary
rows (342 + 341 + 341) are not multiples of 16 (the file's row layout, not ``gguf_r16``'s); a file
whose row-parallel share would cut a block is refused by ``LLM`` with the rank's error."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_files import TINY_FORMATS, tiny_hf_config, write_gguf
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from services.executor.layers.quantization import gguf as G
from shared.config import kernel_cache_dir

PROMPTS = [[1, 2, 3, 400, 500, 700], [900, 18, 31], list(range(300, 340))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

#: row-parallel o_proj in 32-element blocks (256 input columns, 128 a rank); down_proj's 512 split in 256s
KQ_FORMATS = {**TINY_FORMATS, "attn_output": G.Q8_0}
#: every matrix in 32-element blocks: q | k | v and gate | up mix formats in every layer
Q32_FORMATS = {"token_embd": G.Q8_0, "output": G.Q4_1, "attn_q": G.Q4_0, "attn_k": G.Q4_0, "attn_v": G.Q8_0,
               "attn_output": G.Q4_0, "ffn_gate": G.Q8_0, "ffn_up": G.Q4_0, "ffn_down": G.Q4_1}
UNEVEN = LlamaConfig(vocab_size=1024, hidden_size=288, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512, rms_norm_eps=1e-5,
                     rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None)


def _generate(path: Path, tp: int, cache: Path) -> list[list[int]]:
    with LLM(model=str(path), dtype="float32", tensor_parallel_size=tp, kv_cache_memory_bytes=8 << 20,
             cache_dir=str(cache)) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(("config", "formats", "overrides", "tp"), [
    pytest.param(tiny_hf_config(1024), KQ_FORMATS, {"blk.0.attn_v": G.Q6_K}, 2, id="k-quants-tied-tp2"),
    pytest.param(UNEVEN, Q32_FORMATS, {}, 3, id="9-heads-3-kv-untied-tp3"),
])
def test_gguf_over_ranks_gives_one_rank_greedy_tokens(tmp_path, smollm2_path, config, formats, overrides, tp):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, config, smollm2_path, formats, overrides, std=0.15)
    (tmp_path / "cache").mkdir()  # the served directory goes with tmp_path; the kernels are the ones built
    (tmp_path / "cache" / "kernels").symlink_to(kernel_cache_dir(), target_is_directory=True)
    one = _generate(path, 1, tmp_path / "cache")
    assert len({tuple(t) for t in one}) == len(PROMPTS)  # the prompts' outputs differ: the test can fail
    assert _generate(path, tp, tmp_path / "cache") == one


def test_gguf_whose_row_parallel_share_cuts_a_block_is_refused(tmp_path, smollm2_path):
    """The tiny K-quant Llama's Q4_K o_proj (256 input columns) at TP=2: 128 columns a rank, half
    a super-block; ``LLM`` raises the rank's load error."""
    path = tmp_path / "tiny-kq.gguf"
    write_gguf(path, tiny_hf_config(1024), smollm2_path, TINY_FORMATS, {})
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernel_cache_dir(), target_is_directory=True)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight: tensor_parallel_size=2 .* cut Q4_K's "
                                         r"blocks of 256 elements"):
        _generate(path, 2, tmp_path / "cache")
