"""Fault injection against real server processes on loopback (issue 13: bounded resources, clean
fault paths). Each test reproduces one defect; after each, /health is honest, a normal request
succeeds and nothing stays in flight (assert_healthy).

Servers run a tiny random Llama (fast to load and to run) through tests/fault_hooks.py, which makes
"fault500-" / "fault400-" requests fail inside the runtime, "slow-" requests slow, and the HTTP
side of "crash-" requests raise.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import time
from http.client import HTTPConnection
from pathlib import Path

import httpx
import pytest
from server_helpers import (
    CHAT,
    HI,
    assert_error,
    assert_healthy,
    chat,
    env,
    gen,
    post_raw,
    sse_events,
    start,
    wait_in_flight,
)

from radixlm.server.server_args import ServerArgs

pytestmark = pytest.mark.slow

POOL = 400  # KV pool tokens: smaller than the tiny model's 512-token context
MAX_IN_FLIGHT = 8  # max_running_requests + max_queued_requests
KEY = "sk-from-a-file"


@pytest.fixture(scope="module")
def tiny(make_tiny_model) -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def server(tiny):
    handle = start(tiny, max_total_tokens=POOL, max_running_requests=4, max_queued_requests=4)
    yield handle
    handle.shutdown()


def test_a_500_keeps_the_keep_alive_connection(server, http):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = HTTPConnection(host, int(port), timeout=60)
    try:
        for i in range(3):
            for path, body in (("/generate", gen(rid=f"crash-{i}")), (CHAT, chat(max_tokens=8, rid=f"fault500-{i}"))):
                status, out = post_raw(conn, path, body)
                assert status == 500, out
                assert out["error"]["type"] == "server_error" and set(out["error"]) == {"message", "type", "param",
                                                                                        "code"}
                sock = conn.sock
                assert sock is not None, "the server asked to close the connection"
                status, out = post_raw(conn, "/generate", gen())
                assert status == 200, out
                assert conn.sock is sock, "the next request needed a new connection"
    finally:
        conn.close()
    assert_healthy(http)


def test_an_exception_mid_stream_ends_with_an_error_event(http):
    events = sse_events(http, "/generate", gen(rid="crash-stream", stream=True))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"
    assert_healthy(http)


# --------------------------------------------------------------------------- runtime aborts: 500 and 400
@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/generate"])
def test_a_failure_inside_the_runtime_is_a_json_500(http, path):
    body = {CHAT: chat(max_tokens=8), "/v1/completions": {"prompt": "hi", "max_tokens": 8},
            "/generate": gen(sampling_params={"max_new_tokens": 8})}[path]
    assert_error(http.post(path, json={**body, "rid": "fault500-plain"}), 500, "injected fault")
    events = sse_events(http, path, {**body, "rid": "fault500-stream", "stream": True})
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error" and "injected fault" in events[-2]["error"]["message"]
    assert not any("error" in e for e in events[:-2] if isinstance(e, dict))
    assert_healthy(http)


@pytest.mark.parametrize("path, param", [(CHAT, "stop_regex"), ("/generate", "sampling_params.stop_regex")])
def test_a_refusal_inside_the_runtime_is_a_400_naming_the_field(http, path, param):
    body = chat(max_tokens=8) if path == CHAT else gen(sampling_params={"max_new_tokens": 8})
    assert_error(http.post(path, json={**body, "rid": "fault400-plain"}), 400, "injected refusal", param=param)
    events = sse_events(http, path, {**body, "rid": "fault400-stream", "stream": True})
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "invalid_request_error"
    assert_healthy(http)


# --------------------------------------------------------------------------- 4: huge prompts
def test_huge_prompts_are_refused_before_tokenizing(http):
    huge = "word " * 780_000  # 3.9 MB
    cases = [(CHAT, {"messages": [{"role": "user", "content": huge}]}, "messages"),
             ("/v1/completions", {"prompt": huge}, "prompt"), ("/generate", {"text": huge}, "text"),
             ("/generate", {"text": [huge[:1000], huge]}, "text")]
    with cf.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda c: http.post(c[0], json=c[1]), cases))
    for (_, _, param), r in zip(cases, answers):
        # "characters": refused by the size pre-check, never tokenized ("tokens" would come after tokenizing)
        assert_error(r, 400, "3900000 characters", "context length", param=param)
    assert_healthy(http)


def test_tokenizing_runs_off_the_event_loop(http):
    with cf.ThreadPoolExecutor(1) as pool:
        big = pool.submit(http.post, "/tokenize", json={"prompt": "word " * 780_000})
        answered_meanwhile = 0
        while not big.done():
            if http.get("/health").status_code == 200 and not big.done():
                answered_meanwhile += 1
            time.sleep(0.1)
        assert big.result().json()["count"] >= 780_000
    assert answered_meanwhile >= 2, "the event loop stalled while a big prompt was tokenized"
    assert_healthy(http)


# --------------------------------------------------------------------------- 7: requests that can never fit
def test_requests_that_can_never_fit_are_400_naming_the_limit(http):
    # fits the 512-token context, not the 400-token KV pool
    assert_error(http.post(CHAT, json=chat(max_tokens=450)), 400, "KV pool", "max_total_tokens", param="max_tokens")
    assert_error(http.post("/generate", json=gen(sampling_params={"max_new_tokens": 450})), 400, "KV pool",
                 param="sampling_params.max_new_tokens")
    many = ["hi"] * 10_000
    assert_error(http.post("/generate", json={"text": many}), 400, "10000 generations", "max_queued_requests",
                 param="text")
    assert_error(http.post("/generate", json={"input_ids": [[1, 2]] * 10_000}), 400, "10000", param="input_ids")
    assert_error(http.post("/v1/completions", json={"prompt": many}), 400, "10000", param="prompt")
    assert_error(http.post(CHAT, json=chat(n=MAX_IN_FLIGHT + 1)), 400, "generations", param="n")
    assert_error(http.post("/generate", json=gen(sampling_params={"n": MAX_IN_FLIGHT + 1})), 400, "generations",
                 param="sampling_params.n")
    # without max_tokens, chat asks for the room left in the pool (not the larger context): it runs
    r = http.post(CHAT, json={"messages": HI, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == POOL
    assert_healthy(http)


# --------------------------------------------------------------------------- 8: stop lists
def test_stop_lists_are_bounded(http):
    assert_error(http.post(CHAT, json=chat(stop=[f"s{i}" for i in range(100_000)])), 400, "100000 entries",
                 param="stop")
    assert_error(http.post(CHAT, json=chat(stop="x" * 300)), 400, "300 characters", param="stop")
    assert_error(http.post("/generate", json=gen(sampling_params={"stop": ["ok", "y" * 300]})), 400, "300 characters",
                 param="sampling_params.stop")
    assert http.post(CHAT, json=chat(stop=[f"s{i}" for i in range(64)])).status_code == 200
    assert_healthy(http)


# --------------------------------------------------------------------------- 9: Host check, POST-only
def test_without_a_key_the_host_header_must_name_this_server(server, http):
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", f"rebind.attacker.test.:{port}"):
        r = http.get("/v1/models", headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", f"[::1]:{port}"):
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host
    assert_healthy(http)


def test_state_changing_routes_are_post_only(http):
    assert http.get("/flush_cache").status_code == 405
    assert http.get("/abort_request").status_code == 405
    assert http.post("/flush_cache").json()["success"] is True
    assert_healthy(http)


# --------------------------------------------------------------------------- 10: /openapi.json
def test_openapi_documents_request_bodies_and_metrics(http):
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    bodies = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
              "/generate": "GenerateRequest", "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest",
              "/abort_request": "AbortRequest", "/apply_chat_template": "ApplyChatTemplateRequest"}
    for path, model in bodies.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert schemas[model]["properties"], model
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert "max_new_tokens" in schemas["SamplingParams"]["properties"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------------------- lifecycle server: 8, 9, 5
@pytest.fixture(scope="module")
def ipc_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ipc")


@pytest.fixture(scope="module")
def lifecycle(tiny, ipc_root, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    with env(TMPDIR=str(ipc_root)):  # the server's ipc folder goes here: the SIGTERM test checks it is removed
        handle = start(tiny, api_key_file=str(key_file), max_request_seconds=5, drain_timeout=1, default_max_tokens=5)
    assert list(ipc_root.glob("radixlm-*")), "the ipc folder was not created where expected"
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def life_http(lifecycle):
    with httpx.Client(base_url=lifecycle.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def test_api_key_from_a_file(lifecycle, life_http):
    assert lifecycle.api_key == KEY
    assert httpx.post(lifecycle.url + "/generate", json=gen(), timeout=30).status_code == 401
    info = life_http.get("/server_info").json()
    assert KEY not in json.dumps(info) and "api_key" not in info and "api_key_file" not in info
    # the server's own options beside the engine's (SGLang's /server_info carries both)
    assert info["default_max_tokens"] == 5 and info["max_request_seconds"] == 5 and info["host"] == "127.0.0.1"
    assert info["chunked_prefill_size"] == 2048
    assert_healthy(life_http)


def test_api_key_from_the_environment_or_a_file_stays_off_the_command_line(tmp_path, monkeypatch):
    import argparse

    from radixlm.server.launch import ServerStartError, resolve_api_key

    monkeypatch.setenv("RADIXLM_API_KEY", "sk-env")
    assert resolve_api_key(ServerArgs()).api_key == "sk-env"
    assert resolve_api_key(ServerArgs(api_key="sk-flag")).api_key == "sk-flag"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    (tmp_path / "k").write_text("sk-file\nignored\n")
    args = ServerArgs.from_cli(parser.parse_args(["--api-key-file", str(tmp_path / "k")]))
    assert resolve_api_key(args).api_key == "sk-file"
    (tmp_path / "empty").write_text("\n")
    for bad in (ServerArgs(api_key_file=str(tmp_path / "empty")), ServerArgs(api_key_file=str(tmp_path / "none")),
                ServerArgs(api_key="a", api_key_file=str(tmp_path / "k"))):
        with pytest.raises(ServerStartError):
            resolve_api_key(bad)


def test_chat_without_max_tokens_is_capped_by_default_max_tokens(life_http):
    r = life_http.post(CHAT, json={"messages": HI, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 5
    assert_healthy(life_http)


def test_max_request_seconds_stops_a_long_request(lifecycle, life_http):
    slow = chat(max_tokens=300, ignore_eos=True)  # 300 slow steps: far past the 5 s limit
    with cf.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(life_http.post, CHAT, json={**slow, "rid": "slow-plain"})
        stream = pool.submit(sse_events, life_http, CHAT, {**slow, "rid": "slow-stream", "stream": True})
        assert_error(plain.result(), 504, "max_request_seconds")
        events = stream.result()
    assert events[-1] == "[DONE]" and "max_request_seconds" in events[-2]["error"]["message"]
    assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[:-2]), "no partial output"
    assert_healthy(life_http)


# --------------------------------------------------------------------------- 5: SIGTERM (last: stops the server)
def test_sigterm_gives_every_client_a_final_error_then_exits_cleanly(lifecycle, life_http, ipc_root):
    slow = chat(max_tokens=300, ignore_eos=True)
    with cf.ThreadPoolExecutor(3) as pool:
        plain = pool.submit(life_http.post, CHAT, json={**slow, "rid": "slow-a"})
        stream = pool.submit(sse_events, life_http, CHAT, {**slow, "rid": "slow-b", "stream": True})
        native = pool.submit(sse_events, life_http, "/generate",
                             {"text": "hi", "rid": "slow-c", "stream": True,
                              "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})
        wait_in_flight(life_http, 3, [plain, stream, native])
        os.kill(lifecycle.process.pid, signal.SIGTERM)
        assert_error(plain.result(), 503, "shutting down", "drain window")
        for events in (stream.result(), native.result()):
            assert events[-1] == "[DONE]", events[-3:]
            assert events[-2]["error"]["type"] == "service_unavailable_error", events[-2]
    lifecycle.process.join(60)
    assert lifecycle.process.exitcode == 0
    assert not list(ipc_root.glob("radixlm-*")), "the ipc folder was left behind"


# --------------------------------------------------------------------------- 6: kill -9 of the HTTP process
def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_children_stop_and_clean_up_when_the_http_process_is_killed(tiny, tmp_path):
    with env(TMPDIR=str(tmp_path)):
        handle = start(tiny)
    children = _children(handle.process.pid)
    try:
        client = httpx.Client(base_url=handle.url, timeout=120)
        assert client.get("/server_info").json()["scheduler_pid"] in children and len(children) == 2
        with cf.ThreadPoolExecutor(1) as pool:
            long = pool.submit(client.post, "/generate", json={"text": "hi", "rid": "slow-long", "sampling_params": {
                "max_new_tokens": 300, "ignore_eos": True}})
            wait_in_flight(client, 1, [long])
            os.kill(handle.process.pid, signal.SIGKILL)
            with pytest.raises(httpx.TransportError):
                long.result()
        deadline = time.monotonic() + 20
        while any(map(_running, children)):
            assert time.monotonic() < deadline, "a child kept running after its parent was killed"
            time.sleep(0.1)
        assert not list(tmp_path.glob("radixlm-*")), "the ipc folder was left behind"
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        handle.process.join(5)
