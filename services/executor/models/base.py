"""What every decoder-only model class gives the model runner, written once: the attention
backend shared by its layers, logits, loading a Hugging Face checkpoint (or a GGUF file:
``model_loader/``) and the kernels' weight forms. Each architecture (``llama.py``,
``gpt2.py``, ``gpt_neox.py``, ...) builds its layers in ``__init__``, writes ``forward`` and
states where it differs through the hooks below; how a step runs is the runner's
(``services/executor/forward_pass.py``), not the model's.

The model runner's contract (``services/executor/model_runner.py``):

- ``forward(input_ids [T] int64, positions [T] int64, kv_caches, attn_metadata) -> [T, hidden]``;
- ``compute_logits(hidden [N, hidden]) -> [N, vocab] float32`` (None off rank 0);
- ``load_weights(model_dir)``; ``num_kv_heads_per_rank`` and ``head_dim`` size the KV cache;
- ``attn_backend`` (settable: every :class:`Attention` layer gets it);
- ``llama_stack()``: the decoder's parts when the runner may run its layers itself (every
  layer in one C call on CPU), else None; ``weights_generation`` says when the weight forms
  it points into were derived again; ``takes_single_row_gemv``: one-row passes on torch's GEMV.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from services.executor.attention import AttentionBackend, get_attention_backend
from services.executor.layers.attention import Attention
from services.executor.layers.layernorm import RMSNorm
from services.executor.layers.quantization import QuantizationConfig, get_quantization_config
from services.executor.layers.selection import (
    KernelChoice,
    KernelSwitches,
    restore_weights,
    select_kernels,
    use_linear_methods,
)
from services.executor.layers.utils import FastModule
from services.executor.model_loader import gguf_loader, loader
from services.executor.parallel.group import current_tp_group

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V [num_blocks, block_size, Hkv, D]

#: the architectures whose linear layers take a checkpoint's quantization (the error's list)
QUANTIZED_ARCHITECTURES = ("the Llama family (Llama, Mistral, Qwen2, Qwen3), OPT, Gemma 1/2/3, Phi-3, and the "
                           "attention of Mixtral / Qwen2-MoE / Qwen3-MoE (their experts unquantized)")


class LlamaStack(Protocol):
    """The parts of a Llama-layout decoder (HF's ``LlamaModel``) that a runner running the
    decoder layers itself calls (``services/executor/forward_pass.py``)."""

    embed_tokens: Callable[[torch.Tensor], torch.Tensor]  # input_ids [T] int64 -> [T, hidden]
    rotary_emb: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions [T] -> cos, sin [T, 1, D]
    # pre-norm decoder layers: input_layernorm, self_attn (qkv_proj, o_proj, attn, q_norm), post_attention_layernorm,
    # mlp (gate_up_proj, down_proj), as layers/cpu/native_layers.py reads them
    layers: Sequence[nn.Module]
    norm: Callable[[torch.Tensor], torch.Tensor]  # the final RMSNorm, [T, hidden] -> [T, hidden]


class PagedCausalLM(KernelSwitches, FastModule):
    """Base of a causal LM over a paged KV cache.

    Args:
        hf_config: the ``transformers`` config of the checkpoint.
        dtype: parameter / activation / KV cache dtype.
        device: where parameters live (allocated uninitialised by the subclass under
            ``torch.device(device)``; :meth:`load_weights` fills them).
        attn_backend: an :class:`AttentionBackend` or a name for :func:`get_attention_backend`.
        native_cpu_kernels: allow the native bf16 GEMM for the matmuls (``layers/selection.py``).
        quant_config: the checkpoint's quantization (``layers/quantization/``); default: read from
            ``hf_config``'s ``quantization_config``. A subclass that sets ``takes_quantization``
            gives its decoder's linear layers its methods (``linear_method_for``); the others
            refuse a quantized checkpoint. A GGUF file's (``model_loader.quantization_config``)
            every GGUF-served architecture takes, for every layer of the file's map.

    A subclass sets ``self.lm_head`` (with ``compute_logits``), ``num_kv_heads_per_rank`` and
    ``head_dim``, and may set ``stacked_params_mapping`` (checkpoint shards loaded into merged
    parameters), ``checkpoint_prefix`` (the prefix its checkpoints put before the decoder's
    names that this class names under ``model.``, e.g. GPT-2's ``transformer.``) and
    ``skip_checkpoint_tensor`` (tensors to ignore: rotary caches and a tied head; GPT-2 and
    GPT-NeoX add their attention masks). Its hooks: ``takes_quantization``,
    ``takes_native_norms`` and :meth:`set_norm_forms` (its RMSNorms in the C kernel),
    ``takes_single_row_gemv``, :meth:`llama_stack`.

    Raises:
        ValueError: a quantized checkpoint for an architecture that does not take one, or a
            quantization this engine does not implement (``get_quantization_config``).
    """

    stacked_params_mapping: list[tuple[str, str, str | int]] = []
    takes_quantization = False  # the decoder's linear layers take quant_config's methods
    takes_native_norms = False  # native_cpu_kernels also puts its RMSNorms in the C kernel (set_norm_forms)
    # one-row passes on torch's GEMV where the kernels allow it (KernelChoice.single_row_gemv; the
    # runner decides per step: forward_pass.py)
    takes_single_row_gemv = False

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                 attn_backend: AttentionBackend | str = "auto", native_cpu_kernels: bool = False,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.quant_config = quant_config if quant_config is not None else get_quantization_config(hf_config)
        if self.quant_config is not None and self.quant_config.from_checkpoint and not self.takes_quantization:
            raise ValueError(f"{self.quant_config.name} quantization is not supported for {type(self).__name__} "
                             f"(quantized checkpoints: {QUANTIZED_ARCHITECTURES})")
        device = torch.device(device)
        if isinstance(attn_backend, str):
            attn_backend = get_attention_backend(attn_backend, device)
        self.hf_config, self.dtype, self.device = hf_config, dtype, device
        self._attn_backend = attn_backend
        self.tp_size = current_tp_group().world_size  # layers built under use_tp_group take their rank's part
        self.kernel_request = {"native_norms": native_cpu_kernels and self.takes_native_norms,
                               "native_matmuls": native_cpu_kernels}
        self.kernels = select_kernels(dtype, device, **self.kernel_request)
        self.weights_generation = 0  # counts use_kernels: pointers into older weight forms are stale

    def attention_layers(self) -> Iterator[Attention]:
        return (m for m in self.modules() if isinstance(m, Attention))

    @property
    def attn_backend(self) -> AttentionBackend:
        return self._attn_backend

    @attn_backend.setter
    def attn_backend(self, backend: AttentionBackend) -> None:
        self._attn_backend = backend
        for attn in self.attention_layers():
            attn.backend = backend

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab] f32
        """Logits in float32 (``ParallelLMHead.compute_logits``); None off rank 0."""
        return self.lm_head.compute_logits(hidden_states)

    def use_kernels(self, kernels: KernelChoice) -> None:
        """Compute the matmuls and norms with ``kernels`` from now on (after loading: every
        weight form is derived again, and ``weights_generation`` moves on)."""
        use_linear_methods(self, kernels)
        self.set_norm_forms(kernels)
        self.kernels = kernels
        self.weights_generation += 1

    def set_norm_forms(self, kernels: KernelChoice) -> None:
        """Every RMSNorm as one LayerNorm where ``kernels`` choose that form, else ``F.rms_norm``
        (never the C kernel: a class that takes it overrides this)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.set_form("layer_norm" if kernels.final_norm_form == "layer_norm" else "torch")

    def llama_stack(self) -> LlamaStack | None:
        """The embedding, RoPE, decoder layers and final norm, for a runner that may run the
        layers itself (every layer in one C call); None (this default): only :meth:`forward` runs them."""
        return None

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this class's parameters are named (default: as is)."""
        return name

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor that names no parameter is ignored (not an error): a
        rotary cache, or ``lm_head.weight`` when the embeddings are tied."""
        return "rotary_emb" in name or (getattr(self, "tie_word_embeddings", False) and name == "lm_head.weight")

    @torch.no_grad()
    def load_weights(self, model_dir: Path | str) -> None:
        """Load the Hugging Face safetensors checkpoint (``loader.load_weights``, each tensor
        renamed by :meth:`checkpoint_name`), or the GGUF file the directory is served from
        (``gguf_loader``: Llama, Qwen2/3, Phi-3, Gemma 2/3, GPT-2, Falcon and Qwen2/3-MoE files,
        their kept formats' matrices, MoE experts included, kept quantized by the GGUF methods
        the model was built with), then derive the kernels' weight forms.

        Raises:
            FileNotFoundError: no ``*.safetensors`` in ``model_dir``.
            ValueError: a parameter is missing or has the wrong shape, the checkpoint holds
                tensors this architecture does not know, or a GGUF file's architecture is not
                served from GGUF.
        """
        restore_weights(self)
        gguf = gguf_loader.gguf_file(model_dir)
        if gguf is not None:
            native = self.kernel_request["native_matmuls"] and self.device.type == "cpu"
            gguf_loader.load_gguf_weights(self, gguf, native=native)
        else:
            loader.load_weights(self, model_dir, self.stacked_params_mapping, skip=self.skip_checkpoint_tensor,
                                rename=self.checkpoint_name)
        self.use_kernels(self.kernels)
