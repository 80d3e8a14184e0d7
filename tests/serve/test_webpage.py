"""The web chat page at `/`, in a real headless Chromium against a real server: type, send, watch the reply
stream in, take a screenshot; with the calculator and thinking toggles, against the run SFT'd on calculator
conversations, see the tool call, its result, the folded reasoning and the final answer. Uses Debian's chromium (/usr/bin/chromium, or NANOFORGE_CHROMIUM) through
playwright-python; skips when either is missing, unless NANOFORGE_REQUIRE_BROWSER=1 makes that a failure."""
from __future__ import annotations

import json
import os
import shutil
import struct
import zlib

import pytest

import tool_run
from test_generate import make_tiny_run

pytestmark = pytest.mark.slow

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    """The browser to drive, or a skip (a failure under NANOFORGE_REQUIRE_BROWSER=1) saying what is missing."""
    missing = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = "playwright-python is not installed (pip install playwright; its own browser download is not needed)"
    path = os.environ.get("NANOFORGE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if missing is None and not os.path.exists(path):
        missing = f"no Chromium at {path} (apt-get install chromium, or set NANOFORGE_CHROMIUM)"
    if missing is None:
        for module in ("fastapi", "uvicorn", "httpx"):
            try:
                __import__(module)
            except ImportError:
                missing = f"{module} is not installed (pip install fastapi uvicorn httpx)"
    if missing:
        if os.environ.get("NANOFORGE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"the browser test cannot run: {missing}; NANOFORGE_REQUIRE_BROWSER=1 is set")
        pytest.skip(f"the browser test needs a browser: {missing}")
    return path


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG after checking its signature and every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, width, height, kinds = 8, 0, 0, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in the {kind!r} chunk"
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        kinds.append(kind)
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    return width, height


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_tokenizer):
    _chromium()  # skip before building a run and starting a server for nothing
    from test_server import ServerProcess

    run_dir = make_tiny_run(tmp_path_factory, tiny_tokenizer)
    proc = ServerProcess(run_dir, tmp_path_factory.mktemp("web") / "server.log")
    yield proc
    proc.stop()


def test_chat_page_streams_a_reply(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            requests: list = []
            page.on("request", lambda r: requests.append(r))
            page.goto(server.url + "/")
            assert page.title() == "nanoforge chat"
            page.wait_for_function("document.getElementById('model').textContent.trim() === 'run'")

            page.fill("#system", "You are a helpful assistant.")
            page.fill("#temperature", "0.8")
            page.fill("#max_tokens", "40")
            page.fill("#input", "Tell me a story about a little robot.")
            page.click("#send")
            page.wait_for_selector(".msg.user")
            # The reply fills in while the Stop button is enabled, then the page notes the finish.
            page.wait_for_function("document.querySelector('.msg.assistant')?.textContent.length > 0", timeout=30_000)
            page.wait_for_selector(".meta", timeout=30_000)
            reply = page.text_content(".msg.assistant")
            assert reply and reply.strip()
            assert page.text_content(".msg.user") == "Tell me a story about a little robot."
            assert "tokens" in page.text_content(".meta")
            assert not page.query_selector(".msg.error")

            # a second turn carries the history
            page.fill("#input", "And then?")
            page.press("#input", "Enter")
            page.wait_for_function("document.querySelectorAll('.msg.assistant').length === 2", timeout=30_000)
            page.wait_for_function("document.getElementById('send').disabled === false", timeout=30_000)
            assert len(page.query_selector_all(".msg.assistant")) == 2
            sent = [json.loads(r.post_data) for r in requests if r.url.endswith("/v1/chat/completions")]
            assert [m["role"] for m in sent[1]["messages"]] == ["system", "user", "assistant", "user"]
            assert sent[1]["messages"][2]["content"] == reply
            assert sent[1]["stream"] is True and sent[1]["max_tokens"] == 40 and sent[1]["temperature"] == 0.8

            # The tiny model's context is 128 tokens: by the third turn the page has to drop the oldest one.
            page.fill("#input", "What happened next?")
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.msg.assistant').length === 3", timeout=30_000)
            page.wait_for_function("document.getElementById('send').disabled === false", timeout=30_000)
            assert not page.query_selector(".msg.error"), page.text_content(".msg.error")
            assert "dropped the oldest turn" in page.text_content("#log")

            shot = tmp_path / "chat.png"
            page.screenshot(path=str(shot))
            data = shot.read_bytes()
            assert png_size(data) == (1000, 700)
            assert len(data) > 5_000, "a page with a conversation on it is not a near-empty image"

            page.click("#reset")
            assert page.query_selector_all(".msg") == []
            assert not errors, errors
            assert all(r.url.startswith(server.url) for r in requests), "the page must load nothing from outside"
        finally:
            browser.close()


# ---------------------------------------------------------------------------------------------- tools and thinking


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, tiny_tokenizer):
    """The run SFT'd on calculator conversations (tests/tool_run.py), served without a key."""
    _chromium()
    from test_server import ServerProcess

    proc = ServerProcess(tool_run.make_tool_run(tmp_path_factory, tiny_tokenizer),
                         tmp_path_factory.mktemp("web_tools") / "server.log")
    yield proc
    proc.stop()


def _ask_with_toggles(page, url, question, toggles, max_tokens):
    """Open the page, switch the toggles on, ask greedily, and wait until the turn is over (the final answer
    after any tool rounds)."""
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model').textContent.trim() === 'run'")
    for toggle in toggles:
        page.check(toggle)
    page.fill("#system", "You are a helpful assistant.")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#input", question)
    page.click("#send")
    page.wait_for_selector(".meta", timeout=60_000)
    assert not page.query_selector(".msg.error"), page.text_content(".msg.error")


def _sent_chats(requests) -> list[dict]:
    return [json.loads(r.post_data) for r in requests if r.url.endswith("/v1/chat/completions")]


def test_calculator_on_shows_the_call_the_result_and_the_answer(tool_server):
    from playwright.sync_api import sync_playwright

    from nanoforge.chat.calculator import CALCULATOR_SCHEMA, run_tool_call

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            errors, requests = [], []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r))
            _ask_with_toggles(page, tool_server.url, tool_run.question(*tool_run.QUESTIONS[0]), ["#calculator"], 80)

            call_text = page.text_content(".msg.assistant .tool-call")
            name, _, arguments = call_text.partition(" ")
            assert name == "calculator" and "expression" in json.loads(arguments)
            assert page.text_content(".msg.tool .tool-name") == "calculator: "
            result = run_tool_call({"name": name, "arguments": arguments}, ["calculator"])
            assert page.text_content(".msg.tool .tool-result") == result
            bubbles = page.query_selector_all(".msg.assistant")
            assert len(bubbles) == 2
            assert bubbles[1].text_content().startswith("The answer is ")
            assert not page.query_selector("details.reasoning"), "thinking was off"

            first, second = _sent_chats(requests)
            assert first["tools"] == [CALCULATOR_SCHEMA] and "chat_template_kwargs" not in first
            assistant, tool = second["messages"][-2:]
            assert assistant["content"] is None and assistant["tool_calls"][0]["function"] == {
                "name": name, "arguments": arguments}
            assert tool == {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": result}
            assert not errors, errors
        finally:
            browser.close()


def test_think_on_folds_the_reasoning_and_keeps_tags_out_of_the_answer(tool_server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            errors, requests = [], []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r))
            _ask_with_toggles(page, tool_server.url, tool_run.question(*tool_run.QUESTIONS[1]),
                              ["#think", "#calculator"], 100)

            details = page.query_selector(".msg.assistant details.reasoning")
            assert details is not None and details.get_attribute("open") is None, "the reasoning starts folded"
            assert details.query_selector("summary").text_content() == "reasoning"
            shown = details.query_selector(".reasoning-text").text_content()
            first = _sent_chats(requests)[0]
            assert first["chat_template_kwargs"] == {"enable_thinking": True}
            # the same request, not streamed: the folded text is exactly the model's reasoning
            import httpx

            whole = httpx.post(tool_server.url + "/v1/chat/completions", json={**first, "stream": False},
                               timeout=60).json()["choices"][0]["message"]
            assert shown == whole["reasoning_content"] and shown.startswith("I should compute ")
            assert page.text_content(".msg.assistant .tool-call").startswith("calculator ")
            assert page.query_selector(".msg.tool .tool-result") is not None
            # The turn goes on after the tool result; what the page shows of it is what the API returns for the
            # same request (the one parser), and no <tool_call> ever reaches the content.
            assert len(page.query_selector_all(".msg.assistant")) == 2
            second = _sent_chats(requests)[1]
            final = httpx.post(tool_server.url + "/v1/chat/completions", json={**second, "stream": False},
                               timeout=60).json()["choices"][0]["message"]
            last = page.query_selector_all(".msg.assistant")[-1].query_selector(".content")
            assert (last.text_content() if last else "") == (final["content"] or "")
            outside = page.query_selector_all(".msg.assistant .content, .msg.assistant .tool-call")
            assert outside and not any("<tool_call>" in el.text_content() for el in outside)
            details.click()  # unfolds on a click
            assert details.get_attribute("open") is not None
            assert not errors, errors
        finally:
            browser.close()
