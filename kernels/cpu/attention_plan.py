"""The torch backend's per-step plan: which rows go to which attention path, with their indices.

:func:`build_plan` classifies the step's sequences once per forward pass (from the host-side
lengths) into the C kernel's rows (:class:`NativeRows`), one decode group
(:class:`DecodeGroup`), prefill groups of similar length (:class:`PrefillGroup`) and prefill
chunks over cached context (:class:`ChunkSeq`), and precomputes every index tensor and mask;
:func:`kernels.cpu.torch_attention.paged_attention` runs each layer on it. Layouts as in
:mod:`kernels.cpu.torch_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# With the native kernel, prefills and chunks of at most this many new tokens run in it too
# (each row reads its causal prefix: O(q_len ** 2) row visits, where SDPA's flash kernel
# blocks the work): faster up to about this length, even at 3,000 tokens (benchmarks/RESULTS.md, "Figures moved out of the code").
NATIVE_MAX_QUERY_LEN = 2048
# Short prefills are right-padded into batches of similar length: a prefill joins a batch
# only if its length is at least this fraction of the batch's longest one (padding wastes at
# most 1 / fraction ** 2 of the batch's attention work). Prompts longer than
# PREFILL_BATCH_MAX_LEN run alone (their SDPA call is large enough on its own). Padding halves
# the time of many short prompts and costs nothing for longer ones (benchmarks/RESULTS.md, "Figures moved out of the code").
PREFILL_PAD_MIN_FRACTION = 0.8
PREFILL_BATCH_MAX_LEN = 128


@dataclass
class DecodeGroup:
    """All single-token sequences of a step, attended in one batched call."""

    rows: slice | torch.Tensor  # token rows of the decode queries: a slice, or [Bd] int64
    block_index: torch.Tensor  # [Bd * nblk] int64, cache blocks of each sequence (padding: 0)
    valid: torch.Tensor | None  # [Bd, 1, 1, nblk * block_size] bool (True = attend); None = all
    num_seqs: int  # Bd
    num_blocks: int  # nblk, blocks of the longest sequence
    max_len: int  # S, the longest decode sequence in tokens


@dataclass
class PrefillGroup:
    """Prefills (no cached context) of similar lengths, right-padded into one SDPA batch."""

    starts: list[int]  # first token row of each sequence
    lens: list[int]  # tokens of each sequence
    max_len: int  # L, the padded length
    pad_index: torch.Tensor | None  # [Bp * L] int64 token row of each padded position; None: Bp == 1
    rows: torch.Tensor | None  # [Tg] int64 token rows of the group's tokens
    unpad_index: torch.Tensor | None  # [Tg] int64 padded position of each of ``rows``


@dataclass
class ChunkSeq:
    """One prefill chunk that attends over cached context plus its own new tokens."""

    start: int  # first token row of the chunk
    end: int  # one past the last token row
    block_index: torch.Tensor  # [nblk] int64, the sequence's cache blocks
    seq_len: int  # S, cached context + new tokens
    mask: torch.Tensor  # [Q, S] bool, offset causal mask (True = attend)


@dataclass
class NativeRows:
    """Token rows handled by the native C kernel (``kernels.cpu.ops.paged_attention_rows``)."""

    rows: torch.Tensor | None  # [Tn] int64 token rows; None = every row, in order
    row_seq: torch.Tensor  # [Tn] int64, each row's sequence (row of block_index)
    row_len: torch.Tensor  # [Tn] int64, positions each row attends (causal)
    block_index: torch.Tensor  # [Sn * nblk] int64 cache blocks of the sequences (padding: 0)
    num_blocks: int  # nblk


@dataclass
class TorchAttentionPlan:
    """Per-forward index tensors of the torch backend, built once and shared by all layers."""

    num_kv_heads: int
    block_size: int
    num_tokens: int  # T
    write_slots: torch.Tensor  # [T'] int64, cache slots of the tokens whose K/V are written
    write_rows: torch.Tensor | None  # [T'] int64 token rows of those slots; None = all rows
    decode: DecodeGroup | None = None
    prefills: list[PrefillGroup] = field(default_factory=list)
    chunks: list[ChunkSeq] = field(default_factory=list)
    native: NativeRows | None = None
    scratch: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # gather buffers

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor reused by every layer of this forward pass (contents undefined)."""
        buf = self.scratch.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype:
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.scratch[name] = buf
        return buf


def _block_index(
    block_tables: torch.Tensor,  # [N, max_blocks] int32/int64, physical block ids
    lens: list[int],  # [N] tokens per row
    num_blocks: int,  # nblk, columns to take
    block_size: int,
) -> torch.Tensor:  # [N * nblk] int64
    """Block ids of each row's first ``nblk`` blocks; columns past a row's length read block 0
    (masked out), so padding entries of the block table are never dereferenced."""
    table = block_tables[:, :num_blocks].long()  # [N, nblk]
    if min(lens) < num_blocks * block_size - block_size + 1:  # some row needs fewer blocks
        used = torch.tensor([-(-n // block_size) for n in lens], device=table.device)  # [N]
        cols = torch.arange(num_blocks, device=table.device)  # [nblk]
        table = torch.where(cols.unsqueeze(0) < used.unsqueeze(1), table, torch.zeros_like(table))
    return table.reshape(-1)


def _prefill_groups(
    seqs: list[tuple[int, int]],  # (start row, length) of each prefill
    num_tokens: int,
    device: torch.device,
) -> list[PrefillGroup]:
    """Group prefills of similar length (longest first) and build their padding indices."""
    order = sorted(seqs, key=lambda s: -s[1])
    groups: list[list[tuple[int, int]]] = []
    for start, n in order:
        longest = groups[-1][0][1] if groups else 0
        if longest and longest <= PREFILL_BATCH_MAX_LEN and n >= PREFILL_PAD_MIN_FRACTION * longest:
            groups[-1].append((start, n))
        else:
            groups.append([(start, n)])
    out = []
    for members in groups:
        members.sort()  # token order, so a lone group covering every row needs no reordering
        starts, lens = [s for s, _ in members], [n for _, n in members]
        max_len = max(lens)
        if len(members) == 1:
            out.append(PrefillGroup(starts, lens, max_len, None, None, None))
            continue
        start_t = torch.tensor(starts, dtype=torch.int64, device=device).unsqueeze(1)  # [Bp, 1]
        len_t = torch.tensor(lens, dtype=torch.int64, device=device).unsqueeze(1)
        pos = torch.arange(max_len, device=device).unsqueeze(0)  # [1, L]
        valid = pos < len_t  # [Bp, L]
        token_rows = start_t + pos  # [Bp, L]
        pad_index = torch.where(valid, token_rows, start_t).reshape(-1)  # [Bp * L]
        padded_pos = torch.arange(len(members) * max_len, device=device).view(len(members), max_len)
        rows = token_rows[valid]  # [Tg]
        unpad_index = padded_pos[valid]  # [Tg]
        out.append(PrefillGroup(starts, lens, max_len, pad_index, rows, unpad_index))
    return out


def _native_rows(
    seqs: list[tuple[int, int, int, int]],  # (b, start row, q_len, seq_len)
    num_tokens: int,
    block_tables: torch.Tensor,  # [B, max_blocks]
    block_size: int,
) -> NativeRows:
    """Row indices and causal lengths of the native kernel's sequences."""
    device = block_tables.device
    rows: list[int] = []
    row_seq: list[int] = []
    row_len: list[int] = []
    for i, (_, start, q_len, seq_len) in enumerate(seqs):
        ctx = seq_len - q_len
        rows.extend(range(start, start + q_len))
        row_seq.extend([i] * q_len)
        row_len.extend(range(ctx + 1, seq_len + 1))
    lens = [seq_len for _, _, _, seq_len in seqs]
    nblk = -(-max(lens) // block_size)
    tables = block_tables
    if len(seqs) != block_tables.shape[0]:
        tables = block_tables.index_select(0, torch.tensor([b for b, *_ in seqs], dtype=torch.int64, device=device))
    every_row = len(rows) == num_tokens and rows == list(range(num_tokens))
    return NativeRows(
        rows=None if every_row else torch.tensor(rows, dtype=torch.int64, device=device),
        row_seq=torch.tensor(row_seq, dtype=torch.int64, device=device),
        row_len=torch.tensor(row_len, dtype=torch.int64, device=device),
        block_index=_block_index(tables, lens, nblk, block_size),
        num_blocks=nblk,
    )


def build_plan(
    query_lens: list[int],  # [B] new tokens per sequence
    seq_lens: list[int],  # [B] cached context + new tokens per sequence
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    slot_mapping: torch.Tensor,  # [T] int64; negative = do not write this token
    block_size: int,
    num_kv_heads: int,
    native: bool = False,
) -> TorchAttentionPlan:
    """Classify the sequences (decode / prefill / chunk) and precompute every index tensor.

    ``native``: decodes and prefills / chunks of at most ``NATIVE_MAX_QUERY_LEN`` tokens go to
    the C kernel (:class:`NativeRows`; the caller checks :func:`kernels.cpu.ops.supports`).
    """
    device = block_tables.device
    num_tokens = int(slot_mapping.shape[0])
    if num_tokens and bool((slot_mapping < 0).any()):
        write_rows = torch.nonzero(slot_mapping >= 0).flatten()  # [T'] int64
        write_slots = slot_mapping.index_select(0, write_rows).long()
    else:
        write_rows, write_slots = None, slot_mapping.long()
    plan = TorchAttentionPlan(num_kv_heads, block_size, num_tokens, write_slots, write_rows)

    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    prefills: list[tuple[int, int]] = []
    start = 0
    native_seqs: list[tuple[int, int, int, int]] = []  # (b, start row, q_len, seq_len)
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if native and 0 < q_len <= NATIVE_MAX_QUERY_LEN:
            native_seqs.append((b, start, q_len, seq_len))
        elif q_len == 1:
            decode_seqs.append(b)
            decode_rows.append(start)
        elif q_len > 1 and q_len == seq_len:
            prefills.append((start, q_len))
        elif q_len > 1:
            nblk = -(-seq_len // block_size)
            k_pos = torch.arange(seq_len, device=device)  # [S]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)  # [Q]
            mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [Q, S]
            index = block_tables[b, :nblk].long()  # [nblk]
            plan.chunks.append(ChunkSeq(start, start + q_len, index, seq_len, mask))
        start += q_len
    if prefills:
        plan.prefills = _prefill_groups(prefills, num_tokens, device)
    if native_seqs:
        plan.native = _native_rows(native_seqs, num_tokens, block_tables, block_size)

    if decode_seqs:
        bd = len(decode_seqs)
        lens = [seq_lens[b] for b in decode_seqs]
        max_len = max(lens)
        nblk = -(-max_len // block_size)
        if decode_rows == list(range(decode_rows[0], decode_rows[0] + bd)):
            rows: slice | torch.Tensor = slice(decode_rows[0], decode_rows[0] + bd)
        else:
            rows = torch.tensor(decode_rows, dtype=torch.int64, device=device)
        tables = block_tables
        if bd != block_tables.shape[0]:
            tables = block_tables.index_select(0, torch.tensor(decode_seqs, dtype=torch.int64, device=device))
        index = _block_index(tables, lens, nblk, block_size)
        valid = None
        if min(lens) != nblk * block_size:
            pos = torch.arange(nblk * block_size, device=device)  # [S']
            lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
            valid = (pos.unsqueeze(0) < lens_t.unsqueeze(1))[:, None, None, :]  # [Bd, 1, 1, S']
        plan.decode = DecodeGroup(rows, index, valid, bd, nblk, max_len)
    return plan
