"""The web chat page at `/`, in a real headless Chromium against a real server: type, send, watch the reply
stream in, take a screenshot. Uses Debian's chromium (/usr/bin/chromium, or NANOFORGE_CHROMIUM) through
playwright-python; skips when either is missing, unless NANOFORGE_REQUIRE_BROWSER=1 makes that a failure."""
from __future__ import annotations

import json
import os
import shutil
import struct
import zlib

import pytest

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
