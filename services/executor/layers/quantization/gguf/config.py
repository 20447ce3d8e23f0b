"""A GGUF file's quantization (``quant_method: "gguf"``): which of the model's layers keep which
block formats, read from the file's header before the model is built
(``model_loader.gguf_loader.gguf_quant_config``), so that each layer takes its GGUF method when it
is built, as a GPTQ checkpoint's layers take theirs.

The config is keyed by our module names (``model.layers.0.self_attn.qkv_proj``, ``lm_head``):
each module's file tensors' ggml type ids, in row order (q, k, v; gate, up), and each MoE
layer's gate, up and down experts'. A layer whose tensors are all of kept formats
(``formats.FORMATS``) gets :class:`GGUFLinearMethod` (one format) or
:class:`GGUFShardedLinearMethod` (several: llama.cpp's Q4_K_M q | k | v); any other (F32, F16,
another quantization, a module the file does not name) is unquantized: the loader dequantizes
its tensors into the model's dtype. A ``FusedMoE`` gets :class:`GGUFMoEMethod` when one of its
two matmuls is kept (``moe.kept_formats``), else the unquantized experts.

The per-tensor decision is all made here, at build time: the loader only checks that the
model was built for the file it loads (``ValueError`` otherwise) and hands each method its
blocks.
"""

from __future__ import annotations

from typing import Any

from services.executor.layers.linear import LinearMethodBase
from services.executor.layers.quantization.base import QuantizationConfig
from services.executor.layers.quantization.gguf.formats import BlockFormat, kept
from services.executor.layers.quantization.gguf.linear import GGUFLinearMethod, GGUFShardedLinearMethod
from services.executor.layers.quantization.gguf.moe import GGUFMoEMethod, kept_formats


def linear_method_of(fmts: list[BlockFormat | None]) -> GGUFLinearMethod | GGUFShardedLinearMethod | None:
    """The method of a layer whose file tensors are of ``fmts`` in row order (``None``: a
    format not kept, so the layer is unquantized)."""
    if not fmts or None in fmts:
        return None
    if len(set(fmts)) == 1:
        return GGUFLinearMethod(fmts[0])
    return GGUFShardedLinearMethod(list(fmts))


class GGUFConfig(QuantizationConfig):
    """The block formats of one GGUF file's tensors, by our module names.

    ``linear``: a linear layer, embedding or LM head -> its tensors' formats in row order;
    ``experts``: a ``FusedMoE`` -> its gate, up and down experts' formats (``None``: not kept).
    """

    name = "gguf"
    from_checkpoint = False

    def __init__(self, linear: dict[str, tuple[BlockFormat | None, ...]],
                 experts: dict[str, tuple[BlockFormat | None, ...]]) -> None:
        self.linear, self.experts = linear, experts

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        """``{"quant_method": "gguf", "linear": {module: [ggml type, ...]}, "experts": {module:
        [gate, up, down types]}}``, as ``gguf_quant_config`` reads it from the file's header.

        Raises:
            ValueError: no ``linear`` map: a GGUF model's formats come from its file (serve the
                ``.gguf`` file).
        """
        if "linear" not in config:
            raise ValueError("a GGUF model's quantization is read from the GGUF file's header: serve the .gguf "
                             "file (its directory's model.gguf), not a config.json that names quant_method 'gguf'")

        def formats(types: list[int]) -> tuple[BlockFormat | None, ...]:
            return tuple(kept(t) for t in types)

        return cls({name: formats(types) for name, types in config["linear"].items()},
                   {name: formats(types) for name, types in config.get("experts", {}).items()})

    def linear_method(self, prefix: str, shard_names: list[str]) -> LinearMethodBase | None:
        return linear_method_of(list(self.linear.get(prefix, ())))

    def layer_method(self, prefix: str) -> LinearMethodBase | None:
        """A GGUF file keeps its embedding, LM head and routers as blocks too when their formats are kept."""
        return self.linear_method(prefix, [])

    def moe_method(self, prefix: str) -> GGUFMoEMethod | None:
        fmts = kept_formats(self.experts.get(prefix, (None, None, None)))
        return None if all(f is None for f in fmts) else GGUFMoEMethod(fmts)
