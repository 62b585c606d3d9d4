"""`turnout serve`'s own flags; the engine's come from the same helper `turnout generate` uses.
Importing this module stays light (no FastAPI), so building the CLI parser does not pay for the server."""

from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on; 0 = any free port")
    g.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/* (/health stays open); default: TURNOUT_API_KEY",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        help="the name(s) clients send as 'model'; default: the model argument, or the embedded model's name",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests that may wait for a seat in the running batch; past it the server answers 503",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they end with an error",
    )
    g.add_argument(
        "--no-web-page",
        dest="web_page",
        action="store_false",
        help="serve no chat page at / (the API is unchanged)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="how tool calls are read out of the model's output: hermes (Qwen2.5, Qwen3, Hermes), "
        "llama3_json (Llama 3.1+), or a plugin's; turnout plugins lists them",
    )
