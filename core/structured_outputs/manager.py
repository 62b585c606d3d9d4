"""The engine's side of structured outputs: the backend, the compiled-grammar cache, one matcher per
constrained request, the bitmask of a step's constrained rows, and each sampled token fed back."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from turnout.errors import ConfigError, RequestError
from turnout.structured_outputs import (
    Grammar,
    GrammarOutput,
    StructuredOutputBackend,
    StructuredOutputsParams,
    bitmask_words,
)

logger = logging.getLogger("turnout")
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


def backend_classes() -> list[tuple[str, type[StructuredOutputBackend]]]:
    """(plugin, backend class) for every installed backend."""
    from turnout.plugins import get_plugin_manager

    found = []
    for res in get_plugin_manager().call_each("turnout_structured_output_backends"):
        found += [(res.plugin, cls) for cls in res.value or []]
    return found


def choose_backend(name: str) -> type[StructuredOutputBackend]:
    """The backend `structured_outputs_backend` names, or under "auto" the usable one of highest priority;
    ConfigError listing why each one cannot run otherwise."""
    from turnout.plugins import get_plugin_manager

    found = backend_classes()
    reasons = {cls.name: cls.import_error() for _, cls in found}
    usable = sorted((c for _, c in found if reasons[c.name] is None), key=lambda c: (-c.priority, c.name))
    if name != "auto":
        usable = [c for c in usable if c.name == name]
    if usable:
        return usable[0]
    if name != "auto" and name not in reasons:
        if why := get_plugin_manager().why_withheld("turnout_structured_output_backends", name):
            raise ConfigError(f"structured_outputs_backend '{name}' cannot be used: {why}")
        installed = ", ".join(sorted(reasons)) or "none"
        raise ConfigError(f"structured_outputs_backend '{name}' is not installed (installed: {installed})")
    why = "; ".join(f"{n}: {r}" for n, r in reasons.items() if name in ("auto", n)) or "none is installed"
    want = "a structured-output backend" if name == "auto" else f"structured_outputs_backend '{name}'"
    raise ConfigError(
        f"structured outputs need {want} ({why}); install turnout-xgrammar (pip install xgrammar)"
    )


class StructuredOutputManager:
    def __init__(
        self,
        backend_name: str,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        pin_memory: bool = False,
    ) -> None:
        self.backend_name, self.tokenizer, self.pin_memory = backend_name, tokenizer, pin_memory
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.backend: StructuredOutputBackend | None = None
        self.compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.matchers: dict[str, Grammar] = {}
        self.dead_ends: set[str] = set()  # requests whose grammar allowed no token: given EOS, then stopped
        if backend_name != "auto":
            choose_backend(backend_name)  # a backend named but not usable fails at start-up

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar, from the cache where it is; RequestError naming what is wrong otherwise."""
        key = (so.kind, so.spec)
        if (hit := self.compiled.get(key)) is not None:
            self.compiled.move_to_end(key)
            return hit
        if self.backend is None:
            try:
                cls = choose_backend(self.backend_name)
            except ConfigError as e:
                raise RequestError(str(e)) from None
            self.backend = cls(self.tokenizer, self.vocab_size, self.eos_token_ids)
            logger.info("structured outputs: backend %s", cls.name)
        what = f"structured_outputs: the {so.kind} constraint"
        try:
            grammar = self.backend.compile(so.kind, so.spec)
        except ValueError as e:
            raise RequestError(f"{what} does not compile: {e}") from None
        if not self._bitmask([self.backend.matcher(grammar)]).any():
            raise RequestError(
                f"{what} allows no token of this model's vocabulary to start; it cannot be spelled"
            )
        self.compiled[key] = grammar
        if len(self.compiled) > CACHE_SIZE:
            self.compiled.popitem(last=False)
        return grammar

    def add(self, req_id: str, so: StructuredOutputsParams) -> None:
        self.matchers[req_id] = self.backend.matcher(self.compile(so))  # type: ignore[union-attr]

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.dead_ends.discard(req_id)

    @property
    def active(self) -> bool:
        """Some request holds a matcher: its next bitmask needs its last token on the host."""
        return bool(self.matchers)

    def grammar_output(self, sampled_req_ids: list[str]) -> GrammarOutput | None:
        """The bitmask of the constrained rows among a step's sampling rows; None where there are none. A
        row its grammar leaves empty (a token it cannot spell) gets EOS instead, and the request stops."""
        ids = [r for r in sampled_req_ids if r in self.matchers]
        if not ids:
            return None
        bitmask = self._bitmask([self.matchers[r] for r in ids])
        for row in (~bitmask.any(1)).nonzero().flatten().tolist():  # never a row of -inf logits
            self.dead_ends.add(ids[row])
            for t in self.eos_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
        return GrammarOutput(ids, bitmask)

    def _bitmask(self, matchers: list[Grammar]) -> torch.Tensor:
        shape = (len(matchers), bitmask_words(self.vocab_size))
        bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=self.pin_memory)
        for row, m in enumerate(matchers):
            m.fill_bitmask(bitmask, row)
        return bitmask

    def accept(self, req_id: str, token_id: int) -> bool:
        """Feed the sampled token to the request's matcher; True when the output is complete, or its grammar
        had no token to give, or refused the token (which the mask rules out): the request must stop."""
        m = self.matchers.get(req_id)
        if m is None:
            return False
        if req_id in self.dead_ends:
            self.dead_ends.discard(req_id)
            logger.warning(
                "request %s: its grammar allows no token of this vocabulary here; stopping it", req_id
            )
            return True
        if not m.accept_token(token_id):
            logger.warning("request %s: token %d is outside its grammar; stopping it", req_id, token_id)
            return True
        return m.is_terminated()


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the signed value torch stores."""
    return -(1 << 31) if j == 31 else 1 << j
