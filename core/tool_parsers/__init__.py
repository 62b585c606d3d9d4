"""Tool-call parsers: a chat completion's text turned into OpenAI `tool_calls`, whole or as it streams.

Parsers are plugins (`turnout_tool_parsers`); the built-in hermes and llama3_json register through the same
hook. `get_tool_parser(name)` finds one among every plugin's parsers.
"""

from __future__ import annotations

import logging

from turnout.errors import ConfigError
from turnout.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ParsedToolCall,
    ParsedToolCalls,
    ToolCallDelta,
    ToolParser,
    join_deltas,
)

logger = logging.getLogger("turnout")


def tool_parser_names() -> list[str]:
    """The names of every installed tool-call parser, sorted."""
    return sorted(_installed())


def get_tool_parser(name: str) -> type[ToolParser]:
    """The installed parser called `name`; ConfigError naming the installed ones if there is none, or the
    incompatible plugin that offers it."""
    from turnout.plugins import get_plugin_manager

    parsers = _installed()
    if name in parsers:
        return parsers[name]
    if why := get_plugin_manager().why_withheld("turnout_tool_parsers", name):
        raise ConfigError(f"tool-call parser '{name}' cannot be used: {why}")
    known = ", ".join(sorted(parsers)) or "none"
    raise ConfigError(f"unknown tool-call parser '{name}'; installed: {known}")


def _installed() -> dict[str, type[ToolParser]]:
    from turnout.plugins import get_plugin_manager

    found: dict[str, type[ToolParser]] = {}
    owner: dict[str, str] = {}
    for res in get_plugin_manager().call_each("turnout_tool_parsers"):
        for cls in res.value or []:
            name = getattr(cls, "name", None)
            if not (isinstance(cls, type) and issubclass(cls, ToolParser) and isinstance(name, str)):
                logger.warning("plugin %s: %r is not a named ToolParser subclass; ignored", res.plugin, cls)
            elif name in found:
                logger.warning(
                    "plugin %s: tool-call parser '%s' ignored, plugin %s already offers it",
                    res.plugin, name, owner[name],
                )  # fmt: skip
            else:
                found[name], owner[name] = cls, res.plugin
    return found


__all__ = [
    "DeltaMessage",
    "ParsedToolCall",
    "ParsedToolCalls",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "join_deltas",
    "tool_parser_names",
]
