"""Beam search, scheduler side (no I/O): which continuations of a search's live beams survive
a step, and which finish.

A beam-search request (``SamplingParams.use_beam_search``, width ``n``) is prefilled once as
an ordinary request, its *root*. Every step after that, each live beam is one decode row of
the step (a ``Request`` of its own, ``"<id>@<k>"``), whose result carries its top
``beam_candidates`` log probabilities (``StepResult.logprobs``). When every live beam of the
search has reported, :meth:`BeamSearch.select` pools the continuations and keeps the best
``n``; the scheduler forks each survivor's block table from its parent (refcounts, with a
copy-on-write of the shared last partial block when two survivors continue one parent) and
frees the beams that died. The executor learns of the new beams from ``StepPlan.beam_forks``.

The selection is Hugging Face's ``generate(num_beams=n, do_sample=False,
early_stopping="never")`` (``transformers`` ``_beam_search``):
- the candidates are the ``beam_candidates`` best continuations of all live beams by
  cumulative log probability (``max(2, 1 + number of EOS tokens) * n``);
- a candidate ending in EOS (unless ``ignore_eos``), or any candidate of the step that reaches
  the token limit, finishes, but only if it ranks among the first ``n`` candidates; it scores
  ``cum_logprob / generated_len ** length_penalty``, where ``generated_len`` counts the
  generated tokens *including* the EOS (HF's convention; vLLM divides by the whole sequence,
  prompt included, without the EOS; at ``length_penalty=0`` all agree), and the ``n`` best
  finished hypotheses are kept;
- the first ``n`` candidates that did not finish are the next step's live beams;
- the search ends at the token limit, or once ``n`` hypotheses are finished and the best live
  beam cannot beat the worst of them any more (bounded by its length now, or by the token
  limit when ``length_penalty > 0``: HF's ``early_stopping="never"``, an exact bound).
vLLM's own beam search (a driver over single-token requests) instead finishes every EOS
candidate among each beam's top ``2n`` and stops only at the token limit; its results can
differ from these when an EOS is ranked below the first ``n`` candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.messages import FinishReason, SampleLogprobs

if TYPE_CHECKING:
    from services.scheduler.request import Request


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (EOS included), the log probabilities at each
    (the chosen token's, with the alternatives its parent saw), and its scores."""

    output_token_ids: list[int]
    logprobs: list[SampleLogprobs]
    cum_logprob: float  # natural log, the sum over its generated tokens
    score: float  # cum_logprob / len(output_token_ids) ** length_penalty
    finish_reason: FinishReason


@dataclass
class Candidate:
    """One continuation: the live beam ``parent`` followed by ``token_id``."""

    parent: Request
    token_id: int
    cum_logprob: float
    entry: SampleLogprobs  # the token's log probability, its rank among the parent's candidates, those


def score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """A beam's score: ``cum_logprob / length ** length_penalty`` (``length`` >= 1)."""
    return cum_logprob / (length ** length_penalty)


@dataclass
class BeamSearch:
    """The search state of one beam-search request (held by its root ``Request``).

    Args:
        width: beams kept per step and hypotheses returned (``SamplingParams.n``).
        length_penalty: the exponent of the length normalisation.
        ignore_eos: an EOS candidate continues like any other token.
        eos_token_ids: the tokens that finish a beam.
        num_candidates: continuations each live beam reports per step (``beam_candidates``).
    """

    width: int
    length_penalty: float
    ignore_eos: bool
    eos_token_ids: tuple[int, ...]
    num_candidates: int
    rows: list[str] = field(default_factory=list)  # the live beams' request ids, best first
    reports: dict[str, SampleLogprobs] = field(default_factory=dict)  # this step's, by beam
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most ``width``
    next_beam: int = 0  # the next beam's number: ``"<id>@<next_beam>"``

    def reset(self, root_id: str) -> None:
        """Start again from the prompt (the request was preempted or its group was lost):
        the root is the only live beam, nothing is finished."""
        self.rows = [root_id]
        self.reports.clear()
        self.finished.clear()

    def report(self, beam_id: str, logprobs: SampleLogprobs) -> bool:
        """Record a live beam's continuations; True once every live beam has reported."""
        self.reports[beam_id] = logprobs
        return all(r in self.reports for r in self.rows)

    def select(self, beams: list[Request], max_new_tokens: int) -> tuple[list[Candidate], bool]:
        """One step of the search over the reports of ``beams`` (the live beams, in
        ``rows`` order, each with ``output_token_ids`` and ``cum_logprob`` so far).

        ``max_new_tokens`` is the token limit (``max_tokens``, capped by ``max_model_len``).
        Adds the candidates that finish to ``finished``. Returns the surviving candidates, best
        first (at most ``width``), and whether the search is over (then none survive).
        """
        candidates = []
        for beam in beams:
            lp = self.reports[beam.request_id]
            for rank, (token, logprob) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
                entry = SampleLogprobs(logprob=logprob, rank=rank, top_token_ids=lp.top_token_ids,
                                       top_logprobs=lp.top_logprobs)
                candidates.append(Candidate(beam, token, beam.cum_logprob + logprob, entry))
        self.reports.clear()
        candidates.sort(key=lambda c: -c.cum_logprob)  # stable: ties keep beam order, then token rank
        candidates = candidates[: self.num_candidates]
        length = len(beams[0].output_token_ids) + 1  # generated tokens after this step
        at_limit = length >= max_new_tokens
        survivors: list[Candidate] = []
        for rank, cand in enumerate(candidates):
            eos = cand.token_id in self.eos_token_ids and not self.ignore_eos
            if eos or at_limit:
                if rank < self.width:
                    self._add_finished(cand, length, "stop" if eos else "length")
            elif len(survivors) < self.width:
                survivors.append(cand)
        if at_limit or not survivors or not self._improvable(survivors[0], length, max_new_tokens):
            return [], True
        return survivors, False

    def _add_finished(self, cand: Candidate, length: int, reason: FinishReason) -> None:
        hyp = Hypothesis(
            output_token_ids=[*cand.parent.output_token_ids, cand.token_id],
            logprobs=[*cand.parent.beam_logprobs, cand.entry],
            cum_logprob=cand.cum_logprob,
            score=score(cand.cum_logprob, length, self.length_penalty),
            finish_reason=reason,
        )
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: an earlier hypothesis wins a tie
        del self.finished[self.width:]

    def _improvable(self, best: Candidate, length: int, max_new_tokens: int) -> bool:
        """Whether the best live beam may still beat the worst of ``width`` finished
        hypotheses (always, while fewer are finished). Its cumulative log probability only
        falls; its length grows up to ``max_new_tokens``, which a positive ``length_penalty``
        rewards (HF's ``early_stopping="never"`` bound)."""
        if len(self.finished) < self.width:
            return True
        bound_length = max_new_tokens if self.length_penalty > 0 else length
        return score(best.cum_logprob, bound_length, self.length_penalty) > self.finished[-1].score
