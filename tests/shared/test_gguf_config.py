"""``shared/gguf_config.py``'s completions that need a real model's size to show, checked on
configs as transformers reads them and the files' metadata: Gemma 2 27B's and Gemma 3 27B's
``query_pre_attn_scalar`` (``hidden_size / num_attention_heads``, not ``head_dim``), Phi-4-mini's
partial rotary with its LongRoPE factors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shared.gguf_config import GGUFConfigError, complete_gguf_config


def _reader(arch: str, **keys: object) -> SimpleNamespace:
    """A stand-in for ``gguf.GGUFReader``: the metadata ``<arch>.<key>`` and no tensors."""
    fields = {"general.architecture": arch} | {f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()}
    return SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in fields.items()}, tensors=[])


@pytest.mark.parametrize(("arch", "layers", "hidden", "heads", "head_dim", "scalar"), [
    ("gemma2", 26, 2304, 8, 256, 256),  # Gemma 2 2B
    ("gemma2", 42, 3584, 16, 256, 256),  # 9B: hidden / heads would be 224
    ("gemma2", 46, 4608, 32, 128, 144),  # 27B
    ("gemma3", 34, 2560, 8, 256, 256),  # Gemma 3 4B
    ("gemma3", 62, 5376, 32, 128, 168),  # 27B
])
def test_gemma_query_pre_attn_scalar_is_the_models(arch, layers, hidden, heads, head_dim, scalar):
    config = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
              "query_pre_attn_scalar": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    complete_gguf_config(config, _reader(arch, attention__key_length=head_dim), Path("model.gguf"))
    assert (config["head_dim"], config["query_pre_attn_scalar"]) == (head_dim, scalar)


def test_phi3_rotates_the_share_of_each_head_the_file_states():
    """Phi-4-mini (phi3 architecture) rotates 96 of its 128 head dimensions: ``rope.dimension_count``,
    which transformers' mapping drops; its LongRoPE factors are then 48 per list."""
    config = {"num_hidden_layers": 32, "hidden_size": 3072, "num_attention_heads": 24, "max_position_embeddings": 131072,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    reader = _reader("phi3", attention__key_length=128, rope__dimension_count=96,
                     rope__scaling__original_context_length=4096, rope__scaling__attn_factor=1.19)
    reader.tensors = [SimpleNamespace(name=f"rope_factors_{k}.weight", data=np.full(48, v, dtype=np.float32))
                      for k, v in (("long", 2.0), ("short", 1.0))]
    complete_gguf_config(config, reader, Path("model.gguf"))
    assert config["partial_rotary_factor"] == 0.75
    assert config["rope_parameters"] == {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "short_factor": [1.0] * 48,
        "long_factor": [2.0] * 48, "original_max_position_embeddings": 4096, "attention_factor": pytest.approx(1.19)}
    reader.tensors[0].data = np.ones(64, dtype=np.float32)  # factors for the whole head: refused
    with pytest.raises(GGUFConfigError, match="holds 64 values .* needs 48"):
        complete_gguf_config(dict(config, rope_parameters={"rope_theta": 10000.0}), reader, Path("model.gguf"))
