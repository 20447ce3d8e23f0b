"""A GGUF file's quantization read before the model is built (``model_loader.gguf_quant_config``,
from the header alone: ``gguf_header.read_header``), each layer's GGUF method taken from it at
build time, and the loader refusing a model that was not built for the file."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader
from gguf_files import TINY_LAYER0_V, tiny_hf_config, write_tiny_gguf

from services.executor.layers.linear import UnquantizedLinearMethod
from services.executor.layers.quantization import QUANTIZATION_METHODS
from services.executor.layers.quantization import gguf as G
from services.executor.model_loader import gguf_loader, gguf_quant_config
from services.executor.model_loader.gguf_header import read_header
from services.executor.models import get_model_class


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, smollm2_path)  # layer 0's attn_v in another K-quant than attn_q / attn_k
    return path


def test_the_header_gives_gguf_readers_architecture_and_tensor_types(tiny):
    reader = GGUFReader(tiny)
    assert read_header(tiny) == ("llama", {t.name: int(t.tensor_type) for t in reader.tensors})


def test_each_layer_takes_its_gguf_method_when_the_model_is_built(tiny):
    config = gguf_quant_config(tiny)
    assert QUANTIZATION_METHODS["gguf"] is type(config) and not config.from_checkpoint
    model = get_model_class(tiny_hf_config(1024))(tiny_hf_config(1024), torch.float32, "cpu", quant_config=config)
    qkv = model.model.layers[0].self_attn.qkv_proj.quant_method
    assert isinstance(qkv, G.GGUFShardedLinearMethod)
    assert [m.fmt for m in qkv.parts] == [G.Q5_K, G.Q5_K, TINY_LAYER0_V]
    assert isinstance(model.model.layers[1].self_attn.qkv_proj.quant_method, G.GGUFLinearMethod)
    embed = model.model.embed_tokens.quant_method
    assert isinstance(embed, G.GGUFLinearMethod) and model.lm_head.quant_method is embed  # tied: one method
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.float32  # F32 norms: values
    gguf_loader.load_gguf_weights(model, tiny, native=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.uint8


def test_a_model_built_without_the_files_config_is_refused(tiny):
    model = get_model_class(tiny_hf_config(1024))(tiny_hf_config(1024), torch.float32, "cpu")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant_method, UnquantizedLinearMethod)
    with pytest.raises(ValueError, match=r"build the model with the file's quant_config"):
        gguf_loader.load_gguf_weights(model, tiny, native=False)
