"""``RequestSpec``: one request as its edge (the gateway, or the offline ``LLM``) built it,
carried whole from there to the scheduler.

The gateway builds it once: ids, the checked ``SamplingParams``, priority, arrival time,
cache salt, whether it is a batch line, whether the gateway awaits its acceptance, and a
resubmitted request's outputs. The tokenizer forwards it untouched (it replaces the params
only when it caps ``max_tokens``), and the scheduler's ``Request`` holds it rather than
copying its fields. A new per-request option is one more field here, read only where it
matters.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import field

from shared.messages.common import Record, decoding
from shared.messages.sampling import SamplingParams


class RequestSpec(Record):
    """What a request asks of the engine, apart from its prompt.

    ``request_id`` is the id the engine knows it by (the gateway's id of one prompt; a
    resubmission's ``<id>~<attempt>``; the scheduler's samples ``<id>#<index>`` and beams
    ``<id>@<k>`` are specs derived by :meth:`derive`). ``gateway_id`` names the gateway whose
    subject gets its outputs. ``priority``: lower is served earlier (with the ``priority``
    scheduling policy). ``arrival_time``: unix seconds at the edge (0: the scheduler's clock
    when it arrives). ``cache_salt``: requests with different salts never share cached
    blocks. ``background``: a batch line, admitted after every interactive request and
    preempted first. ``notify_accepted``: the scheduler names it in the gateway's
    ``GatewayStep.accepted`` once queued, so that a stream's HTTP response starts only once it
    cannot be refused. ``output_token_ids``: a request resubmitted after the engine lost it
    (``EngineClient``): the output tokens its client already has, which the scheduler
    recomputes as after a preemption and which count against ``max_tokens``.
    """

    request_id: str
    gateway_id: str
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: str | None = None
    background: bool = False
    notify_accepted: bool = False
    output_token_ids: list[int] = field(default_factory=list)

    def derive(self, **changes: Any) -> RequestSpec:
        """A copy with ``changes`` (a sample's or beam's id and params, a resubmission's id and
        outputs); the params in ``changes`` are taken as already checked."""
        with decoding():
            return msgspec.structs.replace(self, **changes)
