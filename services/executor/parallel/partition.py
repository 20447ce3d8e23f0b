"""How a tensor-parallel group splits a model: contiguous, balanced ranges per rank.

Pure functions of the sizes, the same on every rank, so each rank knows every rank's share
without talking to it. Attention is split by whole KV groups (every query head stays on the
rank of the KV head it reads, so each rank runs plain GQA on its own heads and caches only its
own KV heads):

- at least as many KV heads as ranks: each rank takes a contiguous range of KV heads (sizes
  differ by at most one: SmolLM2's 3 KV heads over 2 ranks are 2 + 1) with their query heads;
- fewer KV heads than ranks (vLLM's rule): each KV head is *replicated* on ``tp / Hkv`` ranks,
  which split its query heads evenly (needs ``tp % Hkv == 0`` and that many ranks to divide the
  group's query heads; otherwise a ValueError names the numbers).

The MLP's intermediate size and the vocabulary split into balanced ranges as well; a
row-parallel layer takes the input columns that match its column-parallel producer.
"""

from __future__ import annotations

from dataclasses import dataclass


def balanced_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` when ``total`` items split into ``parts`` contiguous
    ranges whose sizes differ by at most one (the first ``total % parts`` are one larger).

    Raises:
        ValueError: ``index`` outside ``range(parts)``, or ``parts`` < 1.
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} does not exist")
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads of one rank: query heads ``[q_start, q_start + num_heads)`` and KV
    heads ``[kv_start, kv_start + num_kv_heads)`` of the model's; ``kv_replicas`` ranks hold
    each of these KV heads (1: not replicated)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int
    kv_replicas: int = 1


def attention_heads(total_heads: int, total_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """The heads of rank ``tp_rank`` of ``tp_size`` (see the module's docstring).

    Raises:
        ValueError: the heads cannot be split: more ranks than KV heads where ``tp_size`` is
            not a multiple of the KV heads or a KV head's query heads do not divide over its
            ranks (the message names the numbers), or query heads that are not a multiple of
            the KV heads.
    """
    if total_heads % total_kv_heads:
        raise ValueError(f"{total_heads} attention heads are not a multiple of {total_kv_heads} KV heads")
    group = total_heads // total_kv_heads
    if total_kv_heads >= tp_size:
        kv_start, num_kv = balanced_range(total_kv_heads, tp_size, tp_rank)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    replicas, rest = divmod(tp_size, total_kv_heads)
    if rest or group % replicas:
        raise ValueError(
            f"tensor_parallel_size={tp_size} cannot split {total_heads} attention heads with "
            f"{total_kv_heads} KV heads: with fewer KV heads than ranks, each KV head is replicated on "
            f"tensor_parallel_size / {total_kv_heads} ranks, so tensor_parallel_size must be a multiple of "
            f"{total_kv_heads} and divide each KV head's {group} query heads among those ranks "
            f"(choose tensor_parallel_size <= {total_kv_heads}, or one of "
            f"{[total_kv_heads * r for r in range(1, group + 1) if group % r == 0]})")
    kv = tp_rank // replicas
    per_rank = group // replicas
    return HeadShard(kv * group + (tp_rank % replicas) * per_rank, per_rank, kv, 1, replicas)
