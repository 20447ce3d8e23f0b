"""``shared/gguf_config.py``'s completions that need a real model's size to show: Gemma 2 27B's
and Gemma 3 27B's ``query_pre_attn_scalar`` (``hidden_size / num_attention_heads``, not
``head_dim``), checked on their configs as transformers reads them (the files' metadata)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from shared.gguf_config import complete_gguf_config


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
