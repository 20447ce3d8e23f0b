"""The vocabulary embedding and the LM head (vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead``),
and learned absolute position embeddings (``LearnedPositionEmbedding``).

Both hold a ``weight`` ``[vocab, hidden]`` created by a linear method (rows = vocabulary
entries), so the storage choices of ``layers/selection.py`` apply to them as to any linear
layer; with tied embeddings the LM head's ``weight`` is the embedding's parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from services.executor.layers.utils import (
    FastModule,
    copy_checked,
    default_weight_loader,
    narrow_checked,
    set_weight_attrs,
)
from services.executor.parallel.group import current_tp_group
from services.executor.parallel.partition import balanced_range


class VocabParallelEmbedding(FastModule):
    """Token id -> hidden vector: ``weight[ids]``. ``weight`` is this rank's vocabulary rows
    ``[vocab_start, vocab_start + num_embeddings_per_partition)``, ``[num_embeddings_per_partition, hidden]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 quant_method: LinearMethodBase | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp = current_tp_group()
        self.tp_size = self.tp.world_size
        self.vocab_sizes = [balanced_range(num_embeddings, self.tp_size, r)[1] for r in range(self.tp_size)]
        self.vocab_start, self.num_embeddings_per_partition = balanced_range(num_embeddings, self.tp_size, self.tp.rank)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, embedding_dim, [self.num_embeddings_per_partition],
                                         params_dtype or torch.get_default_dtype(), bias=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | int | None = None) -> None:
        """This rank's rows of the ``[vocab, hidden]`` table (ValueError on a shape mismatch)."""
        copy_checked(param.data, narrow_checked(loaded_weight, 0, self.vocab_start, self.num_embeddings_per_partition,
                                                self.num_embeddings))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        if self.tp_size == 1:
            return self.quant_method.embed(self, input_ids)
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = self.quant_method.embed(self, local.masked_fill(outside, 0))  # [T, hidden]
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the vocabulary (vLLM's ``ParallelLMHead`` with its
    ``LogitsProcessor``): :meth:`compute_logits`."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        """Share the embedding's table (``tie_word_embeddings``), and its method where that holds
        the table quantized (a GGUF file's blocks: one method reads them for both)."""
        self.weight = embed_tokens.weight
        if embed_tokens.quant_method.quantized:
            self.quant_method = embed_tokens.quant_method

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab] f32
        """Logits in float32. The matmul runs in the weight's dtype, as in HF; in bf16/fp16 the
        few best logits of each row are then recomputed with a float32 result
        (:func:`refine_top_logits`). A method that returns float32 logits directly (the native
        bf16-weight GEMM) leaves no bf16 rounding to refine. Under tensor parallelism each rank
        computes (and refines) its vocabulary range and rank 0 gathers them: the other ranks
        return ``None``."""
        logits = self.quant_method.apply_logits(self, hidden_states)
        if logits.dtype != torch.float32:
            logits = logits.float()
            refine_top_logits(logits, hidden_states, self.weight)
        return self.tp.gather_last_dim(logits, self.vocab_sizes)


def refine_top_logits(
    logits: torch.Tensor,  # [N, V] float32, upcast from a bf16/fp16 matmul (modified in place)
    hidden: torch.Tensor,  # [N, hidden] bf16/fp16, the matmul's input
    weight: torch.Tensor,  # [V, hidden] bf16/fp16, the matmul's weight
    num: int = 4,
    chunk: int = 1024,
) -> None:
    """Recompute the ``num`` best logits of each row with a float32 result (in place).

    A bf16 matmul accumulates in float32 but rounds its output to 8 significant bits: around
    20 neighbouring logits are 0.125 apart, so the top two often tie (or swap) through that
    last rounding alone, and greedy decoding then follows the rounding (SmolLM2's answer to
    "What is the capital of France?" starts "The" in float32, 25.33 against 25.24, and "L'"
    when both round to 25.25). The dot products of the same bf16 hidden state and weight rows
    in float32 remove that error for the candidates that matter. Candidates: the ``num`` best
    of the row's two best ``chunk``-wide slices (they hold the row's two best logits; found
    with vectorised maxima, as torch's CPU ``topk`` over a long row is slow).
    """
    n, vocab = logits.shape
    if vocab % chunk or vocab < 2 * chunk:
        ids = logits.topk(min(num, vocab), dim=-1).indices  # [N, num]
    else:
        slices = logits.view(n, vocab // chunk, chunk)  # [N, V / chunk, chunk]
        best = slices.amax(dim=-1).topk(2, dim=-1).indices  # [N, 2] the two best slices
        rows = torch.arange(n, device=logits.device).unsqueeze(1)  # [N, 1]
        cand = slices[rows, best].reshape(n, 2 * chunk).topk(num, dim=-1).indices  # [N, num]
        ids = best.gather(1, cand // chunk) * chunk + cand % chunk  # [N, num] vocabulary ids
    rows_w = weight[ids.flatten()].view(n, ids.shape[1], -1).float()  # [N, num, hidden]
    exact = torch.bmm(rows_w, hidden.float().unsqueeze(2)).squeeze(2)  # [N, num] float32
    logits.scatter_(1, ids, exact)


class LearnedPositionEmbedding(FastModule):
    """Absolute learned position embeddings (GPT-2's ``wpe``, OPT's ``embed_positions``):
    ``weight[positions + offset]``, the whole table on every rank (it is small).

    ``offset``: the rows before position 0 (OPT's ``OPTLearnedPositionalEmbedding`` keeps 2,
    a relic of fairseq's padding positions); ``weight`` is ``[num_positions + offset, hidden]``.
    """

    def __init__(self, num_positions: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, embedding_dim, dtype=params_dtype),
                                   requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)
