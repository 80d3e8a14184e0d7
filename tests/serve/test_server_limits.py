"""`nanoforge serve` against slow, hung-up and too many connections, over real sockets on 127.0.0.1: headers or a
body trickled in (each byte well within any per-read timeout) are cut off at their whole-phase deadline with a
408, a client hanging up mid-upload costs one log line (never a traceback), the connection cap keeps /health
answering, and a process out of file descriptors neither spins nor floods its log, and answers once they free."""
from __future__ import annotations

import os
import resource
import select
import socket
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the serving tests need httpx")
pytest.importorskip("fastapi", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")
pytest.importorskip("uvicorn", reason="serving needs fastapi and uvicorn (pip install fastapi uvicorn)")

from test_generate import make_tiny_run  # noqa: E402
from test_server import ServerProcess  # noqa: E402

COMPLETION = b'{"prompt": "Once upon", "max_tokens": 2}'


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer):
    return make_tiny_run(tmp_path_factory, tiny_tokenizer)


@pytest.fixture(scope="module")
def quick(run_dir, tmp_path_factory):
    """A server with 2 s deadlines for headers and bodies."""
    proc = ServerProcess(run_dir, tmp_path_factory.mktemp("quick") / "server.log",
                         "--header-timeout", "2", "--body-timeout", "2")
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, TimeoutError):
        pass
    return b"".join(chunks)


def trickle(sock: socket.socket, data: bytes, every: float) -> tuple[float, bytes]:
    """Send `data` a byte every `every` seconds until the server answers or hangs up: (seconds, its reply)."""
    start = time.monotonic()
    for byte in data:
        try:
            sock.send(bytes([byte]))
        except OSError:
            break
        if select.select([sock], [], [], every)[0]:
            break
    return time.monotonic() - start, read_all(sock)


def post_headers(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def wait_for(condition, timeout: float = 30.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(every)
    return condition()


def health(server: ServerProcess, timeout: float = 3.0) -> int | None:
    try:
        return httpx.get(server.url + "/health", timeout=timeout).status_code
    except httpx.TransportError:
        return None


def test_headers_trickled_in_are_cut_off_at_the_header_timeout(quick):
    """A byte every 0.5 s (a per-read timeout of a second would never fire) is answered 408 and closed at about
    2 s; a connection that sends nothing is closed then too, silently."""
    idle = connect(quick)
    with connect(quick) as slow:
        seconds, reply = trickle(slow, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100, every=0.5)
    assert 1.5 < seconds < 6, seconds
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b'"request_timeout"' in reply and b"connection: close" in reply.lower()
    assert read_all(idle) == b""  # closed by now, without a reply
    idle.close()
    assert wait_for(lambda: "request headers took over 2 s (--header-timeout)" in quick.output())
    assert quick.output().count("--header-timeout") == 1  # the idle connection is not worth a line
    assert health(quick) == 200


def test_a_body_trickled_in_is_cut_off_at_the_body_timeout(quick):
    with connect(quick) as slow:
        slow.sendall(post_headers(len(COMPLETION) + 200))
        seconds, reply = trickle(slow, COMPLETION + b" " * 200, every=0.5)
    assert 1.5 < seconds < 6, seconds
    assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 2 s" in reply, reply
    assert wait_for(lambda: "request body took over 2 s (--body-timeout)" in quick.output())
    reply = httpx.post(quick.url + "/v1/completions", content=COMPLETION, timeout=30)  # a whole body still works
    assert reply.status_code == 200, reply.text


def test_clients_hanging_up_mid_upload_cost_one_line_and_a_count(run_dir, tmp_path):
    server = ServerProcess(run_dir, tmp_path / "server.log")
    try:
        for _ in range(5):
            with connect(server) as sock:
                sock.sendall(post_headers(1000) + COMPLETION[:10])
                time.sleep(0.2)
        assert wait_for(lambda: "hung up" in server.output())
        assert health(server) == 200
    finally:
        server.stop()
    log = server.output()
    assert "Traceback" not in log and "ClientDisconnect" not in log, log
    line = "a client hung up before sending its whole request body (POST /v1/completions)"
    assert log.count(line) == 2, log  # the first, then the count said as the server stops
    assert "4 more like this in the last" in log, log


def test_the_connection_cap_keeps_health_answering(run_dir, tmp_path):
    """--max-connections 3: with 3 connections held open, /health still answers (from the reserve) and a
    completion gets 503 server_busy; with the reserve full too, a new connection is closed at once; once they go,
    everything is served again."""
    server = ServerProcess(run_dir, tmp_path / "server.log", "--max-connections", "3", "--header-timeout", "60")
    held = []
    try:
        for _ in range(3):
            held.append(connect(server))
            held[-1].sendall(b"GET /health HTTP/1.1\r\n")  # headers begun, never finished
        time.sleep(0.5)
        reply = httpx.get(server.url + "/health", timeout=5)
        assert reply.status_code == 200 and reply.headers["connection"] == "close"
        busy = httpx.post(server.url + "/v1/completions", content=COMPLETION, timeout=5)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy", busy.text
        for _ in range(8):  # the reserve
            held.append(connect(server))
            held[-1].sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.5)
        with connect(server) as refused:
            start = time.monotonic()
            assert read_all(refused) == b""
            assert time.monotonic() - start < 2
    finally:
        for sock in held:
            sock.close()
    assert wait_for(lambda: health(server) == 200)
    assert httpx.post(server.url + "/v1/completions", content=COMPLETION, timeout=30).status_code == 200
    server.stop()
    log = server.output()
    assert "Traceback" not in log, log
    assert log.count("over 3 connections (--max-connections, and 8 more for /health)") == 1, log


def lower_file_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))


@pytest.mark.slow
def test_a_low_file_limit_lowers_the_cap_and_the_log_stays_small(run_dir, tmp_path):
    """ulimit -n 96 and 300 connections at once (the log grew by megabytes before): the cap is lowered to fit,
    the connections past it are closed, and /health answers once they are gone."""
    server = ServerProcess(run_dir, tmp_path / "server.log", preexec_fn=lower_file_limit)
    try:
        assert "note: --max-connections 256 lowered to" in server.output()
        socks = [connect(server) for _ in range(300)]
        time.sleep(2)
        for sock in socks:
            sock.close()
        assert wait_for(lambda: health(server) == 200), server.output()
    finally:
        server.stop()
    log = server.output()
    assert "Traceback" not in log and "cannot accept" not in log, log
    assert len(log) < 5_000 and log.count("\n") < 12, log


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(resource, "prlimit") or not os.path.isdir("/proc/self/fd"), reason="needs Linux")
def test_out_of_file_descriptors_neither_spins_nor_floods_the_log(run_dir, tmp_path):
    """The file limit lowered under a running server (so the cap, sized at start, no longer fits) and 200
    connections: accept() fails with EMFILE. The server pauses accepting (no busy loop), logs it in one line with
    a count, and serves /health again once the connections close."""
    server = ServerProcess(run_dir, tmp_path / "server.log", "--max-connections", "500")
    pid = server.proc.pid
    try:
        in_use = len(os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 30, in_use + 30))
        socks = [connect(server) for _ in range(200)]
        time.sleep(1)
        before = cpu_seconds(pid)
        time.sleep(4)
        assert cpu_seconds(pid) - before < 0.3  # a spinning accept loop takes all of 4 s (measured: 0.01 s)
        for sock in socks:
            sock.close()
        assert wait_for(lambda: health(server) == 200), server.output()
    finally:
        server.stop()
    log = server.output()
    assert "Traceback" not in log and "socket.accept() out of system resource" not in log, log
    assert "cannot accept more connections (Too many open files): new ones wait until some close" in log, log
    assert "more like this in the last" in log, log
    assert len(log) < 5_000, log


def test_the_log_filter_writes_a_kind_once_per_window_and_counts_the_rest(caplog):
    """In-process: 5 records of one kind and 2 of another in a 1 s window give 2 lines (one traceback), then
    each kind's count when the window ends."""
    import logging

    from nanoforge.serve.repeats import RepeatFilter

    logger = logging.getLogger("nanoforge.test_repeats")
    with caplog.at_level(logging.WARNING), RepeatFilter(window=1.0).installed([logger.name]):
        for path in ["/a", "/b", "/c", "/d", "/e"]:
            try:
                raise ValueError(path)
            except ValueError:
                logger.exception("failed serving %s", path)
        logger.warning("hung up (%s)", "POST /x")
        logger.warning("hung up (%s)", "POST /y")
        assert [r.getMessage() for r in caplog.records] == ["failed serving /a", "hung up (POST /x)"]
        time.sleep(1.5)
        said = sorted(r.getMessage() for r in caplog.records[2:])
    assert said == ["1 more like this in the last 1 s: hung up (POST /x)",
                    "4 more like this in the last 1 s: failed serving /a"]
    assert sum(r.exc_info is not None for r in caplog.records) == 1
