"""The tokenizer service: prompts and chat messages to validated token ids."""

from services.tokenizer.service import TokenizeError, TokenizerService

__all__ = ["TokenizeError", "TokenizerService"]
