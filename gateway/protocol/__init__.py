"""OpenAI-compatible request and response shapes: the subset pagedllm serves.

Field names and defaults follow the OpenAI API reference and vLLM's OpenAI server
(``top_k``, ``priority``, ``stop_token_ids``, ``ignore_eos`` ... are vLLM extensions).

- ``base``: ``OpenAIRequest``, what every request body is checked for (integers that fit
  int64, the OpenAI / vLLM fields this server does not implement);
- ``sampling``: the fields both request bodies share, and the ``SamplingParams`` they become;
- ``requests``: the bodies of ``/v1/completions`` and ``/v1/chat/completions``;
- ``responses``: the responses, streaming chunks, log probabilities, usage and model cards.
"""
