"""The examples of the README and of its reference pages (docs/cli.md, python-api.md, server.md,
configuration.md), run as written on the embedded model: the `turnout` lines of their bash blocks (with a
small --max-tokens, each distinct line once, through the console script's cli.main in this process), their
Python snippets, their serve blocks with the curl requests and the openai client (the port substituted, and
a small max_tokens where the answer is only read for being there), and the promise about engines built at a
script's top level."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_runner import run_cli
from test_server import Server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ("cli", "python-api", "server", "configuration")  # the pages under docs/ whose examples run here
PAGES = {p: (ROOT / p).read_text() for p in ("README.md", *(f"docs/{n}.md" for n in REFERENCE))}
README = PAGES["README.md"]
README_URL = "http://127.0.0.1:8000"
MAX_TOKENS = "4"


def blocks(lang: str, page: str | None = None) -> list[str]:
    """The `lang` blocks of one page, or of every page."""
    texts = [PAGES[page]] if page else PAGES.values()
    return [b for t in texts for b in re.findall(rf"^```{lang}\n(.*?)^```", t, re.S | re.M)]


def block_with(lang: str, needle: str, page: str | None = None) -> str:
    (block,) = [b for b in blocks(lang, page) if needle in b]
    return block


def commands(block: str) -> list[list[str]]:
    """Each command of a bash block as argv: continuation lines joined, comments dropped."""
    return [
        argv for line in block.replace("\\\n", " ").splitlines() if (argv := shlex.split(line, comments=True))
    ]


def runnable(argv: list[str]) -> list[str]:
    """A synopsis line as a command: `[--flag]` kept, optional groups that need a value of yours dropped."""
    out, group = [], None
    for tok in argv:
        if group is None and tok.startswith("["):
            group = []
        if group is None:
            out.append(tok)
            continue
        group.append(tok)
        if tok.endswith("]"):
            if len(group) == 1 and re.fullmatch(r"\[--[a-z-]+\]", tok):
                out.append(tok[1:-1])
            group = None
    return out


def turnout_lines() -> list[list[str]]:
    lines = [runnable(a) for b in blocks("bash") for a in commands(b) if a[0] == ".venv/bin/turnout"]
    distinct = dict.fromkeys(tuple(a) for a in lines if a[1] in ("generate", "plugins", "explain"))
    return [list(a) for a in distinct]


def run(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv", turnout_lines(), ids=shlex.join)
def test_use_line_runs(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process, through the console script's cli.main (test_cli runs the script itself)."""
    args = argv[1:]
    if args[0] == "generate":
        if "--max-tokens" in args:
            args[args.index("--max-tokens") + 1] = MAX_TOKENS
        else:
            args += ["--max-tokens", MAX_TOKENS]
        if "--stop" in args and "--json" not in args:  # to read what the stop string did
            args.append("--json")
        if "--input" in args:  # the README's own JSONL lines
            (tmp_path / args[args.index("--input") + 1]).write_text(blocks("json")[0])
    monkeypatch.chdir(tmp_path)
    p = run_cli(*args)
    if args[0] in ("plugins", "explain"):
        assert json.loads(p.stdout) if "--json" in args else p.stdout.strip()
    elif "--output" in args:
        rows = [json.loads(r) for r in (tmp_path / args[args.index("--output") + 1]).read_text().splitlines()]
        assert [r["id"] for r in rows] == ["fr", "count", "poem"] and not any("error" in r for r in rows)
        assert len(rows[2]["outputs"]) == 2 and rows[2]["logprobs"]
    elif "--json" in args:
        rows = [json.loads(r) for r in p.stdout.splitlines()]
        assert len(rows) == args.count("--prompt") and all(
            r["finish_reason"] in ("stop", "length") for r in rows
        )
    else:
        assert p.stdout.strip()
    if "--stop" in args:  # "\n" is a newline, once the shell has passed the backslash on
        assert args[args.index("--stop") + 1] == "\\n"
        rows = [json.loads(r) for r in p.stdout.splitlines()]
        assert all("\n" not in o["text"] for r in rows for o in r["outputs"])


def test_llm_snippet_runs(tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    snippet = block_with("python", "from turnout import LLM, SamplingParams\n", "docs/python-api.md")
    assert snippet in blocks("python", "README.md")  # the README shows the reference page's first example
    script.write_text(snippet)
    p = run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 0, p.stderr
    first, logprobs = p.stdout.splitlines()[:2]
    assert "Paris" in first and "Logprob(" in logprobs


def test_structured_outputs_snippet_runs(tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block_with("python", "StructuredOutputsParams(json=city)"))
    p = run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 0, p.stderr
    as_json, choice = p.stdout.splitlines()
    assert isinstance(json.loads(as_json)["city"], str) and choice in ("yes", "no")


def serve_block(needle: str) -> tuple[list[str], list[str]]:
    """The serve and curl commands of docs/server.md's bash block holding `needle`."""
    serve, curl = commands(block_with("bash", needle, "docs/server.md"))
    assert serve[:2] == [".venv/bin/turnout", "serve"] and curl[0] == "curl"
    return serve[2:], curl


def start(tmp: Path, args: list[str]) -> Server:
    args = list(args)
    if "--port" in args:  # Server adds --port 0 and reads the port from the start-up line
        del args[args.index("--port") : args.index("--port") + 2]
    return Server(tmp, *args)


def curl(argv: list[str], url: str) -> dict:
    short = f'"max_tokens": {MAX_TOKENS}'
    p = run([a.replace(README_URL, url).replace('"max_tokens": 64', short) for a in argv], Path.cwd())
    assert p.returncode == 0, p.stderr
    body = json.loads(p.stdout)
    assert body["choices"][0]["message"]["content"], body
    return body


def test_plain_serve_and_its_curl(tmp_path: Path) -> None:
    args, request = serve_block('"model": "SmolLM2-135M-Instruct"')
    server = start(tmp_path, args)
    try:
        curl(request, server.url)
    finally:
        server.stop()


def test_serve_with_a_key_its_curl_and_the_openai_snippet(tmp_path: Path) -> None:
    args, request = serve_block("--served-model-name")
    (readme_serve,) = commands(block_with("bash", "turnout serve", "README.md"))
    assert args[: len(readme_serve) - 2] == readme_serve[2:]  # the README's line, without the tuning flags
    server = start(tmp_path, args)
    try:
        assert curl(request, server.url)["model"] == "my-model"
        script = tmp_path / "client.py"
        snippet = block_with("python", "stream_options").replace(README_URL, server.url)
        script.write_text(snippet.replace("max_tokens=64", f"max_tokens={MAX_TOKENS}"))
        p = run([sys.executable, str(script)], tmp_path)
        assert p.returncode == 0 and p.stdout.strip(), p.stderr
        script.write_text(block_with("python", 'tool_choice="required"').replace(README_URL, server.url))
        p = run([sys.executable, str(script)], tmp_path)
        assert p.returncode == 0, p.stderr
        as_json, call = p.stdout.splitlines()
        assert isinstance(json.loads(as_json)["city"], str)
        name, arguments = call.split(" ", 1)
        assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str)
    finally:
        server.stop()


# ---- "An engine with worker processes built at a script's top level is refused with one line" ----

TP_SCRIPT = """
from turnout import LLM, SamplingParams
{build}
"""
TP_BUILD = "llm = LLM(tensor_parallel_size=3, max_model_len=64)"  # the embedded model's 9 heads allow TP 3


def test_tp_engine_at_a_scripts_top_level_is_one_line(tmp_path: Path) -> None:
    assert "refused with one line saying so" in PAGES["docs/python-api.md"]
    script = tmp_path / "top.py"
    script.write_text(TP_SCRIPT.format(build=TP_BUILD))
    p = run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 1 and p.stdout == ""
    (line,) = p.stderr.splitlines()  # no traceback, and no worker started to print one
    assert line.startswith(f"ConfigError: {script}:3 builds a 3-rank engine (executor multiproc)")
    assert line.endswith('put that code under `if __name__ == "__main__":`')


def test_tp_engine_under_the_main_guard_runs(tmp_path: Path) -> None:
    script = tmp_path / "guarded.py"
    out = "llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids"
    body = f"{TP_BUILD}\nprint({out})"
    script.write_text(TP_SCRIPT.format(build='if __name__ == "__main__":\n' + textwrap.indent(body, "    ")))
    p = run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)) == 2
