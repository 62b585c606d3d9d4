"""Incremental detokenization and stop strings, per request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase


@dataclass
class Detokenizer:
    """A request's text so far, made from its token ids as they come; no tokenizer (None) makes none."""

    tokenizer: PreTrainedTokenizerBase | None
    skip_special_tokens: bool = True
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    decode: Callable[..., str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.decode = _decode_of(self.tokenizer)

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Append the text of newly added tokens; returns the new text (empty while a char is incomplete,
        unless this is the request's last step: then an unfinished char stays as U+FFFD, as decode gives)."""
        skip = self.skip_special_tokens
        prefix = self.decode(token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = self.decode(token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return delta

    def find_stop(self, stops: list[str], delta_len: int) -> tuple[int, str] | None:
        """Where the first stop string begins in text, and which one, searching only where the new text
        could complete one; None if no stop string appears."""
        hits = []
        for s in stops:
            start = max(0, len(self.text) - delta_len - len(s) + 1)
            i = self.text.find(s, start)
            if i >= 0:
                hits.append((i, s))
        return min(hits, key=lambda h: h[0]) if hits else None


def _decode_of(tokenizer: PreTrainedTokenizerBase | None) -> Callable[..., str]:
    """tokenizer.decode, or the Rust tokenizer's own decode where tokenizer.decode of a list of ids is
    exactly that call (a tokenizers-backed tokenizer that cleans up no spaces): the same text, without
    transformers' argument handling on every token. Without a tokenizer every text is empty."""
    if tokenizer is None:
        return lambda token_ids, **_: ""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return tokenizer.decode
    if type(tokenizer)._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces:
        return tokenizer.backend_tokenizer.decode
    return tokenizer.decode
