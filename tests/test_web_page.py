"""The chat page `turnout serve` serves at /, driven in the system's headless Chromium over the DevTools
protocol: one server (the embedded model, with --api-key) and one page for every test, in file order. The
page's answers are checked against the HTTP API, its selection panel against the engine's start-up line and
`turnout explain --json`, its names against Chromium's accessibility tree. The screenshots land in
build/test-artifacts/, or where WEB_PAGE_IMAGES names: `make images` writes the README's, docs/images/."""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from test_server import KEY, SMOL, Server

from turnout.cli import build_parser, main
from turnout.entrypoints.openai.api_server import build_app
from turnout.metrics import PrometheusStatLogger

ROOT = Path(__file__).parents[1]
IMAGES_VAR = "WEB_PAGE_IMAGES"  # not TURNOUT_*: the engine reads those as its settings, refusing unknown ones
IMAGES = ROOT / os.environ.get(IMAGES_VAR, "build/test-artifacts")
CHROMIUM = shutil.which("chromium")


def _missing() -> str | None:
    if CHROMIUM is None:
        return "no chromium on PATH: apt-get install chromium (.ci/run installs it)"
    if importlib.util.find_spec("websocket") is None:
        return "no websocket-client: make setup-test installs it"
    return None


MISSING = _missing()
if MISSING and not os.environ.get("CI"):
    pytest.skip(MISSING, allow_module_level=True)


class Chromium:
    """Headless Chromium with one page, driven over the DevTools protocol; it keeps every event it sends."""

    def __init__(self, tmp: Path) -> None:
        import websocket

        profile = tmp / "profile"
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--force-device-scale-factor=1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
        ]  # fmt: skip
        with open(tmp / "chromium.log", "w") as log:
            self.proc = subprocess.Popen([CHROMIUM, *flags, "about:blank"], stdout=log, stderr=log)
        port = self._port(profile / "DevToolsActivePort", tmp / "chromium.log")
        target = httpx.put(f"http://127.0.0.1:{port}/json/new?about:blank", timeout=10).json()
        self.ws = websocket.create_connection(
            target["webSocketDebuggerUrl"], timeout=60, suppress_origin=True
        )
        self.events: list[dict[str, Any]] = []
        self.last_id = 0
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable")

    def _port(self, active: Path, log: Path, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"chromium exited:\n{log.read_text()}"
            lines = active.read_text().splitlines() if active.exists() else []
            if len(lines) == 2:
                return int(lines[0])
            time.sleep(0.05)
        raise AssertionError(f"chromium opened no DevTools port in {timeout}s:\n{log.read_text()}")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.last_id += 1
        self.ws.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while (msg := json.loads(self.ws.recv())).get("id") != self.last_id:
            self.events.append(msg)
        assert "error" not in msg, f"{method}: {msg['error']}"
        return msg["result"]

    def js(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, f"{expression}: {r['exceptionDetails']}"
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while not (value := self.js(expression)):
            assert time.monotonic() < deadline, f"not true within {timeout}s: {expression}"
            time.sleep(0.05)
        return value

    def goto(self, url: str) -> None:
        """Open url and wait until its document has loaded."""
        self.js("window.left = true")  # the new document has no such mark
        self.call("Page.navigate", url=url)
        self.wait("!window.left && document.readyState === 'complete'")

    def text(self, selector: str) -> str:
        return self.js(f"document.querySelector({json.dumps(selector)}).textContent")

    def type(self, selector: str, text: str) -> None:
        """Focus the element and type text into it, as a keyboard does."""
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def press(self, key: str, code: int, modifiers: int = 0, text: str = "") -> None:
        keys = {"key": key, "code": key, "windowsVirtualKeyCode": code, "modifiers": modifiers}
        self.call("Input.dispatchKeyEvent", type="keyDown", text=text, **keys)
        self.call("Input.dispatchKeyEvent", type="keyUp", **keys)

    def click(self, selector: str) -> None:
        x, y = self.js(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path: Path, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=width < 500)  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory):
    """The page's server; while it starts, Chromium and `turnout explain --json` with its engine flags."""
    assert not MISSING, MISSING  # in CI the browser tests run
    server, browser = Server(tmp_path_factory.mktemp("web"), *SMOL, wait=False), None
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["explain", "--json", *[a for a in SMOL if a not in ("--api-key", KEY)]]) == 0
        browser = Chromium(tmp_path_factory.mktemp("chromium"))
        server.wait_ready()
        yield server, browser, json.loads(out.getvalue())
    finally:
        if browser is not None:
            browser.close()
        server.stop()


@pytest.fixture(scope="module")
def server(started) -> Server:
    return started[0]


@pytest.fixture(scope="module")
def page(started, server: Server) -> Chromium:
    """The page, opened with the right key."""
    browser = started[1]
    browser.goto(f"{server.url}/")
    browser.wait("document.getElementById('key-dialog').open")
    browser.type("#key", KEY)
    browser.press("Enter", 13, text="\r")
    browser.wait("document.body.dataset.ready")
    return browser


def _set(page: Chromium, **values: str) -> None:
    for id_, value in values.items():
        page.js(f"document.getElementById({json.dumps(id_)}).value = {json.dumps(value)}")


LAST = "[...document.querySelectorAll('.msg[data-role=assistant]')].pop()"  # the newest answer


def test_no_web_page_serves_the_api_without_the_page() -> None:
    args = build_parser().parse_args(["serve", "--no-web-page"])
    assert args.web_page is False and build_parser().parse_args(["serve"]).web_page
    engine = SimpleNamespace(tokenizer=None, max_model_len=512)  # what the routes read before a request
    doc = {"explained": True}
    app = build_app(
        engine, ["m"], None, PrometheusStatLogger("m"), explain=lambda: doc, web_page=args.web_page
    )
    client = TestClient(app)  # no lifespan: the engine never starts
    r = client.get("/")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"
    on = TestClient(build_app(engine, ["m"], None, PrometheusStatLogger("m"), explain=lambda: doc))
    assert on.get("/").headers["content-type"].startswith("text/html")


def test_make_images_sets_only_what_the_engine_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make images` runs this file with its variables set, so the server and explain here inherit them."""
    recipe = re.search(r"^images:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assigned = dict(re.findall(r"(\w+)=(\S+)", recipe.split("$(BIN)")[0]))
    assert set(assigned) == {IMAGES_VAR} and assigned[IMAGES_VAR] == "docs/images", recipe
    for name, value in assigned.items():
        monkeypatch.setenv(name, value)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["explain", "--json", *[a for a in SMOL if a not in ("--api-key", KEY)]]) == 0


@pytest.mark.slow  # Chromium
def test_the_page_asks_for_the_key_and_keeps_it_in_this_tab_only(page: Chromium, server: Server) -> None:
    page.js("sessionStorage.clear()")
    page.goto(f"{server.url}/")
    page.wait("document.getElementById('key-dialog').open")
    page.type("#key", "sk-wrong")
    page.press("Enter", 13, text="\r")
    page.wait("document.getElementById('key-error').textContent.includes('refused')")
    assert page.js("document.getElementById('key-dialog').open") and not page.js(
        "document.body.dataset.ready"
    )
    page.js("document.getElementById('key').value = ''")
    page.type("#key", KEY)
    page.press("Enter", 13, text="\r")
    page.wait("document.body.dataset.ready")
    assert page.js("sessionStorage.getItem('turnout-api-key')") == KEY
    assert page.js("localStorage.length") == 0 and page.js("document.cookie") == ""
    assert "SmolLM2-135M-Instruct" in page.text("#status")


@pytest.mark.slow  # Chromium
def test_the_streamed_answer_is_the_api_greedy_answer(page: Chromium, server: Server) -> None:
    _set(page, system="Be brief.", temperature="0", **{"top-p": "1", "max-tokens": "12"})
    page.js(
        "window.lengths = []; new MutationObserver(() => window.lengths.push("
        f"{LAST}.querySelector('.text').textContent.length)).observe("
        "document.getElementById('messages'), {subtree: true, childList: true, characterData: true})"
    )
    page.type("#prompt", "What is a railway turnout?")
    page.press("Enter", 13, text="\r")  # the keyboard sends
    page.wait(f"{LAST}?.dataset.state === 'done'", timeout=60)
    shown = page.js(f"{LAST}.querySelector('.text').textContent")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a railway turnout?"},
    ]
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "top_p": 1,
    }
    sent = [
        e["params"]["request"]
        for e in page.events
        if e["method"] == "Network.requestWillBeSent"
        and e["params"]["request"]["url"] == f"{server.url}/v1/chat/completions"
    ]
    assert json.loads(sent[-1]["postData"]) == {**body, "stream": True}  # the system prompt and settings
    ref = server.client().chat.completions.create(**body).choices[0].message.content
    assert shown == ref and ref
    assert len({n for n in page.js("window.lengths") if 0 < n < len(ref)}) >= 2  # it grew piece by piece
    assert page.js("document.getElementById('prompt').value") == ""


@pytest.mark.slow  # Chromium
def test_stop_ends_the_stream_and_the_request_mid_way(page: Chromium, server: Server) -> None:
    _set(page, temperature="0", **{"max-tokens": "400"})
    page.wait("document.getElementById('m-running').textContent === '0'")  # so '1' below is this request
    before = server.metrics()["turnout:generation_tokens_total"]
    page.type("#prompt", "List the numbers from 1 to 100, one per line.")
    page.click("#send")
    # the live figures follow /metrics while it runs
    page.wait("document.getElementById('m-running').textContent === '1' && "
              "Number(document.getElementById('m-tps').textContent) > 0 && "
              "document.getElementById('m-waiting').textContent === '0' && "
              "parseFloat(document.getElementById('m-kv').textContent) > 0", timeout=30)  # fmt: skip
    page.wait(f"{LAST}.querySelector('.text').textContent.length >= 10")
    page.click("#stop")
    page.wait(f"{LAST}.dataset.state === 'stopped'")
    shown = page.js(f"{LAST}.querySelector('.text').textContent")
    m = server.wait_metrics(lambda m: m["turnout:num_requests_running"] == 0)
    assert m["turnout:num_requests_running"] == 0
    time.sleep(0.5)
    generated = server.metrics()["turnout:generation_tokens_total"] - before
    assert (
        0 < generated < 400 and generated == m["turnout:generation_tokens_total"] - before
    )  # no more tokens
    assert shown and page.js(f"{LAST}.querySelector('.text').textContent") == shown
    assert "(stopped)" in page.js(f"{LAST}.textContent")
    assert page.js("!document.getElementById('send').disabled && document.getElementById('stop').disabled")
    page.wait("document.getElementById('m-running').textContent === '0'")


@pytest.mark.slow  # Chromium
def test_the_selection_panel_shows_what_the_engine_chose(page: Chromium, server: Server, started) -> None:
    line = re.search(r"backend (\S+), .*executor (\S+), graph mode (\S+),", server.log.read_text())
    backend, executor, graph = line.groups()  # the engine core's own report
    try:
        page.wait("document.getElementById('s-executor').textContent !== '–'", timeout=60)
    except AssertionError as e:  # the page's fetch of /v1/explain failed or hangs: say what it shows
        raise AssertionError(f"{e}; #s-why: {page.text('#s-why')!r}; events: {page.events[-5:]}") from None
    assert page.text("#s-attention").split()[0] == backend and page.text("#s-executor") == executor
    assert page.text("#s-graph").split()[0] == graph
    doc = started[2]  # `turnout explain --json` with the server's engine flags
    served = httpx.get(f"{server.url}/v1/explain", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert served.json() == doc
    why = page.text("#s-why")
    for c in doc["kinds"]["executor"]["candidates"] + doc["kinds"]["attention"]["candidates"]:
        assert f"{c['name']} ({c['plugin']}, priority {c['priority']})" in why, (c, why)
        assert all(r in why for r in c["reasons"])
    assert doc["platform"] in page.text("#s-platform")
    assert "/v1/explain" in httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"]


@pytest.mark.slow  # Chromium
def test_accessibility_basics(page: Chromium) -> None:
    nodes = page.call("Accessibility.getFullAXTree")["nodes"]
    controls = [
        n for n in nodes if not n.get("ignored") and n["role"]["value"] in ("textbox", "spinbutton", "button")
    ]
    names = {n["role"]["value"]: [] for n in controls}
    for n in controls:
        names[n["role"]["value"]].append(n.get("name", {}).get("value", ""))
    assert all(all(names_) for names_ in names.values()), names  # every control has a name
    assert {"Message", "System prompt"} <= set(names["textbox"])
    assert set(names["spinbutton"]) == {"Temperature", "Top p", "Max tokens"}
    assert {"Send", "Stop", "New chat"} <= set(names["button"])
    log = [n for n in nodes if n["role"]["value"] == "log"]
    assert len(log) == 1 and log[0]["name"]["value"] == "Conversation"
    assert page.js("document.documentElement.lang") == "en"
    page.js("document.getElementById('prompt').focus()")
    page.press("Tab", 9)
    assert page.js("document.activeElement.id") == "send"  # Tab goes from the message to Send
    count = page.js("document.querySelectorAll('.msg').length")
    page.type("#prompt", "one")
    page.press("Enter", 13, modifiers=8, text="\r")  # Shift+Enter: a new line, not a send
    assert page.js("document.getElementById('prompt').value") == "one\n"
    assert page.js("document.querySelectorAll('.msg').length") == count
    page.js("document.getElementById('prompt').value = ''")


@pytest.mark.slow  # Chromium
def test_the_page_loads_nothing_from_elsewhere(page: Chromium, server: Server) -> None:
    urls = [e["params"]["request"]["url"] for e in page.events if e["method"] == "Network.requestWillBeSent"]
    assert urls and all(u.startswith(f"{server.url}/") for u in urls), sorted(set(urls))
    csp = httpx.get(f"{server.url}/", timeout=10).headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    thrown = [e for e in page.events if e["method"] == "Runtime.exceptionThrown"]
    logged = [e["params"]["entry"] for e in page.events if e["method"] == "Log.entryAdded"]
    assert not thrown and not [e for e in logged if e["source"] in ("javascript", "security", "violation")]


@pytest.mark.slow  # Chromium
def test_screenshots_and_the_phone_sized_layout(page: Chromium) -> None:
    tps, kv = (f"document.getElementById('{id_}').textContent" for id_ in ("m-tps", "m-kv"))
    page.wait(f"{tps} === '0.0' && {kv} === '0.0 %'")  # idle figures: a stable picture
    page.screenshot(IMAGES / "web-page.png", 1280, 800)
    page.screenshot(IMAGES / "web-page-375x667.png", 375, 667)
    assert page.js("document.documentElement.scrollWidth") <= 375  # nothing runs off the side
    for selector in ("#prompt", "#send", "#stop"):  # the composer is on the first screen
        r = page.js(
            f"JSON.parse(JSON.stringify(document.querySelector('{selector}').getBoundingClientRect()))"
        )
        assert 0 <= r["left"] and r["right"] <= 375 and 0 <= r["top"] and r["bottom"] <= 667, (selector, r)
    page.call("Emulation.clearDeviceMetricsOverride")
