"""The chat page `turnout serve` serves at `/`: one HTML file with its script and styles inline. It speaks
only the public HTTP API (/v1/models, /v1/chat/completions, /v1/explain, /metrics) and loads nothing else,
which its Content-Security-Policy enforces in the browser."""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib.resources import files


@functools.cache
def chat_page() -> tuple[str, str]:
    """The page's HTML and the Content-Security-Policy that lets its own inline script and style run and
    lets it connect to this origin only."""
    html = files(__package__).joinpath("chat.html").read_text(encoding="utf-8")
    script, style = (_hashes(html, tag) for tag in ("script", "style"))
    csp = (
        f"default-src 'none'; script-src {script}; style-src {style}; connect-src 'self'; "
        "img-src 'self' data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    )
    return html, csp


def _hashes(html: str, tag: str) -> str:
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
    return " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies
    )
