"""The text and bytes of single tokens, for log probabilities (OpenAI's ``token`` and ``bytes``).

A token's text is what it adds to a text, special tokens included (vLLM's
``decoded_token``): the tokenizer's decoder run on the token after a plain one, so a
SentencePiece ``▁`` keeps its space (decoded alone, it is stripped); a token holding part
of a multi-byte character gives U+FFFD. Its bytes are the token's own bytes where they are
known: byte-level BPE (GPT-2's ``bytes_to_unicode`` alphabet, as in SmolLM2, Llama 3 and
Qwen) and SentencePiece byte fallback (``<0xF0>``), so the bytes of consecutive tokens
concatenate to the UTF-8 of their text even when a character is split between them;
otherwise they are the UTF-8 of the token's text.
"""

from __future__ import annotations

import re
from typing import Any

from shared.messages import DecodedLogprobs, SampleLogprobs, TokenLogprob

MAX_CACHED = 1 << 16  # token ids whose text and bytes are remembered
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


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
        self._decoder = getattr(backend, "decoder", None)  # tokenizers' Decoder, on token strings
        if type(self._decoder).__name__ == "ByteLevel":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())  # ids of added tokens
        self._cache: dict[int, tuple[str, bytes]] = {}

    def text_and_bytes(self, token_id: int) -> tuple[str, bytes]:
        """The token's text and its bytes; an id outside the vocabulary gives ("", b"")."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            out: tuple[str, bytes] = ("", b"")
        else:
            text = self._text(piece)
            byte_of = self._byte_of
            fallback = _BYTE_FALLBACK.fullmatch(piece) if byte_of is None else None
            if token_id in self._added:
                raw = text.encode("utf-8")
            elif byte_of is not None and all(c in byte_of for c in piece):
                raw = bytes(byte_of[c] for c in piece)
            elif fallback is not None:
                raw = bytes([int(fallback.group(1), 16)])
            else:
                raw = text.encode("utf-8")
            out = (text, raw)
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[token_id] = out
        return out

    def _text(self, piece: str) -> str:
        if self._decoder is not None and self._byte_of is None:
            try:  # after a plain token: a decoder that strips a leading space strips that one's
                return self._decoder.decode(["a", piece])[1:]
            except Exception:  # a decoder that cannot take this piece: as vLLM, the piece alone
                pass
        return self.tokenizer.convert_tokens_to_string([piece])

    def token(self, token_id: int, logprob: float | None, rank: int | None) -> TokenLogprob:
        text, raw = self.text_and_bytes(token_id)
        return TokenLogprob(token_id=token_id, token=text, bytes=raw, logprob=logprob, rank=rank)

    def decode(self, token_id: int, lp: SampleLogprobs) -> DecodedLogprobs:
        """The log probabilities at one sampled token ``token_id``, with each token's text."""
        return DecodedLogprobs(
            sampled=self.token(token_id, lp.logprob, lp.rank),
            top=[self.token(t, v, r) for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs,
                                                                     strict=True), start=1)],
        )
