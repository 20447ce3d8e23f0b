"""Token sampling: logits processing, greedy, temperature, min-p, top-k, top-p, with
per-request seeds.

Logits processing (vLLM's order and formulas): ``logit_bias``, ``min_tokens`` (EOS and stop
token ids masked), then the repetition (CTRL), frequency and presence penalties
(``apply_penalties``), then a structured output's token bitmask (the constrained rows only);
greedy rows take the argmax of the processed logits. Log probabilities
(``compute_logprobs``) are of the raw logits.

Sampling draws ``q ~ Exponential(1)`` per vocabulary entry and takes
``argmax(probs / q)``, which samples exactly from ``probs`` (the exponential-race form of
the Gumbel-max trick, as vLLM's sampler does) and needs no CPU sync. A request with a
``seed`` draws its noise from its own ``torch.Generator``, so its samples do not depend on
what else is in the batch.
"""

from __future__ import annotations

import torch

from kernels.cpu import sampling_ops
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
        self.eos_token_ids = eos_token_ids  # forbidden before min_tokens (unless ignore_eos)
        self._bias_cache: dict[int, tuple[SamplingParams, torch.Tensor, torch.Tensor]] = {}

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
        params: list[SamplingParams],
        token_ids: list[list[int]] | None,  # [N] each row's prompt + output tokens so far
        num_prompt_tokens: list[int] | None,  # [N]
    ) -> torch.Tensor:  # [N, V] float32: ``logits`` itself when no row changes it, else a copy
        """``logit_bias``, ``min_tokens`` and the penalties of the rows that ask for them.

        Raises:
            ValueError: a row needs its tokens (``min_tokens``, penalties) and none were given.
        """
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        held = [i for i, p in enumerate(params) if p.min_tokens]
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if not (biased or held or penalised):
            return logits
        if (held or penalised) and (token_ids is None or num_prompt_tokens is None):
            raise ValueError("min_tokens and penalties need each row's token_ids and num_prompt_tokens")
        held = [i for i in held  # only the rows still short of min_tokens
                if len(token_ids[i]) - num_prompt_tokens[i] < params[i].min_tokens]  # type: ignore[index]
        if not (biased or held or penalised):
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in biased:
            ids, bias = self._bias_tensors(params[i], vocab, logits.device)
            logits[i, ids] += bias
        for i in held:
            p = params[i]
            stops = {*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)}
            ids = [t for t in stops if t < vocab]
            if ids:
                logits[i, torch.tensor(ids, device=logits.device)] = float("-inf")
        if penalised:
            rows = torch.tensor(penalised, device=logits.device)
            sub = logits[rows]
            apply_penalties(
                sub,
                [token_ids[i][: num_prompt_tokens[i]] for i in penalised],  # type: ignore[index]
                [token_ids[i][num_prompt_tokens[i]:] for i in penalised],  # type: ignore[index]
                [params[i].presence_penalty for i in penalised],
                [params[i].frequency_penalty for i in penalised],
                [params[i].repetition_penalty for i in penalised],
            )
            logits[rows] = sub
        return logits

    def _bias_tensors(self, params: SamplingParams, vocab: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's ``logit_bias`` as (token ids [K] int64, biases [K] float32), built once
        per params object (a running request keeps its params; ids past ``vocab`` dropped)."""
        hit = self._bias_cache.get(id(params))
        if hit is not None and hit[0] is params:
            return hit[1], hit[2]
        bias = {t: b for t, b in params.logit_bias.items() if t < vocab}
        ids = torch.tensor(list(bias), dtype=torch.int64, device=device)
        values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        if len(self._bias_cache) >= 1024:
            self._bias_cache.clear()
        self._bias_cache[id(params)] = (params, ids, values)
        return ids, values

    def sample(
        self,
        logits: torch.Tensor,  # [N, V] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
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
        processed = self.process_logits(logits, params, token_ids, num_prompt_tokens)
        if bitmask is not None:
            if processed is logits:  # the raw logits stay for the log probabilities
                processed = logits.clone()
            if not (self.native_kernels and sampling_ops.apply_token_bitmask(processed, *bitmask)):
                apply_token_bitmask(processed, *bitmask)  # torch's (xgrammar's) path
        logits = processed
        greedy = greedy_argmax(logits)  # [N]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return greedy.tolist()
        rows = torch.tensor(random_rows, device=logits.device)
        sub = logits[rows]  # [R, V]
        temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        sub = sub / temps.unsqueeze(1)
        min_p = [params[i].min_p for i in random_rows]
        if any(min_p):  # vLLM: after the temperature, before top-k and top-p
            probs = sub.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=logits.device).unsqueeze(1)
            sub = sub.masked_fill(probs < threshold, float("-inf"))
        top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else 0 for i in random_rows])
        top_p = torch.tensor([params[i].top_p for i in random_rows], dtype=torch.float32)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            sub = apply_top_k_top_p(sub, top_k.to(logits.device), top_p.to(logits.device))
        probs = sub.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, i in enumerate(random_rows):
            if generators[i] is not None:  # seeded: its own stream, whatever the batch
                q[j].exponential_(generator=generators[i])
        sampled = greedy_argmax(probs / q)
        out = greedy.clone()
        out[rows] = sampled
        return out.tolist()
