"""How the model runner runs a step's forward pass: the model's own ``forward`` (layer by layer),
or, on CPU in bf16, every decoder layer in one C call (``layers/cpu/native_layers.py`` over
``kernels/cpu/csrc/cpu_llama_layers.c``). The model describes the math; this module chooses.

The choice is made once per step, beside the attention plan (:meth:`ForwardPass.native_rows`).
One C call runs a step when:

1. the model offers a Llama-layout decoder (``PagedCausalLM.llama_stack``) at a single rank
   (the C call has no all-reduce between layers), unquantized or from a GGUF file (not a
   checkpoint's quantization: ``QuantizationConfig.from_checkpoint``), the native GEMM serving every
   matmul (``KernelChoice.native_matmuls``), and no layer has a sliding window or q/k norms
   (the C code has neither); decided again only when the model's weight forms are derived
   again (``PagedCausalLM.weights_generation``: a reload, other kernels);
2. the layers and the step's KV caches suit the C call (``NativeLayers.applies``: panels or
   GGUF blocks on every matmul, the C norms, one dense bf16 cache shape); decided again, with
   the pointer arrays, only when the caches change (``NativeLayers.cache_key``);
3. the step has at most ``NativeLayers.max_rows`` tokens (GGUF blocks in the file's layout),
   and the attention backend's C kernel serves every row (``AttentionBackend.native_rows``,
   which builds the step's attention plan: the layers' own, had they run one by one).

Otherwise the model runs layer by layer; a one-row step then runs on torch's GEMV
(``reduced_precision_gemv``) where the model takes it (``takes_single_row_gemv``) and its
kernels allow it (``KernelChoice.single_row_gemv``).
"""

from __future__ import annotations

import torch

from kernels.cpu.attention_plan import NativeRows
from services.executor.attention import AttentionMetadata
from services.executor.layers.cpu.native_layers import KVCaches, NativeLayers
from services.executor.layers.cpu.onednn import reduced_precision_gemv
from services.executor.models.base import LlamaStack, PagedCausalLM


def all_layers_stack(model: PagedCausalLM) -> LlamaStack | None:
    """``model``'s Llama stack when its steps may run every decoder layer in one C call (1.
    above: the model's facts, not yet its weight forms' or the caches'), else None."""
    stack = model.llama_stack()
    checkpoint_quantized = model.quant_config is not None and model.quant_config.from_checkpoint  # GGUF blocks run there
    if stack is None or not model.kernels.native_matmuls or model.tp_size != 1 or checkpoint_quantized:
        return None
    attns = [layer.self_attn for layer in stack.layers]
    if any(a.attn.sliding_window for a in attns) or any(a.q_norm is not None for a in attns):
        return None
    return stack


class ForwardPass:
    """One model's forward passes as the runner runs them; it keeps, between steps, what the
    choice needs (the ``NativeLayers`` pointer arrays of the last caches seen). Call it from
    the model's thread only."""

    def __init__(self, model: PagedCausalLM) -> None:
        self.model = model
        self.native_layers: NativeLayers | None = None  # for the caches of _cache_key; None: no C call
        self._generation: int | None = None  # model.weights_generation that _stack was decided at
        self._stack: LlamaStack | None = None  # all_layers_stack(model)
        self._heads = (0, 0)  # the stack's attention heads and head_dim (this rank's)
        self._single_row_gemv = False  # one-row steps on torch's GEMV
        self._cache_key: list[tuple[int, int, torch.Size]] | None = None

    def native_rows(self, kv_caches: KVCaches, meta: AttentionMetadata) -> NativeRows | None:
        """The step's attention rows when one C call runs every decoder layer (the module's
        three conditions), else ``None``: the model's forward runs the step.

        Raises:
            ValueError: the step's block tables name a block outside the caches (the attention plan's check).
        """
        model = self.model
        if self._generation != model.weights_generation:  # loaded again, or other kernels
            self._decide()
        stack = self._stack
        if stack is None:
            return None
        key = NativeLayers.cache_key(kv_caches)
        if key != self._cache_key:
            applies = NativeLayers.applies(stack.layers, kv_caches)
            self.native_layers = NativeLayers(stack.layers, kv_caches) if applies else None
            self._cache_key = key
        layers = self.native_layers
        if layers is None or (layers.max_rows is not None and meta.num_tokens > layers.max_rows):
            return None
        return model.attn_backend.native_rows(meta, kv_caches[0][0], *self._heads, model.dtype)

    def _decide(self) -> None:
        """Decide what depends on the model alone (the module's condition 1, one-row GEMV) at
        its current weight forms; forget the pointer arrays into the previous ones."""
        model = self.model
        self._stack = stack = all_layers_stack(model)
        if stack is not None:
            attn = stack.layers[0].self_attn
            self._heads = (attn.num_heads, attn.head_dim)
        self._single_row_gemv = model.takes_single_row_gemv and model.kernels.single_row_gemv
        self.native_layers, self._cache_key = None, None
        self._generation = model.weights_generation

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                 meta: AttentionMetadata) -> torch.Tensor:
        """Run the step's forward pass the way :meth:`native_rows` decides, writing the new
        tokens' K/V into ``kv_caches``: ``input_ids`` and ``positions`` ``[T]`` int64 ->
        ``[T, hidden]`` after the final norm (the model's ``forward``'s contract).

        Raises:
            ValueError: see :meth:`native_rows` and :meth:`NativeLayers.run`.
        """
        rows = self.native_rows(kv_caches, meta)
        if rows is not None:  # every decoder layer in one C call
            stack = self._stack
            hidden = stack.embed_tokens(input_ids)  # [T, hidden]
            cos, sin = stack.rotary_emb(positions)  # [T, 1, D] each
            self.native_layers.run(hidden, cos, sin, meta.slot_mapping.long(), rows)  # in place
            return stack.norm(hidden)
        with reduced_precision_gemv(self._single_row_gemv and input_ids.shape[0] == 1):
            return self.model(input_ids, positions, kv_caches, meta)
