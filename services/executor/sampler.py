"""Token sampling: logits processing, greedy, temperature, min-p, top-k, top-p, with
per-request seeds.

Logits processing (vLLM's order and formulas): ``logit_bias``, ``min_tokens`` (EOS and stop
token ids masked), then the repetition (CTRL), frequency and presence penalties
(``apply_penalties``), then a structured output's token bitmask (the constrained rows only);
greedy rows take the argmax of the processed logits. Log probabilities
(``compute_logprobs``) are of the raw logits.

The parameters of a step's rows come as a ``StepSampling`` gathered from the executor's
``SamplingColumns`` (``sampling_columns.py``: written once per request), whose flags say which
stages any row needs; the others are skipped. :meth:`Sampler.sample` takes them as a list of
``SamplingParams`` instead.

Sampling draws ``q ~ Exponential(1)`` per vocabulary entry and takes
``argmax(probs / q)``, which samples exactly from ``probs`` (the exponential-race form of
the Gumbel-max trick, as vLLM's sampler does) and needs no CPU sync. A request with a
``seed`` draws its noise from its own ``torch.Generator``, so its samples do not depend on
what else is in the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cpu import sampling_ops
from services.executor import sampling_columns as col
from services.executor.sampling_columns import SamplingColumns, StepSampling
from shared.messages import SampleLogprobs, SamplingParams
from shared.structured_output import apply_token_bitmask


def greedy_argmax(
    logits: torch.Tensor,  # [N, V]
    chunk: int = 1024,
) -> torch.Tensor:  # [N] int64
    """``logits.argmax(dim=-1)`` (first maximum, NaN counts as maximum), faster on CPU.

    torch's CPU argmax over a long row is not vectorised; this takes the vectorised max of
    each ``chunk``-wide slice, the first slice holding the row's maximum, then the argmax
    inside that slice only (benchmarks/RESULTS.md, "Figures moved out of the code").
    """
    n, vocab = logits.shape
    if vocab % chunk or vocab <= chunk:
        return logits.argmax(dim=-1)
    slices = logits.view(n, vocab // chunk, chunk)  # [N, V / chunk, chunk]
    best = slices.amax(dim=-1).argmax(dim=-1)  # [N], the first slice holding the maximum
    rows = slices[torch.arange(n, device=logits.device), best]  # [N, chunk]
    return best * chunk + rows.argmax(dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [N, V] float32
    top_k: torch.Tensor,  # [N] int64, 0 = disabled
    top_p: torch.Tensor,  # [N] float32, 1.0 = disabled
) -> torch.Tensor:  # [N, V] float32, filtered entries set to -inf
    """Mask all but the top-k tokens, then the smallest set whose probability reaches top-p."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)  # [N, 1]
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    remove = cum_before >= top_p.unsqueeze(1)
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32, contiguous, changed in place
    prompt_ids: list[list[int]],  # [R] the prompt's token ids of each row
    output_ids: list[list[int]],  # [R] the output's token ids of each row
    presence: list[float],  # [R]
    frequency: list[float],  # [R]
    repetition: list[float],  # [R]
) -> torch.Tensor:  # [R, V] float32, the same tensor
    """vLLM's ``apply_penalties``: the repetition penalty (CTRL, Keskar et al. 2019) divides the
    positive logits and multiplies the others of every token seen in the prompt or the output;
    then ``frequency * count in the output`` and ``presence * (count > 0)`` are subtracted
    (OpenAI's formula). Token ids outside ``[0, V)`` are ignored.

    Works on the distinct (row, token) pairs only (``torch.unique`` of flat indices), so a step
    costs O(tokens seen), not O(R * V) dense count tensors.
    """
    rows, vocab = logits.shape
    dev = logits.device
    flat_logits = logits.view(-1)  # [R * V]

    def pairs(ids: list[list[int]]) -> torch.Tensor:  # [K] int64: row * V + token of every occurrence
        tokens = torch.tensor([t for r in ids for t in r], dtype=torch.int64)
        row_of = torch.repeat_interleave(torch.arange(rows), torch.tensor([len(r) for r in ids], dtype=torch.int64))
        keep = (tokens >= 0) & (tokens < vocab)
        return (row_of[keep] * vocab + tokens[keep]).to(dev)

    out_flat, out_counts = torch.unique(pairs(output_ids), return_counts=True)  # [U], [U]
    if any(r != 1 for r in repetition):
        seen = torch.unique(torch.cat([pairs(prompt_ids), out_flat]))  # [S]
        rep = torch.tensor(repetition, dtype=logits.dtype, device=dev)[seen // vocab]  # [S]
        values = flat_logits[seen]
        flat_logits[seen] = torch.where(values > 0, values / rep, values * rep)
    if any(frequency) or any(presence):
        row = out_flat // vocab
        freq = torch.tensor(frequency, dtype=logits.dtype, device=dev)[row]
        pres = torch.tensor(presence, dtype=logits.dtype, device=dev)[row]
        flat_logits[out_flat] -= freq * out_counts.to(logits.dtype) + pres
    return logits


def compute_logprobs(
    logits: torch.Tensor,  # [N, V] float32, the raw logits
    token_ids: list[int],  # [N], the sampled tokens
    num_top: list[int | None],  # [N], alternatives per row (SamplingParams.logprobs); None = skip the row
) -> list[SampleLogprobs | None]:
    """The log probabilities at each sampled token of the rows that ask for them.

    The distribution is the log-softmax of the raw logits in float32 (vLLM's default
    ``raw_logprobs``: before temperature, top-k and top-p), as ``logit - logsumexp``. A
    sampled token's rank is the number of tokens at least as likely (vLLM's
    ``batched_count_greater_than``: 1 for the most likely token, more when others tie with
    it). The top tokens come most likely first (``torch.topk``; ties in index order).

    Returns:
        One ``SampleLogprobs`` per row, None for the rows whose ``num_top`` is None.
    """
    rows = [i for i, k in enumerate(num_top) if k is not None]
    out: list[SampleLogprobs | None] = [None] * len(num_top)
    if not rows:
        return out
    dev = logits.device
    sub = (logits if len(rows) == len(num_top) else logits[torch.tensor(rows, device=dev)]).float()  # [R, V]
    lse = torch.logsumexp(sub, dim=-1, keepdim=True)  # [R, 1]: logprob = logit - lse, no [R, V] log_softmax
    sampled = torch.tensor([token_ids[i] for i in rows], device=dev).unsqueeze(1)  # [R, 1]
    sampled_logit = sub.gather(1, sampled)  # [R, 1]
    k = max(num_top[i] or 0 for i in rows)
    # one more than asked (two at least): a sampled token above the last of them has every token
    # at least as likely among them, so its rank is counted there; others count over the vocabulary
    top_logit, top_ids = sub.topk(min(max(k, 1) + 1, sub.shape[1]), dim=-1)  # [R, max(k, 1) + 1]
    ranks = (top_logit >= sampled_logit).sum(dim=-1)  # [R]
    beyond = (sampled_logit <= top_logit[:, -1:]).squeeze(1)  # [R]
    if bool(beyond.any()):
        ranks[beyond] = (sub[beyond] >= sampled_logit[beyond]).sum(dim=-1)
    sampled_list, rank_list = (sampled_logit - lse).squeeze(1).tolist(), ranks.tolist()
    top_lp_list, top_id_list = (top_logit[:, :k] - lse).tolist(), top_ids[:, :k].tolist()
    for j, i in enumerate(rows):
        n = num_top[i] or 0
        out[i] = SampleLogprobs(logprob=sampled_list[j], rank=rank_list[j],
                                top_token_ids=top_id_list[j][:n], top_logprobs=top_lp_list[j][:n])
    return out


def generator_seed(seed: int, device: torch.device) -> int:
    """The ``torch.Generator`` seed for a request's 64-bit ``seed``.

    The CPU generator (mt19937) keeps only the low 32 bits of its seed, so seeds 0 and 2**32
    would draw the same stream. Seeds in [0, 2**32) are used as they are; any other is mixed
    into 32 bits by SplitMix64's finalizer (Steele et al., 2014), so every bit of it counts.
    CUDA's Philox generator takes all 64 bits: there the seed is used as it is.
    """
    if device.type != "cpu" or 0 <= seed < 2**32:
        return seed
    z = seed % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


class Sampler:
    """Samples one token per row of a logits matrix.

    Args:
        seed: seeds the generator of requests without their own ``seed``.
        native_kernels: apply a structured output's bitmask with the C kernel
            (``kernels/cpu/sampling_ops.py``) where it applies; the runner sets it when native CPU
            kernels are on and it runs on the CPU (it loaded the library at start). Off: torch's path.
    """

    def __init__(self, seed: int, device: torch.device, eos_token_ids: tuple[int, ...] = (),
                 native_kernels: bool = False) -> None:
        self.device = device
        self.native_kernels = native_kernels
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = eos_token_ids  # forbidden before min_tokens (unless ignore_eos), in sample()

    def new_request_generator(self, seed: int | None, num_draws_done: int, vocab_size: int) -> torch.Generator | None:
        """A per-request generator for ``seed``, advanced past ``num_draws_done`` samples (a
        request recomputed after preemption continues its random stream)."""
        if seed is None:
            return None
        gen = torch.Generator(device=self.device).manual_seed(generator_seed(seed, self.device))
        for _ in range(num_draws_done):
            torch.empty(vocab_size, device=self.device).exponential_(generator=gen)
        return gen

    def process_logits(
        self,
        logits: torch.Tensor,  # [N, V] float32
        step: StepSampling,
        token_ids: list[list[int]] | None,  # [N] each row's prompt + output tokens so far
        num_prompt_tokens: list[int] | None,  # [N]
    ) -> torch.Tensor:  # [N, V] float32: ``logits`` itself when no row changes it, else a copy
        """``logit_bias``, ``min_tokens`` and the penalties of the rows that ask for them.

        Raises:
            ValueError: a row needs its tokens (``min_tokens``, penalties) and none were given.
        """
        biased, held, penalised = (step.where(f).tolist() for f in (col.BIASED, col.MIN_TOKENS, col.PENALISED))
        if not (biased or held or penalised):
            return logits
        if (held or penalised) and (token_ids is None or num_prompt_tokens is None):
            raise ValueError("min_tokens and penalties need each row's token_ids and num_prompt_tokens")
        columns, rows = step.columns, step.rows
        held_rows = []  # the rows still short of min_tokens, with the token ids they forbid
        for i in held:
            min_tokens, stops = columns.min_tokens[rows[i]]  # type: ignore[misc]
            if stops is not None and len(token_ids[i]) - num_prompt_tokens[i] < min_tokens:  # type: ignore[index]
                held_rows.append((i, stops))
        if not (biased or held_rows or penalised):
            return logits
        logits = logits.clone()
        for i in biased:
            ids, bias = columns.bias[rows[i]]  # type: ignore[misc]
            logits[i, ids] += bias
        for i, stops in held_rows:
            logits[i, stops] = float("-inf")
        if penalised:
            index = torch.tensor(penalised, device=logits.device)
            sub = logits.index_select(0, index)  # [R, V]
            # [3, R]: the presence, frequency and repetition penalties (float32 values) of those rows
            presence, frequency, repetition = columns.floats[col.PRESENCE:col.REPETITION + 1,
                                                             [rows[i] for i in penalised]].tolist()
            apply_penalties(
                sub,
                [token_ids[i][: num_prompt_tokens[i]] for i in penalised],  # type: ignore[index]
                [token_ids[i][num_prompt_tokens[i]:] for i in penalised],  # type: ignore[index]
                presence, frequency, repetition,
            )
            logits[index] = sub
        return logits

    def sample(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        token_ids: list[list[int]] | None = None,  # [N] each row's prompt + output tokens so far
        num_prompt_tokens: list[int] | None = None,  # [N]
        bitmask: tuple[torch.Tensor, list[int]] | None = None,  # (int32 [R, ceil(V / 32)], their R rows)
    ) -> list[int]:
        """:meth:`sample_rows` for rows given as their params and generators (written into
        columns of their own, rows ``0 .. N - 1``).

        Raises:
            ValueError: as :meth:`sample_rows`; ``params`` and ``generators`` differ in length.
        """
        columns = SamplingColumns(logits.shape[1], self.eos_token_ids, logits.device, len(params))
        rows = [columns.add(p, g) for p, g in zip(params, generators, strict=True)]
        return self.sample_rows(logits, columns.gather(rows), token_ids, num_prompt_tokens, bitmask)

    def sample_rows(
        self,
        logits: torch.Tensor,  # [N, V] float32
        step: StepSampling,  # the N rows' sampling columns
        token_ids: list[list[int]] | None = None,  # [N] each row's prompt + output tokens so far
        num_prompt_tokens: list[int] | None = None,  # [N]
        bitmask: tuple[torch.Tensor, list[int]] | None = None,  # (int32 [R, ceil(V / 32)], their R rows)
    ) -> list[int]:
        """One token id per row (``logits`` is left as it is).

        ``bitmask``: the structured-output rows' allowed tokens
        (``shared/structured_output.py``), applied to those rows only, after the logits
        processing and before the temperature.

        Raises:
            ValueError: a row needs its tokens (``min_tokens``, penalties) and none were given.
        """
        processed = self.process_logits(logits, step, token_ids, num_prompt_tokens)
        if bitmask is not None:
            if processed is logits:  # the raw logits stay for the log probabilities
                processed = logits.clone()
            if not (self.native_kernels and sampling_ops.apply_token_bitmask(processed, *bitmask)):
                apply_token_bitmask(processed, *bitmask)  # torch's (xgrammar's) path
        logits = processed
        random_rows = step.where(col.RANDOM)  # [R]
        if not len(random_rows):
            return greedy_argmax(logits).tolist()
        assert step.ints is not None and step.floats is not None  # gathered: a row sets RANDOM
        if len(random_rows) == len(step):  # no greedy row
            return self._sample_random(logits, step, random_rows, step.ints, step.floats).tolist()
        greedy = greedy_argmax(logits)  # [N]
        index = torch.from_numpy(random_rows).to(logits.device)  # [R]
        greedy[index] = self._sample_random(logits.index_select(0, index), step, random_rows,
                                            step.ints.take(random_rows, axis=1), step.floats.index_select(1, index))
        return greedy.tolist()

    def _sample_random(
        self,
        logits: torch.Tensor,  # [R, V] float32, the processed logits of the random rows
        step: StepSampling,
        random_rows: np.ndarray,  # [R] int64, their rows in the step
        ints: np.ndarray,  # [10, R] int64, their int columns
        floats: torch.Tensor,  # [6, R] float32, their float columns
    ) -> torch.Tensor:  # [R] int64
        """Temperature, min-p, top-k and top-p, then the exponential race (the batch's
        generator for every row, then each seeded row's own, in row order)."""
        sub = logits / floats[col.TEMPERATURE].unsqueeze(1)
        if step.need(col.MIN_P_ON) and ints[col.MIN_P_ON].any():  # vLLM: after the temperature
            probs = sub.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * floats[col.MIN_P].unsqueeze(1)
            sub = sub.masked_fill(probs < threshold, float("-inf"))
        if step.need(col.TOP_K_P) and ints[col.TOP_K_P].any():
            top_k = torch.from_numpy(ints[col.TOP_K]).to(logits.device)  # [R] int64
            sub = apply_top_k_top_p(sub, top_k, floats[col.TOP_P])
        probs = sub.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        if step.need(col.SEEDED):  # seeded: its own stream, whatever the batch
            for j in ints[col.SEEDED].nonzero()[0].tolist():
                q[j].exponential_(generator=step.columns.generators[step.rows[random_rows[j]]])
        return greedy_argmax(probs / q)
