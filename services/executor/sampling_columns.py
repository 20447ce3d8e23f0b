"""The running requests' sampling parameters as per-row columns (the idea of vLLM V1's
``InputBatch``), written once when a request joins the batch, gathered per step by one index.

A request takes a row (:meth:`SamplingColumns.add`) when it joins the executor's batch: a new
or recomputed request, an ``n > 1`` sample forked from its parent, a beam forked from another
beam. It frees the row (:meth:`SamplingColumns.free`) when it finishes or is preempted; a freed
row is taken again by the next request that joins. Its ``SamplingParams`` are written into the
row once, at ``add``:

    floats [6, rows] float32: temperature, top_p, min_p, presence, frequency, repetition penalty
    ints [10, rows] int64: top_k (0: off), num_top (logprobs, or a beam's candidates; -1: none),
        then one 0/1 flag per processing stage: random (not greedy), penalised, biased,
        min_tokens, seeded, min_p, top_k_p (top_k on or top_p < 1 in float32), logprobs

and, per row, the Python objects a stage needs: its seeded ``torch.Generator``, its
``logit_bias`` as tensors, its ``min_tokens`` with the token ids it forbids until then. Both
tables are numpy arrays (host memory), one contiguous line per column; ``counts`` holds per
flag the rows in use that set it.

Each step, :meth:`SamplingColumns.gather` takes the rows of the requests that sample, in
their logits order: a ``StepSampling`` with their columns (one index, two row gathers; the
floats then go to the logits' device as one tensor) and which stages any of them needs. A
step in which no running request sets any flag (a greedy batch) gathers nothing. The host
side is numpy rather than torch: for a few dozen rows, its gathers, ``any`` and ``nonzero``
cost less per call than torch's on the CPU.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from shared.messages import SamplingParams

# floats columns
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
_NUM_FLOATS = 6
# ints columns: values, then the stage flags
TOP_K, NUM_TOP = 0, 1
RANDOM, PENALISED, BIASED, MIN_TOKENS, SEEDED, MIN_P_ON, TOP_K_P, LOGPROBS = range(2, 10)
_FIRST_FLAG, _NUM_INTS = RANDOM, 10
_NONE = np.zeros(0, dtype=np.int64)


class SamplingColumns:
    """Per-row sampling parameters of one executor's running requests.

    Args:
        vocab_size: the logits' width; ``logit_bias`` and ``min_tokens`` token ids at or past it
            are dropped.
        eos_token_ids: forbidden before ``min_tokens`` (unless ``ignore_eos``); their count sets a
            beam's candidates (``SamplingParams.beam_candidates``).
        device: where the per-row token id tensors live (the logits' device).
        capacity: rows allocated at first; the tables double when a request finds none free.
    """

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device,
                 capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.floats = np.zeros((_NUM_FLOATS, 0), dtype=np.float32)  # [6, rows]
        self.ints = np.zeros((_NUM_INTS, 0), dtype=np.int64)  # [10, rows]
        self.generators: list[torch.Generator | None] = []  # [rows] a seeded request's own
        self.bias: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # [rows] (ids [K] int64, biases [K] float32)
        self.min_tokens: list[tuple[int, torch.Tensor | None] | None] = []  # [rows] (min_tokens, forbidden ids [S] int64)
        self.counts = [0] * (_NUM_INTS - _FIRST_FLAG)  # rows in use per flag
        self._in_use: list[bool] = []
        self._free: list[int] = []  # a heap: the lowest free row is taken first
        self._grow(max(1, capacity))

    def __len__(self) -> int:
        """Rows in use."""
        return len(self._in_use) - len(self._free)

    def _grow(self, capacity: int) -> None:
        old = len(self._in_use)
        self.floats = np.concatenate([self.floats, np.zeros((_NUM_FLOATS, capacity - old), dtype=np.float32)], 1)
        self.ints = np.concatenate([self.ints, np.zeros((_NUM_INTS, capacity - old), dtype=np.int64)], 1)
        for extra in (self.generators, self.bias, self.min_tokens):
            extra.extend([None] * (capacity - old))
        self._in_use.extend([False] * (capacity - old))
        for row in range(old, capacity):
            heapq.heappush(self._free, row)

    def add(self, params: SamplingParams, generator: torch.Generator | None) -> int:
        """Write a joining request's ``params`` (and its seeded ``generator``, None for the
        batch's) into a free row; returns the row."""
        if not self._free:
            self._grow(2 * len(self._in_use))
        row = heapq.heappop(self._free)
        self._in_use[row] = True
        floats = self.floats[:, row]  # a view
        floats[:] = (params.temperature, params.top_p, params.min_p, params.presence_penalty,
                     params.frequency_penalty, params.repetition_penalty)  # rounded to float32 once
        top_k = params.top_k if params.top_k > 0 else 0
        num_top = params.beam_candidates(len(self.eos_token_ids)) if params.use_beam_search else params.logprobs
        flags = (not params.greedy, params.has_penalties, bool(params.logit_bias), params.min_tokens > 0,
                 generator is not None, floats[MIN_P] != 0, top_k > 0 or floats[TOP_P] < 1.0, num_top is not None)
        self.ints[:, row] = (top_k, -1 if num_top is None else num_top, *flags)
        for i, on in enumerate(flags):
            self.counts[i] += bool(on)
        self.generators[row] = generator
        if params.logit_bias:
            bias = {t: b for t, b in params.logit_bias.items() if t < self.vocab_size}
            self.bias[row] = (torch.tensor(list(bias), dtype=torch.int64, device=self.device),
                              torch.tensor(list(bias.values()), dtype=torch.float32, device=self.device))
        if params.min_tokens:
            stops = {*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)}
            ids = sorted(t for t in stops if t < self.vocab_size)
            self.min_tokens[row] = (params.min_tokens, torch.tensor(ids, device=self.device) if ids else None)
        return row

    def free(self, row: int) -> None:
        """Give back the row of a request that finished or was preempted.

        Raises:
            ValueError: ``row`` is not in use.
        """
        if not (0 <= row < len(self._in_use) and self._in_use[row]):
            raise ValueError(f"sampling row {row} is not in use")
        for i, on in enumerate(self.ints[_FIRST_FLAG:, row].tolist()):
            self.counts[i] -= on
        self._in_use[row] = False
        self.generators[row] = self.bias[row] = self.min_tokens[row] = None
        heapq.heappush(self._free, row)

    def clear(self) -> None:
        """Free every row (the executor forgets all its requests)."""
        for row, used in enumerate(self._in_use):
            if used:
                self.free(row)

    def gather(self, rows: list[int]) -> StepSampling:
        """The columns of one step's sampling rows, in the step's logits order ([N] rows)."""
        if not any(self.counts):  # no running request sets a flag: nothing to gather
            return StepSampling(self, rows, None, None, (False,) * len(self.counts))
        index = np.array(rows, dtype=np.int64)  # [N]
        ints = self.ints.take(index, axis=1)  # [10, N] int64
        floats = torch.from_numpy(self.floats.take(index, axis=1)).to(self.device)  # [6, N] float32
        return StepSampling(self, rows, ints, floats, tuple(ints[_FIRST_FLAG:].any(axis=1).tolist()))


@dataclass
class StepSampling:
    """One step's sampling rows, gathered from ``columns`` (N rows in logits order).

    ``ints`` / ``floats`` are None when ``needs`` is all False (every row greedy, nothing to
    process, no log probabilities)."""

    columns: SamplingColumns
    rows: list[int]  # [N] each logits row's row in ``columns``
    ints: np.ndarray | None  # [10, N] int64
    floats: torch.Tensor | None  # [6, N] float32, on ``columns.device``
    needs: tuple[bool, ...]  # per flag (RANDOM ... LOGPROBS): whether any row sets it

    def __len__(self) -> int:
        return len(self.rows)

    def need(self, flag: int) -> bool:
        """Whether any row of the step sets ``flag`` (``RANDOM`` ... ``LOGPROBS``)."""
        return self.needs[flag - _FIRST_FLAG]

    def where(self, flag: int) -> np.ndarray:  # [K] int64
        """The logits rows that set ``flag``, ascending."""
        if not self.need(flag):
            return _NONE
        assert self.ints is not None
        return self.ints[flag].nonzero()[0]

    def num_top(self) -> list[int | None] | None:
        """Log probability alternatives per row (``compute_logprobs``'s ``num_top``: None for
        the rows that want none), or None when no row wants any."""
        if not self.need(LOGPROBS):
            return None
        assert self.ints is not None
        return [None if k < 0 else k for k in self.ints[NUM_TOP].tolist()]
