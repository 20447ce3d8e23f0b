"""pagedllm: PagedAttention and continuous batching, as services on NATS.

    from pagedllm import LLM, SamplingParams
    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from shared.messages import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: keeps `import pagedllm` light for the CLI
        from pagedllm.llm import LLM

        return LLM
    raise AttributeError(name)
