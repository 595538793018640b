"""A hostile client against real server processes on loopback, at the HTTP level: a web page of
another site posting to the server (Origin, CORS), a client that leaves mid-upload, unbounded
/tokenize, connections that never finish their request head, a stuck scheduler step, a dead
scheduler. One server with default flags (a short header_timeout aside) serves every test but the
CORS-on one, in an order where the scheduler kill comes last.

Servers run a tiny random Llama through tests/server_helpers.py's hang_server_main: fault_hooks'
"slow-" requests, plus "hang-" requests whose first step takes HANG_STEP_S.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import time
from http.client import HTTPConnection
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_helpers import (
    HANG_STEP_S,
    assert_error,
    assert_healthy,
    gen,
    hang_server_main,
    metric,
    output_to,
    start,
    wait_idle,
    wait_in_flight,
)

from radixlm.server.launch import launch
from radixlm.server.server_args import ServerArgs

pytestmark = pytest.mark.slow

FOREIGN = "http://evil.example"
HEADER_TIMEOUT = 2.0
CONTEXT = 512  # the tiny model's
LIMIT = 4 + 4  # max_running_requests + max_queued_requests: the per-call (de)tokenize limit too


@pytest.fixture(scope="module")
def tiny(make_tiny_model) -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("log") / "server.log"


@pytest.fixture(scope="module")
def server(tiny, log_path):
    args = ServerArgs(model=str(tiny), port=0, log_level="warning", header_timeout=HEADER_TIMEOUT,
                      max_total_tokens=1024, max_running_requests=4, max_queued_requests=4)
    with output_to(log_path):
        handle = launch(args, hang_server_main)
    yield handle
    handle.shutdown()


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def cors_headers(r: httpx.Response) -> set[str]:
    return {k.lower() for k in r.headers if k.lower().startswith("access-control-")}


# --------------------------------------------------------------------------- 1: Origin and CORS
def test_a_cross_site_simple_post_is_refused_before_it_runs(server, http):
    finished = metric(http, "radixlm_request_finished_total")
    page = {"Origin": FOREIGN, "Content-Type": "text/plain"}  # a "simple" request: the browser sends no preflight
    for path, body in (("/generate", gen()), ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/abort_request", {"abort_all": True})):
        r = http.post(path, content=json.dumps(body), headers=page)
        assert assert_error(r, 403, "origin")["code"] == "origin_not_allowed", path
        assert not cors_headers(r), r.headers
    assert http.post("/generate", json=gen()).status_code == 200  # no Origin (curl, SDKs): unaffected
    cached = wait_idle(http)["cache"]["evictable_size"]
    assert cached > 0
    assert_error(http.post("/flush_cache", content=b"", headers=page), 403, "origin")
    assert_error(http.post("/flush_cache", content=b"", headers={"Origin": "null"}), 403, "origin")  # sandboxed page
    assert wait_idle(http)["cache"]["evictable_size"] == cached, "a cross-site page flushed the cache"
    assert metric(http, "radixlm_request_finished_total") == finished + 1, "a cross-site page ran a generation"


def test_the_servers_own_origin_is_allowed_and_foreign_preflights_get_no_grant(server, http):
    r = http.post("/generate", json=gen(), headers={"Origin": server.url})  # a page this server serves
    assert r.status_code == 200, r.text
    pre = http.options("/generate", headers={"Origin": FOREIGN, "Access-Control-Request-Method": "POST",
                                             "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 403 and not cors_headers(pre), pre.headers


def test_allowed_origins_star_lets_any_page_in_without_credentials(tiny):
    handle = start(tiny, allowed_origins="*")
    try:
        with httpx.Client(base_url=handle.url, timeout=120) as client:
            r = client.post("/generate", content=json.dumps(gen()), headers={"Origin": FOREIGN,
                                                                            "Content-Type": "text/plain"})
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == "*"
            pre = client.options("/generate", headers={"Origin": FOREIGN, "Access-Control-Request-Method": "POST"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
            for answer in (r, pre):
                assert "access-control-allow-credentials" not in answer.headers, answer.headers
    finally:
        handle.shutdown()


def test_named_allowed_origins_get_cors_with_credentials_and_others_are_refused():
    """The app in-process (no runtime behind /health): a named origin is echoed, with credentials."""
    from starlette.testclient import TestClient

    from radixlm.server.app import cors_options, create_app
    from radixlm.server.metrics import Metrics
    from radixlm.server.tokenizer_manager import Arrivals

    assert cors_options("") is None and cors_options(" , ") is None
    assert cors_options("*")["allow_credentials"] is False
    assert cors_options("http://a.example,*")["allow_credentials"] is False
    tm = SimpleNamespace(args=ServerArgs(allowed_origins="http://app.example, http://b.example"),
                         metrics=Metrics(), failed=None, scheduler_stalled=lambda: None, arrivals=Arrivals())
    client = TestClient(create_app(tm, "m"), base_url="http://127.0.0.1:8000")
    r = client.get("/health", headers={"Origin": "http://app.example"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    pre = client.options("/generate", headers={"Origin": "http://b.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://b.example"
    for origin in (FOREIGN, "http://app.example.evil.example", "http://127.0.0.1:8001", "http://127.0.0.1"):
        r = client.get("/health", headers={"Origin": origin})
        assert r.status_code == 403 and not cors_headers(r), origin
    for origin in ("http://127.0.0.1:8000", "HTTP://127.0.0.1:8000"):  # its own origin
        assert client.get("/health", headers={"Origin": origin}).status_code == 200, origin
    default_port = TestClient(create_app(tm, "m"), base_url="http://localhost")
    assert default_port.get("/health", headers={"Origin": "http://localhost"}).status_code == 200
    assert default_port.get("/health", headers={"Origin": "http://localhost:80"}).status_code == 200


# --------------------------------------------------------------------------- 2: a client gone mid-upload
def test_a_client_that_leaves_mid_upload_is_a_499_without_a_traceback(server, http, log_path):
    counts = {s: metric(http, "radixlm_requests_total", route="/generate", status=s) for s in ("499", "500")}
    logged = log_path.stat().st_size
    with socket.create_connection(address(server)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + json.dumps(gen()).encode()[:20])
        time.sleep(0.5)  # the route is reading the body by now
    deadline = time.monotonic() + 30
    now = counts
    while now == counts:
        assert time.monotonic() < deadline, "the upload that was cut short was never counted"
        time.sleep(0.1)
        now = {s: metric(http, "radixlm_requests_total", route="/generate", status=s) for s in counts}
    assert now == {"499": counts["499"] + 1, "500": counts["500"]}
    with open(log_path, "rb") as f:
        f.seek(logged)
        new = f.read().decode(errors="replace")
    assert "Traceback" not in new and "ERROR" not in new and len(new.splitlines()) <= 1, new
    assert_healthy(http)


# --------------------------------------------------------------------------- 3: /tokenize and /detokenize bounds
def test_tokenize_and_detokenize_take_as_many_entries_as_a_generate_batch(http):
    for path, body, param in (("/tokenize", {"prompt": ["a"] * (LIMIT + 1)}, "prompt"),
                              ("/v1/tokenize", {"prompt": ["a"] * 100_000}, "prompt"),
                              ("/detokenize", {"tokens": [[1]] * (LIMIT + 1)}, "tokens")):
        count = len(body[param])
        assert_error(http.post(path, json=body), 400, f"{count} entries", f"limit per call is {LIMIT}", param=param)
    assert_error(http.post("/detokenize", json={"tokens": [[1], [1, -1]]}), 400, "-1", param="tokens")
    ok = http.post("/tokenize", json={"prompt": ["hello world"] * LIMIT})
    assert ok.status_code == 200 and ok.json()["count"] == [2] * LIMIT
    assert http.post("/detokenize", json={"tokens": ok.json()["tokens"]}).json()["text"] == ["hello world"] * LIMIT
    # one text longer than the context is still counted (as vLLM and SGLang do): max_request_bytes bounds it
    assert http.post("/tokenize", json={"prompt": "word " * (4 * CONTEXT)}).json()["count"] >= 4 * CONTEXT


# --------------------------------------------------------------------------- 3b: large bodies and the store
def health_latencies(http: httpx.Client, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start_at = time.perf_counter()
        assert http.get("/health").status_code == 200
        times.append(time.perf_counter() - start_at)
        time.sleep(0.005)
    return times


FLOODS = {  # bodies under max_request_bytes that once held the event loop for seconds (8 at a time)
    "/v1/chat/completions": json.dumps({"messages": [{"role": "user", "content": ""}] * 70_000}).encode(),
    "/v1/responses": json.dumps({"input": [{"type": "reasoning", "summary": [], "encrypted_content": ""}]
                                 * 45_000}).encode(),
    "/v1/chat/completions ": json.dumps({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {
            "type": "object", "properties": {"a": {"type": "string"}}}}} for i in range(2000)]}).encode(),
}


@pytest.mark.parametrize("path", list(FLOODS))
def test_large_bodies_never_stall_health(server, http, path):
    """Bodies are decoded, counted, validated and converted on tokenizer threads, so /health answers
    beside a flood of them about as fast as alone (on the event loop it took up to 1,000x as long)."""
    def post(_) -> httpx.Response:
        return httpx.post(server.url + path.strip(), content=FLOODS[path], timeout=120,
                          headers={"content-type": "application/json"})

    alone = sorted(health_latencies(http, 20))[10]
    with cf.ThreadPoolExecutor(8) as pool:
        flood = [pool.submit(post, i) for i in range(8)]
        during = health_latencies(http, 40)
        answers = [f.result() for f in flood]
    assert {r.status_code for r in answers} == {400}, answers[0].text
    # Two of the 40 may be slow: on a busy 2-core machine the OS can deschedule the server for a few hundred
    # ms whatever it runs. A body parsed on the event loop stalls one sample per body (8 here), so the
    # third-slowest still shows it.
    third_slowest = sorted(during)[-3]
    assert third_slowest < 100 * alone, (f"/health took {third_slowest * 1e3:.0f} ms (third-slowest of 40) beside "
                                         f"the flood, {alone * 1e3:.1f} ms alone")


def rss_peak_since(pid: int, action) -> int:
    """Bytes the process's resident set grew to above where it stood, while `action` ran."""
    def status(key: str) -> int:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) * 1024

    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
    before = status("VmRSS:")
    action()
    return status("VmHWM:") - before


def test_a_stored_conversation_is_not_copied_per_request(server, http):
    """Reasoning items never reach this model: they are not kept in the store, so a chain of turns
    that each send a large encrypted_content stays small, and requests continuing it cost the server a
    small fraction of what they name (16 such once decoded a 58 MiB conversation each: 1.3 GB)."""
    payload = "x" * 3_000_000
    previous, sent = None, 0
    for turn in range(3):
        body = {"input": [{"type": "reasoning", "summary": [], "encrypted_content": payload},
                          {"role": "user", "content": f"turn {turn}"}], "max_output_tokens": 1,
                "previous_response_id": previous}
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200 and r.json()["store"] is True, r.text
        previous, sent = r.json()["id"], sent + len(payload)

    def continue_it() -> None:  # as many at once as the server holds (LIMIT)
        body = {"input": "and now?", "max_output_tokens": 1, "previous_response_id": previous, "store": False}
        with cf.ThreadPoolExecutor(LIMIT) as pool:
            statuses = list(pool.map(lambda _: httpx.post(server.url + "/v1/responses", json=body, timeout=120)
                                     .status_code, range(LIMIT)))
        assert statuses == [200] * LIMIT

    grown = rss_peak_since(server.process.pid, continue_it)
    assert grown < 0.05 * LIMIT * sent, f"{LIMIT} continuations grew the server by {grown / 2**20:.0f} MiB"
    wait_idle(http)


def test_a_conversation_larger_than_a_request_is_refused_before_it_is_decoded(http):
    """Fields the model never sees (a message's id) still reach the store; a conversation past
    max_request_bytes cannot be continued, so no request pulls more from the store than it could send."""
    big_id = "m" * (3 * 2**20)
    previous = None
    for _ in range(2):
        r = http.post("/v1/responses", json={"input": [{"type": "message", "role": "user", "content": "hi",
                                                        "id": big_id}], "max_output_tokens": 1,
                                             "previous_response_id": previous})
        assert r.status_code == 200, r.text
        previous = r.json()["id"]
    r = http.post("/v1/responses", json={"input": "more", "previous_response_id": previous, "max_output_tokens": 1})
    err = assert_error(r, 400, "max_request_bytes", param="previous_response_id")
    assert err["code"] == "conversation_too_large"


# --------------------------------------------------------------------------- 4: request heads that never end
def test_connections_that_never_finish_their_request_head_are_closed(server, http):
    heads = [b"", b"POST /generate HT", b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"] * 10
    socks = [socket.create_connection(address(server)) for _ in heads]
    keep_alive = HTTPConnection(*address(server), timeout=60)  # a next request on a kept-alive connection
    keep_alive.request("GET", "/health")
    assert keep_alive.getresponse().read()
    keep_alive.sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    socks.append(keep_alive.sock)
    try:
        for s, head in zip(socks, heads):
            s.sendall(head)
        for s in socks:
            s.settimeout(60)  # far past header_timeout: only a server that never closes gets here
            try:
                assert s.recv(1024) == b""
            except TimeoutError:
                pytest.fail(f"a connection with an unfinished request head is still open after 60s (header_timeout "
                            f"{HEADER_TIMEOUT}s)")
    finally:
        for s in socks:
            s.close()
    assert_healthy(http)


# --------------------------------------------------------------------------- 5: /health notices a stuck step
def test_health_is_503_while_a_scheduler_step_is_stuck(http):
    seen: dict[int, dict] = {}
    with cf.ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(http.post, "/generate", json=gen(rid="hang-1", sampling_params={"max_new_tokens": 2}))
        while not stuck.done():
            r = http.get("/health")
            seen.setdefault(r.status_code, r.json())
            time.sleep(0.25)
        assert stuck.result().status_code == 200
    assert 503 in seen, f"/health answered {sorted(seen)} throughout a step stuck for {HANG_STEP_S}s"
    assert seen[503]["error"]["code"] == "scheduler_stalled"
    assert_healthy(http)  # and healthy again once the step ends


# --------------------------------------------------------------------------- 6: a dead scheduler (last)
def kill_scheduler(http: httpx.Client) -> int:
    pid = http.get("/server_info").json()["scheduler_pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_restarted(server, http: httpx.Client, old_pid: int) -> None:
    """Until a new scheduler answers; meanwhile every answer is a 503 saying what happens."""
    deadline = time.monotonic() + 120
    while (r := http.get("/server_info")).status_code != 200:
        assert r.status_code == 503 and "restarted" in r.json()["error"]["message"], r.text
        assert time.monotonic() < deadline and server.process.is_alive(), "the server did not come back"
        time.sleep(0.2)
    assert r.json()["scheduler_pid"] != old_pid


def test_a_dead_scheduler_is_restarted_and_only_its_requests_fail(server, http):
    with cf.ThreadPoolExecutor(1) as pool:
        lost = pool.submit(http.post, "/generate", json={"text": "hi", "rid": "slow-lost", "sampling_params": {
            "max_new_tokens": 300, "ignore_eos": True}})
        wait_in_flight(http, 1, [lost])
        pid = kill_scheduler(http)
        assert_error(lost.result(), 500, "died", "retry")
    wait_restarted(server, http, pid)
    assert metric(http, "radixlm_scheduler_restarts_total") == 1
    assert_healthy(http)


def test_a_scheduler_that_keeps_dying_takes_the_server_down(server, http):
    """No crash loop: the death after MAX_RESTARTS restarts (within RESTART_WINDOW_S) ends the server."""
    from radixlm.server.launch import MAX_RESTARTS

    for _ in range(MAX_RESTARTS - int(metric(http, "radixlm_scheduler_restarts_total"))):
        wait_restarted(server, http, kill_scheduler(http))
    kill_scheduler(http)
    server.process.join(60)
    assert server.process.exitcode == 1, "the HTTP process should exit with an error"
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)
