"""vLLM's module path for the sampling parameters:
``from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams``."""

from shared.messages import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams"]
