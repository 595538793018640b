"""Helpers for the tests that drive real server processes (test_server_faults.py and
test_server_grammar_limits.py): request bodies, waiting, and the after-each health check."""

from __future__ import annotations

import contextlib
import json
import os
import time
from http.client import HTTPConnection
from pathlib import Path

import fault_hooks
import httpx

from radixlm.server.launch import launch
from radixlm.server.server_args import ServerArgs

HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def gen(**fields) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **fields}


def chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 4, "temperature": 0, **fields}


@contextlib.contextmanager
def env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start(model: Path, **kwargs):
    return launch(ServerArgs(model=str(model), port=0, log_level="warning", **kwargs), fault_hooks.server_main)


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/server_info").json()
        if info["num_running"] == 0 and info["num_waiting"] == 0 and info["in_flight"] == 0:
            return info
        assert time.monotonic() < deadline, f"server never went idle: {info}"
        time.sleep(0.05)


def wait_in_flight(http: httpx.Client, count: int, futures=(), timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while http.get("/server_info").json()["in_flight"] < count:
        assert time.monotonic() < deadline and not any(f.done() for f in futures), "requests never got in flight"
        time.sleep(0.05)


def assert_healthy(http: httpx.Client) -> None:
    """/health honest, nothing in flight, no KV held, and a normal request goes through."""
    assert http.get("/health").json() == {"status": "ok"}
    info = wait_idle(http)
    assert info["cache"]["protected_size"] == 0, "a finished request still locks cache nodes"
    assert info["free_slots"] + info["cache"]["evictable_size"] == info["max_total_tokens"], "KV slots leaked"
    assert info["kv_check"] == "ok", info["kv_check"]
    r = http.post("/generate", json=gen())
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word.lower() in error["message"].lower(), (word, error)
    if param is not None:
        assert error["param"] == param, error
    return error


def sse_events(client: httpx.Client, path: str, body: dict, **kwargs) -> list:
    """The parsed data lines of an SSE response ("[DONE]" as the string)."""
    events = []
    with client.stream("POST", path, json=body, **kwargs) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def post_raw(conn: HTTPConnection, path: str, body: dict) -> tuple[int, dict]:
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


# --------------------------------------------------------------------------- 1: a 500 keeps the connection


# --------------------------------------------------------------------------- a stuck scheduler, server logs
HANG_STEP_S = 12.0  # far past the default --health-stall-timeout (5 s)


def hang_server_main(args_dict: dict, ready_conn) -> None:
    """A launch target: fault_hooks' scheduler faults, plus a "hang-" request whose first step
    takes HANG_STEP_S (a stuck scheduler loop). Restarted schedulers get the same hooks."""
    from radixlm.server import children
    from radixlm.server.launch import _server_main

    children.CHILD_MAINS["scheduler"] = f"{__name__}:run_hang_scheduler"  # start_children reads it at call time
    _server_main(args_dict, ready_conn)


def run_hang_scheduler(args_dict: dict, addrs: dict, ready_conn) -> None:
    from radixlm.runtime.scheduler.scheduler import Scheduler

    real_advance = Scheduler._advance

    def advance(self, req, token, out, i):
        if req.rid.startswith("hang-") and not req.output_ids:
            time.sleep(HANG_STEP_S)
        real_advance(self, req, token, out, i)

    Scheduler._advance = advance
    fault_hooks.run_scheduler(args_dict, addrs, ready_conn)


@contextlib.contextmanager
def output_to(path: Path):
    """Processes started inside write their stdout and stderr (their log) to `path`."""
    with open(path, "ab") as f:
        saved = [os.dup(1), os.dup(2)]
        try:
            for fd in (1, 2):
                os.dup2(f.fileno(), fd)
            yield
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """The sum of a /metrics series over the label values not given."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total
