"""The text and bytes of single tokens, for log probabilities (OpenAI's ``token`` and ``bytes``).

A token's text is ``convert_tokens_to_string`` of the token alone, special tokens included
(vLLM's ``decoded_token``); a token holding part of a multi-byte character gives U+FFFD.
Its bytes are the token's own bytes where the tokenizer is byte-level BPE (GPT-2's
``bytes_to_unicode`` alphabet, as in SmolLM2, Llama 3 and Qwen), so the bytes of consecutive
tokens concatenate to the UTF-8 of their text even when a character is split between them;
for other tokenizers they are the UTF-8 of the token's text.
"""

from __future__ import annotations

from typing import Any

from shared.messages import DecodedLogprobs, SampleLogprobs, TokenLogprob

MAX_CACHED = 1 << 16  # token ids whose text and bytes are remembered


class TokenTexts:
    """Decodes single token ids, with a cache (a shard sees the same frequent tokens again).

    Args:
        tokenizer: a Hugging Face tokenizer (``convert_ids_to_tokens``,
            ``convert_tokens_to_string``; ``backend_tokenizer`` tells a byte-level one).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_of: dict[str, int] | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())  # ids of added tokens
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        """The token's text and its bytes; an id outside the vocabulary gives ("", [])."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            out: tuple[str, list[int]] = ("", [])
        else:
            text = self.tokenizer.convert_tokens_to_string([piece])
            byte_of = self._byte_of
            if byte_of is not None and token_id not in self._added and all(c in byte_of for c in piece):
                raw = [byte_of[c] for c in piece]
            else:  # a special or added token, or not byte-level BPE
                raw = list(text.encode("utf-8"))
            out = (text, raw)
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[token_id] = out
        return out

    def token(self, token_id: int, logprob: float, rank: int) -> TokenLogprob:
        text, raw = self.text_and_bytes(token_id)
        return TokenLogprob(token_id=token_id, token=text, bytes=raw, logprob=logprob, rank=rank)

    def decode(self, token_id: int, lp: SampleLogprobs) -> DecodedLogprobs:
        """The log probabilities at one sampled token ``token_id``, with each token's text."""
        return DecodedLogprobs(
            sampled=self.token(token_id, lp.logprob, lp.rank),
            top=[self.token(t, v, r) for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs,
                                                                     strict=True), start=1)],
        )
