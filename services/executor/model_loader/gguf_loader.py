"""A GGUF file -> a model's parameters, the matrices of kept formats (``formats.py`` of
``layers/quantization/gguf/``) kept quantized.

The model is built for the file: ``gguf_tensors.gguf_quant_config`` reads the file's formats
from its header into a ``GGUFConfig``, which gives each layer its GGUF method (or none) when the
model builds it. Loading checks that each layer's method is the one the file's formats ask for
(``ValueError`` otherwise: a model built without the file's config, or for another file) and
hands the method its blocks (``load``); it never installs or swaps a method.

The file's ``general.architecture`` picks the map of its tensors onto our modules
(``gguf_tensors.py``: llama, qwen2, qwen3, phi3, gemma2, gemma3, qwen2moe, qwen3moe, gpt2, falcon,
served by :class:`~services.executor.models.llama.LlamaForCausalLM`, ``phi3.Phi3ForCausalLM``,
``gemma.Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``, ``qwen_moe.Qwen2MoeForCausalLM`` /
``Qwen3MoeForCausalLM``, ``gpt2.GPT2LMHeadModel`` and ``falcon.FalconForCausalLM``); every
decoder layer ``N``'s modules take ``blk.N``'s tensors, and ``token_embd`` / ``output_norm`` /
``output`` go to the embedding, the final norm and ``lm_head`` (``output`` absent when the
embeddings are tied; GPT-2's ``position_embd`` to ``wpe``).

A MoE layer's experts (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, stacked ``[E,
I, hidden]`` / ``[E, hidden, I]``) stay quantized too, matmul by matmul: the ``FusedMoE``'s
``GGUFMoEMethod`` holds each expert's gate | up blocks when gate and up are both of kept formats
and its down blocks when down is, the other matmul (e.g. down experts in a 5-bit format not kept,
as in llama.cpp's Q4_K_M files of Qwen1.5-MoE) dequantized into the model's dtype, and
multiplies each expert's tokens; experts with neither matmul kept are dequantized into the
unquantized method's ``w13`` / ``w2``. The router (``ffn_gate_inp``, F32 in llama.cpp's files) is
loaded as values.

What llama.cpp's converter changed is undone as transformers undoes it: the llama files' q and
k rows (and biases) are put back in Hugging Face's order (llama.cpp interleaves the two halves of
each head's rows for its RoPE: HF row ``h * D + j * D/2 + i`` is stored at ``h * D + 2 i + j``);
Gemma's norms, stored as ``1 + w``, are loaded as the stored value minus 1 (float32). Rows are
whole runs of blocks, so the quantized blocks are moved without dequantizing.

Under tensor parallelism (a model built under ``use_tp_group``) each rank keeps its share of
every tensor, blocks still kept (``gguf_shards.py``): a column-parallel layer's rows of each
merged shard (q, k, v by the rank's heads, taken after the q / k rows are put back in order),
a row-parallel layer's input columns as whole blocks (a share that would cut a block is
refused), the embedding's and LM head's vocabulary rows, a MoE layer's rows of each expert's
intermediate size (its down's columns as whole blocks); norms and routers whole. Each rank reads the
file's tensors whole and copies out its share.

A merged layer (q | k | v, gate | up, or Phi-3's fused tensors) whose shards are all of one kept
format keeps its blocks (``GGUFLinearMethod``), one whose shards are of several kept formats
keeps each shard's (``GGUFShardedLinearMethod``: llama.cpp's Q4_K_M mixes two K-quants in
q | k | v); any other (F32, F16, BF16, other quantizations) is dequantized by ``gguf.quants`` into
the model's dtype and loaded as usual. Biases and norms (F32 in llama.cpp's files) are loaded
as values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from kernels.cpu import ops
from services.executor.layers.fused_moe import FusedMoE
from services.executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from services.executor.layers.quantization.gguf import (
    GGUFLinearMethod,
    GGUFMoEMethod,
    GGUFShardedLinearMethod,
    kept,
    kept_formats,
)
from services.executor.layers.quantization.gguf.config import linear_method_of
from services.executor.model_loader.gguf_header import architecture
from services.executor.model_loader.gguf_shards import (
    column_shares,
    expert_shares,
    is_split,
    row_share,
    vocab_share,
)
from services.executor.model_loader.gguf_tensors import GGUFTensorMap, tensor_map


def gguf_file(model_dir: Path | str) -> Path | None:
    """The GGUF file a model directory is served from (``model_source.prepare_gguf_model``
    links it as ``model.gguf``), or ``None``."""
    path = Path(model_dir) / "model.gguf"
    return path if path.exists() else None


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:  # [H D, ...] -> [H D, ...]
    """Undo llama.cpp's q/k row permutation: ``[H, 2, D/2]`` rows were stored as ``[H, D/2, 2]``."""
    d = rows.shape[0] // num_heads
    return rows.reshape(num_heads, d // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _raw(tensor) -> torch.Tensor:  # a GGUFReader tensor's bytes / values, copied out of the memory map
    return torch.from_numpy(np.array(tensor.data, copy=True))


def _dequantized(tensor) -> torch.Tensor:  # [rows, cols] or [rows] float32
    from gguf import quants

    shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists dims innermost first
    return torch.from_numpy(np.array(quants.dequantize(tensor.data, tensor.tensor_type), copy=True)).reshape(shape)


class _Tensors:
    """The file's tensors by name, what has been read, and how rows are put back in order."""

    def __init__(self, reader, tmap: GGUFTensorMap, model: nn.Module, native: bool, path: Path) -> None:
        self.tensors = {t.name: t for t in reader.tensors}
        self.used: set[str] = set(tmap.ignored)
        self.permuted: dict[str, int] = {}  # kind -> heads
        if tmap.permuted:
            qkv = model.get_submodule(tmap.layers)[0].self_attn.qkv_proj  # the model's heads (not a rank's)
            heads = {"q": qkv.output_sizes[0] // qkv.head_size, "kv": qkv.output_sizes[1] // qkv.head_size}
            self.permuted = {kind: heads[which] for kind, which in tmap.permuted.items()}
        self.norm_offset, self.native, self.path = tmap.norm_offset, native, path

    def _rows(self, name: str, raw: bool) -> torch.Tensor:  # one tensor's rows in Hugging Face's order
        kind = name.split(".")[-2]  # blk.N.<kind>.weight
        rows = _raw(self.tensors[name]) if raw else _dequantized(self.tensors[name])
        if kind in self.permuted:
            rows = unpermute_rows(rows, self.permuted[kind])
        if "norm" in kind and self.norm_offset:
            rows = rows - self.norm_offset  # float32, as transformers subtracts it
        return rows

    @staticmethod
    def _share(module: nn.Module, rows: list[torch.Tensor], fmts: list, names: list[str]) -> list[torch.Tensor]:
        """This rank's part of each tensor's whole ``rows`` (``gguf_shards.py``; all of them at one rank)."""
        if not is_split(module):
            return rows
        if isinstance(module, ColumnParallelLinear):
            return column_shares(module, rows, names)
        if isinstance(module, RowParallelLinear):
            return [row_share(module, r, f, n) for r, f, n in zip(rows, fmts, names, strict=True)]
        return [vocab_share(module, r) for r in rows]

    def _used(self, names: list[str]) -> list:  # the named file tensors' formats (None: not kept)
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise ValueError(f"{self.path}: tensors missing: {missing}")
        self.used.update(names)
        return [kept(self.tensors[n].tensor_type) for n in names]

    def load(self, module: nn.Module, stems: list[str]) -> None:
        """``module``'s weight (and bias, if it has one) from the tensors ``<stem>.weight`` (``.bias``),
        rows concatenated in order (a ``FusedMoE``: :meth:`load_experts`).

        Raises:
            ValueError: a tensor is missing, or the tensors' rows do not fit the module.
        """
        if isinstance(module, FusedMoE):
            self.load_experts(module, stems)
            return
        names = [f"{s}.weight" for s in stems]
        bias = getattr(module, "bias", None)
        biases = [f"{s}.bias" for s in stems] if isinstance(bias, torch.Tensor) else []
        fmts = self._used(names + biases)[: len(names)]
        method = getattr(module, "quant_method", None)
        blocks = _check_method(names, fmts, _formats(method), _formats(linear_method_of(fmts) if method else None))
        rows = [self._rows(n, raw=blocks) for n in names]
        expected = (method.rows,) if blocks else tuple(module.weight.shape)  # blocks: their rows
        if not blocks and len(expected) == 2 and expected[0] == 1 and rows[0].dim() == 1:
            rows = [r[None] for r in rows]  # llama.cpp's converter squeezes [1, K] (Qwen2-MoE's shared expert gate)
        rows = self._share(module, rows, fmts if blocks else [None] * len(names), names)  # each tensor's (this rank's)
        if sum(r.shape[0] for r in rows) != expected[0] or (not blocks and tuple(torch.cat(rows).shape) != expected):
            raise ValueError(f"{names}: GGUF shapes {[tuple(r.shape) for r in rows]} do not fit {expected}")
        if blocks:  # [rows, K / block_size * block_bytes] uint8 each: the layer's GGUF method takes them
            method.load(module, rows, self.native)
        else:  # [rows, K] float32 (a norm: [rows])
            module.weight.data.copy_(torch.cat(rows))
        if biases:
            values = [self._rows(n, raw=False) for n in biases]  # [rows] float32 each
            split = isinstance(module, ColumnParallelLinear) and module.tp_size > 1  # a row-parallel bias is whole
            values = torch.cat(column_shares(module, values, biases) if split else values)
            if values.shape != bias.shape:
                raise ValueError(f"{biases}: GGUF shape {tuple(values.shape)} does not fit {tuple(bias.shape)}")
            bias.data.copy_(values)

    def load_experts(self, moe: FusedMoE, stems: list[str]) -> None:
        """A MoE layer's stacked experts from ``<gate>``, ``<up>``, ``<down>.weight`` (``[E, I,
        hidden]``, ``[E, I, hidden]``, ``[E, hidden, I]``), each matmul on its own: gate | up kept
        as blocks when both tensors are of kept formats, down when its tensor is
        (``moe.kept_formats``); a matmul not kept is dequantized into the model's dtype and
        served dense beside the other's blocks (the layer's ``GGUFMoEMethod``); neither kept, all
        three are dequantized into ``w13`` / ``w2`` (the fused MoE kernels).

        Raises:
            ValueError: a tensor is missing or of the wrong shape, or the layer's method is not
                the one the file's formats ask for.
        """
        names = [f"{s}.weight" for s in stems]
        fmts = kept_formats(tuple(self._used(names)))
        method = moe.quant_method
        _check_method(names, fmts, method.fmts if isinstance(method, GGUFMoEMethod) else None,
                      None if all(f is None for f in fmts) else fmts)
        rows = [self._rows(n, raw=f is not None) for n, f in zip(names, fmts, strict=True)]  # blocks or float32
        gate, up, down = expert_shares(moe, *rows, fmts[2], names)  # this rank's part of each
        if isinstance(method, GGUFMoEMethod):
            method.load(moe, gate, up, down, self.native)
            return
        w13, w2 = torch.cat((gate, up), dim=1), down  # [E, 2 I_rank, hidden], [E, hidden, I_rank] float32
        if w13.shape != moe.w13.shape or w2.shape != moe.w2.shape:
            raise ValueError(f"{names}: GGUF shapes {tuple(gate.shape)}, {tuple(up.shape)}, {tuple(down.shape)} do "
                             f"not fit the experts' {tuple(moe.w13.shape)}, {tuple(moe.w2.shape)}")
        moe.w13.data.copy_(w13)
        moe.w2.data.copy_(w2)


def _formats(method: object) -> tuple | None:
    """The formats a GGUF linear method keeps (each shard's, or its one), else None."""
    if isinstance(method, GGUFShardedLinearMethod):
        return tuple(m.fmt for m in method.parts)
    return (method.fmt,) if isinstance(method, GGUFLinearMethod) else None


def _check_method(names: list[str], fmts: list, built: tuple | None, wanted: tuple | None) -> bool:
    """Whether the layer keeps the tensors ``names`` (of ``fmts``) as blocks: its method's formats
    (``built``, None: it takes values) must be those the file's formats ask for (``wanted``).

    Raises:
        ValueError: they differ (the model was built without this file's ``GGUFConfig``, or for another file).
    """
    if built != wanted:
        raise ValueError(f"{names}: the file's formats {[f and f.name for f in fmts]} ask for "
                         f"{wanted and [f and f.name for f in wanted]} blocks, the layer was built for "
                         f"{built and [f and f.name for f in built]}: build the model with the file's quant_config "
                         "(services.executor.model_loader.quantization_config)")
    return built is not None


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    """``root``'s module at the dotted ``path``, or None where this model has none (Falcon's
    ``ln_attn`` in its old architecture, a MoE layer's absent shared expert)."""
    module = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


@torch.no_grad()
def load_gguf_weights(model: nn.Module, path: Path, native: bool) -> None:
    """Load ``model``'s parameters from the GGUF file at ``path``; ``native``: the kept
    formats' matmuls may run in the C kernel (``GGUFLinearMethod``).

    ``model``: a model of the file's architecture (its layers at the map's ``layers``, its
    ``lm_head`` and ``tie_word_embeddings``; a tied LM head shares the embedding's weight and
    method), built with the file's ``GGUFConfig`` (:func:`gguf_tensors.gguf_quant_config`),
    whole or one tensor-parallel rank's part (its layers take their rank's share).

    Raises:
        ValueError: an architecture not served from GGUF, a tensor missing or of the wrong
            shape, tensors this architecture does not know, a layer whose method is not the one
            the file's formats ask for, or a tensor-parallel rank's input columns of a
            row-parallel layer that are not whole blocks (``gguf_shards.row_share``).
    """
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tmap = tensor_map(architecture(reader))
    tensors = _Tensors(reader, tmap, model, native and ops.load() is not None, path)
    for i, layer in enumerate(model.get_submodule(tmap.layers)):
        for attr, parts in tmap.layer.items():
            module = _submodule(layer, attr)
            if module is not None:
                tensors.load(module, [f"blk.{i}.{p}" for p in parts])
    for attr, name in tmap.model.items():
        if attr == "lm_head" and model.tie_word_embeddings:
            continue
        tensors.load(model.get_submodule(attr), [name])
    unexpected = sorted(set(tensors.tensors) - tensors.used)
    if unexpected:
        raise ValueError(f"{len(unexpected)} unexpected tensors in {path}, e.g. {unexpected[:5]}")
