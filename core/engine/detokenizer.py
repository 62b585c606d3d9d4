"""Incremental detokenization and stop strings, per request."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass
class Detokenizer:
    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool = True
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Append the text of newly added tokens; returns the new text (empty while a char is incomplete,
        unless this is the request's last step: then an unfinished char stays as U+FFFD, as decode gives)."""
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(
            token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        full = self.tokenizer.decode(token_ids[self.prefix_offset :], skip_special_tokens=skip)
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
