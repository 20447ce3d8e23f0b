"""What the scheduler sends besides plans, as ``{subject: message}`` (no I/O): the new tokens
of a step, one ``DetokStep`` per detokenizer shard; the end of requests finished here without
a last output, to their shards; errors and acceptances, one ``GatewayStep`` per gateway.

A request's shard is ``detok_shard(request id)``; a sample of an n > 1 request is reported to
its gateway under the client's request id and its index, as its outputs are.
"""

from __future__ import annotations

from collections import defaultdict

from services.scheduler.request import Request
from shared import subjects as subj
from shared.messages import (
    DetokNewRequest,
    DetokStep,
    GatewayStep,
    PromptLogprobs,
    RequestDelta,
    ServiceError,
    TokenUpdate,
)

PROMPT_TAIL_TOKENS = 6  # prompt context the detokenizer needs for the first output token


class Outputs:
    """Builds the scheduler's outgoing messages for one model's subjects.

    Args:
        subjects: the model's subjects.
        num_detokenizer_shards: how many shards the requests are spread over.
    """

    def __init__(self, subjects: subj.Subjects, num_detokenizer_shards: int) -> None:
        self.subjects = subjects
        self.num_shards = num_detokenizer_shards

    def shard(self, req: Request) -> int:
        return subj.detok_shard(req.request_id, self.num_shards)

    def detok_steps(self, updated: list[Request]) -> dict[str, DetokStep]:
        """The new tokens of these requests (``pending_output_ids``, taken), per shard; a
        request's first update comes with its ``DetokNewRequest`` (sent once), which carries its
        prompt's log probabilities if it asked for them (all came: taken too)."""
        shards: dict[int, DetokStep] = defaultdict(DetokStep)
        for req in updated:
            step = shards[self.shard(req)]
            if not req.sent_to_detokenizer:
                step.new_requests.append(_new_request(req))
                req.sent_to_detokenizer, req.prompt_logprobs = True, []
            step.updates.append(
                TokenUpdate(
                    request_id=req.request_id,
                    new_token_ids=req.pending_output_ids,
                    finish_reason=req.finish_reason if req.is_finished else None,
                    stop_reason=req.stop_reason,
                    num_cached_tokens=req.num_cached_tokens,
                    logprobs=req.pending_logprobs,
                    num_output_tokens=len(req.output_token_ids),
                )
            )
            req.pending_output_ids, req.pending_logprobs = [], []
        return {self.subjects.detok(shard): step for shard, step in shards.items()}

    def released(self, reqs: list[Request]) -> dict[str, DetokStep]:
        """Requests finished here without a last output (aborted, failed), named in
        ``DetokStep.released`` to the shards they were sent to, which drop their text state
        (else it stays there for good) and send nothing (their clients heard of the end from
        the gateway or from this scheduler)."""
        shards: dict[int, DetokStep] = defaultdict(DetokStep)
        for req in reqs:
            if req.sent_to_detokenizer:
                shards[self.shard(req)].released.append(req.request_id)
        return {self.subjects.detok(shard): step for shard, step in shards.items()}

    @staticmethod
    def accepted(reqs: list[Request]) -> dict[str, GatewayStep]:
        """Tell the gateways these requests can no longer be refused (``notify_accepted``)."""
        by_gateway: dict[str, list[str]] = defaultdict(list)
        for req in reqs:
            by_gateway[req.gateway_id].append(req.request_id)
        return {subj.gateway(gateway_id): GatewayStep(accepted=ids) for gateway_id, ids in by_gateway.items()}

    @staticmethod
    def error(req: Request, error: ServiceError) -> dict[str, GatewayStep]:
        """The request's error, to its gateway."""
        delta = RequestDelta(request_id=req.parent_request_id or req.request_id, index=req.index,
                             finished=True, finish_reason="error", error=error)
        return {subj.gateway(req.gateway_id): GatewayStep(outputs=[delta])}


def _new_request(req: Request) -> DetokNewRequest:
    with_prompt_logprobs = req.needs_prompt_logprobs  # all of them came: sent once, here
    # the tokens before this first update: the prompt, and a resubmitted request's outputs
    known = req.all_token_ids[:req.num_tokens - len(req.pending_output_ids)]
    return DetokNewRequest(
        request_id=req.request_id,
        gateway_id=req.gateway_id,
        prompt_tail_ids=known[-PROMPT_TAIL_TOKENS:],
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=len(known) - req.num_prompt_tokens,
        params=req.sampling_params.detokenize_params(),
        parent_request_id=req.parent_request_id,
        index=req.index,
        prompt_logprobs=PromptLogprobs(start=1, token_ids=req.prompt_token_ids[1:],
                                       logprobs=req.prompt_logprobs) if with_prompt_logprobs else None,
        first_prompt_token_id=req.prompt_token_ids[0] if with_prompt_logprobs else None,
    )
