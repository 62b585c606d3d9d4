"""The built-in tool-call parsers, registered through the same hook a third party would use."""

from __future__ import annotations

from turnout.hookspecs import hookimpl
from turnout.tool_parsers import ToolParser
from turnout.tool_parsers.hermes import HermesToolParser
from turnout.tool_parsers.llama3_json import Llama3JsonToolParser


@hookimpl
def turnout_tool_parsers() -> list[type[ToolParser]]:
    return [HermesToolParser, Llama3JsonToolParser]
