"""Incremental detokenization of one request, with stop strings.

Two layers, each with explicit, bounded state:

1. **Token ids -> text** (vLLM's ``detokenize_incrementally``, SGLang's
   ``surr_offset``/``read_offset``). ``_ids`` holds a short window of token ids;
   ``_ids[prefix_offset:read_offset]`` were already turned into text and serve as context,
   ``_ids[read_offset:]`` are not yet emitted. Each step decodes the window with and without
   the new tokens and emits the difference. Decoding a window instead of single tokens keeps
   the spaces right (SentencePiece's ``▁`` is only dropped at the start of a decode, and
   the window starts with context) and lets multi-byte UTF-8 characters that are split
   over byte tokens come out whole: while the decoded text ends with U+FFFD the new tokens
   are held back. Because every decode is ``tokenizer.decode`` itself, the concatenated
   deltas equal ``tokenizer.decode(output_ids)`` (for SentencePiece tokenizers, the text as a
   continuation of the prompt, so a leading ``▁`` of the first output token is a space).

2. **Stop strings.** Text that could still be the start of a stop string (the longest
   suffix of the unemitted text that is a prefix of some stop string) is held back; the
   search window keeps ``len(longest stop) - 1`` chars of already seen text so a stop string
   spanning deltas and token boundaries is found. Of several matches the one completed
   first in the stream wins (earliest end; on a tie the earliest start), which is what a
   token-by-token stream sees regardless of how tokens are batched.

We do not use ``tokenizers.decoders.DecodeStream``: it cannot flush an incomplete UTF-8
tail at the end of a request (so its output can differ from ``decode``), and it needs the
backend tokenizer, where this class works with any Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 6  # prompt tokens kept as context for the first output token
MAX_HELD_TOKENS = 64  # give up waiting for a UTF-8 character after this many tokens (garbage)
_TRIM_AT = 64  # drop ids before prefix_offset once this many have piled up


class Decoder(Protocol):
    """What is needed of a tokenizer: Hugging Face's ``decode``."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, and finds its stop strings.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=)``).
        prompt_tail_ids: the last prompt tokens, decoded as context only (never emitted);
            at most ``CONTEXT_TOKENS`` are kept.
        skip_special_tokens: passed to ``tokenizer.decode``.
        stop: stop strings; the request ends right before the first one that appears.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        min_tokens: stop strings are only looked for once the output has more tokens than
            this (vLLM): a match must end in the text of a later token.

    After a call, ``stop_matched`` is the stop string that ended the request (or None),
    ``finished`` tells whether more tokens are taken, and ``num_consumed_tokens`` counts the
    output tokens taken so far (tokens after a matched stop string are not consumed).

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_tail_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(dict.fromkeys(stop))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.min_tokens = min_tokens
        # layer 1: token window
        context = [int(t) for t in prompt_tail_ids][-CONTEXT_TOKENS:] if CONTEXT_TOKENS else []
        self._ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text = self._decode(context)
        # layer 2: stop-string window (already emitted lookback + held-back text)
        self._stop_window = ""
        self._stop_emitted = 0  # chars of _stop_window already emitted
        # results
        self.stop_matched: str | None = None
        self.finished = False
        self.num_consumed_tokens = 0

    # ------------------------------------------------------------------ public

    def add_tokens(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str:
        """Append output tokens; return the text that is now safe to emit.

        Args:
            new_token_ids: the request's next output token ids.
            stop_terminated: the last of ``new_token_ids`` is the EOS / stop token that ended
                the request; like vLLM, its text is left out unless
                ``include_stop_str_in_output``. The caller should then call ``finish()``.

        Returns:
            The text delta (may be empty). After a stop string matched, the delta ends right
            before it (or after it when ``include_stop_str_in_output``), ``stop_matched`` is
            set, ``finished`` is True, and later calls return "".
        """
        if self.finished:
            return ""
        ids = list(new_token_ids)
        num_text = len(ids) - 1 if stop_terminated and ids and not self.include_stop_str_in_output else len(ids)
        pieces: list[str] = []
        for i in range(num_text):
            text = self._detokenize(ids[i])
            if self.stop:
                text = self._check_stop(text, final=False,
                                        may_match=self.num_consumed_tokens + i + 1 > self.min_tokens)
            pieces.append(text)
            if self.stop_matched is not None:
                self.num_consumed_tokens += i + 1
                return "".join(pieces)
        self.num_consumed_tokens += len(ids)
        return "".join(pieces)

    def finish(self) -> str:
        """End the request: return the text still held back (an incomplete UTF-8 tail, text
        that could have started a stop string). A stop string found in it still truncates it
        and sets ``stop_matched``. Later calls return ""."""
        if self.finished:
            return ""
        text = ""
        if len(self._ids) > self.read_offset:
            text = self._advance(self._decode(self._ids[self.prefix_offset :]))
        if self.stop:
            text = self._check_stop(text, final=True, may_match=self.num_consumed_tokens > self.min_tokens)
        self.finished = True
        return text

    # ------------------------------------------------------------------ layer 1: ids -> text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _detokenize(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        full = self._decode(self._ids[self.prefix_offset :])
        if full.endswith(REPLACEMENT_CHAR) and len(self._ids) - self.read_offset < MAX_HELD_TOKENS:
            return ""  # an incomplete UTF-8 character: wait for its remaining bytes
        return self._advance(full)

    def _advance(self, full: str) -> str:
        """Emit what ``full`` (the window's text) adds to the prefix text; slide the window."""
        prefix = self._prefix_text
        start = len(prefix) if full.startswith(prefix) else _common_prefix_len(full, prefix)
        delta = full[start:]
        if not delta and len(self._ids) - self.read_offset < MAX_HELD_TOKENS:
            # Nothing new (e.g. a skipped special token): keep the context as it is, so a
            # SentencePiece "▁" after it still decodes as a space.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        if self.prefix_offset >= _TRIM_AT:
            del self._ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return delta

    # ------------------------------------------------------------------ layer 2: stop strings

    def _check_stop(self, text: str, final: bool, may_match: bool = True) -> str:
        """Emit what ``text`` adds unless it may start a stop string; with ``may_match`` False
        (before ``min_tokens``) nothing is matched yet, but the text stays in the window so
        a stop string that ends later is found whole."""
        if not text and not final:
            return ""
        window = self._stop_window + text
        emitted = self._stop_emitted
        match = self._find_stop(window, len(self._stop_window)) if may_match else None
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            self.stop_matched = stop_str
            self.finished = True
            self._stop_window, self._stop_emitted = "", 0
            return window[emitted : max(emitted, end)]
        hold = 0 if final or self.include_stop_str_in_output else self._partial_stop_len(window[emitted:])
        cut = len(window) - hold
        keep_from = max(0, min(cut, len(window) - (self._max_stop_len - 1)))
        self._stop_window = window[keep_from:]
        self._stop_emitted = cut - keep_from
        return window[emitted:cut]

    def _find_stop(self, window: str, new_from: int) -> tuple[int, str] | None:
        """The stop string completed first in ``window`` among those that end in its new text
        (from ``new_from`` on; a match in older text was passed over before ``min_tokens``):
        (start index, stop string)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            i = window.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, pending: str) -> int:
        """Length of the longest suffix of ``pending`` that is a proper prefix of a stop string."""
        for k in range(min(len(pending), self._max_stop_len - 1), 0, -1):
            suffix = pending[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                return k
        return 0


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
