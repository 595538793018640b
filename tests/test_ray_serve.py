"""Scale-out on Ray Serve, end to end on CPU: `radixlm serve --replicas 2` with its private local Ray,
two replicas of a tiny random Llama (one torch thread each) behind the ingress, compared with one
plain server. The tests reach the replicas' actors by joining that Ray as a driver.

Covers: equal greedy outputs through the OpenAI client and /generate (streamed and not), prefix
affinity and spreading, auth, /health and /metrics, and a replica killed twice (its actor, then its
server process): in-flight requests end with an error, later ones complete elsewhere, Ray restarts
the replica and nothing of the dead one is left running; last, the CLI stopped by SIGTERM leaves no
process of its private Ray running."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("ray.serve")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFIX_A = "Tenant A system prompt: you answer questions about rivers and mountains. " * 8
PREFIX_B = "Tenant B system prompt: a completely different assistant for invoices. " * 8


@contextlib.contextmanager
def one_thread():
    """The servers' children read OMP_NUM_THREADS when they start (one thread each on 2 cores)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def tiny(make_tiny_model):
    return make_tiny_model(max_position_embeddings=4096)


@pytest.fixture(scope="module")
def options(tiny):
    return {"model": str(tiny), "api_key": KEY, "log_level": "warning", "max_total_tokens": 16384,
            "served_model_name": "tiny"}


@pytest.fixture(scope="module")
def single(options):
    from radixlm.server import launch_server

    with one_thread():
        handle = launch_server(**options, port=0)
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def scaled(tiny):
    """The CLI's scale-out mode in its own session, and this process joined to its Ray as a driver
    (replica_info / replica_stats); the last test stops it."""
    import ray

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "radixlm.server.cli", "serve", "--model", str(tiny), "--served-model-name", "tiny",
           "--api-key", KEY, "--log-level", "warning", "--max-total-tokens", "16384", "--port", "0",
           "--replicas", "2", "--router", "prefix"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    output: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
            output.append(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: dict = {}
    try:
        url, deadline = None, time.monotonic() + 300
        while url is None:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, "the server exited before serving:\n" + "".join(output)
            if m := re.search(r"replica\(s\) at (http://\S+)", line):
                url = m.group(1)
        ray.init(address="auto", log_to_driver=False)
        yield SimpleNamespace(url=url, base_url=url + "/v1", proc=proc, output=output, seen=seen)
    finally:
        ray.shutdown()
        if proc.poll() is None:  # the last test did not run: the CLI stops its Ray as it would for a user
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(120)
        for p in seen.values():
            with contextlib.suppress(Exception):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def replica_info(i: int) -> dict:
    from ray import serve

    return serve.get_deployment_handle(f"radixlm-replica-{i}", app_name="radixlm").ping.remote().result()


def replica_stats(i: int) -> dict:
    from ray import serve

    return serve.get_deployment_handle(f"radixlm-replica-{i}", app_name="radixlm").stats.remote().result()


def metric(text: str, sample: str, /, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{sample}{labels} not in /metrics")


def generate(url: str, text: str, stream: bool = False, max_new_tokens: int = 12, **extra) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **extra},
            "stream": stream}
    return httpx.post(url + "/generate", json=body, headers=AUTH, timeout=120)


def stream_text(url: str, text: str) -> str:
    events = [json.loads(line[5:]) for line in generate(url, text, stream=True).text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    return events[-1]["text"]


def chat_answers(base_url: str) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": PREFIX_A}, {"role": "user", "content": "Name a river."}]
    out = [client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
           .choices[0].message.content]
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True)
    out.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    out.append(client.completions.create(model=model, prompt=PREFIX_B + "Q:", max_tokens=10, temperature=0)
               .choices[0].text)
    chunks = client.completions.create(model=model, prompt=PREFIX_B + "Q:", max_tokens=10, temperature=0, stream=True)
    out.append("".join(c.choices[0].text for c in chunks))
    return out


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _session_processes(session_dir: str) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if session_dir in " ".join(p.info["cmdline"] or ()):
                found.append(p)
    return found


def test_two_replicas_answer_like_one_server(single, scaled):
    prompts = [PREFIX_A + "first question", PREFIX_B + "second", "a short unrelated prompt"]
    for p in prompts:
        ref = generate(single.url, p)
        got = generate(scaled.url, p)
        assert got.status_code == ref.status_code == 200
        assert got.json()["output_ids"] == ref.json()["output_ids"]
        assert stream_text(scaled.url, p) == stream_text(single.url, p) == ref.json()["text"]
    assert chat_answers(scaled.base_url) == chat_answers(single.base_url)


def test_errors_and_auth_pass_through(single, scaled):
    bad = {"text": "x", "sampling_params": {"max_new_tokens": -3}}
    got = httpx.post(scaled.url + "/generate", json=bad, headers=AUTH, timeout=60)
    ref = httpx.post(single.url + "/generate", json=bad, headers=AUTH, timeout=60)
    assert got.status_code == ref.status_code == 400 and got.json() == ref.json()
    assert httpx.post(scaled.url + "/generate", json={"text": "x"}, timeout=60).status_code == 401
    assert httpx.get(scaled.url + "/metrics", timeout=60).status_code == 401
    health = httpx.get(scaled.url + "/health", timeout=60)  # public, like a single server's
    assert health.status_code == 200 and [r["up"] for r in health.json()["replicas"]] == [True, True]


def test_shared_prefix_sticks_and_different_prefixes_spread(scaled):
    a = {generate(scaled.url, PREFIX_A + f"question {i}").headers["x-radixlm-replica"] for i in range(4)}
    b = {generate(scaled.url, PREFIX_B + f"question {i}").headers["x-radixlm-replica"] for i in range(4)}
    assert len(a) == 1 and len(b) == 1 and a != b
    text = httpx.get(scaled.url + "/metrics", headers=AUTH, timeout=60).text
    home = a.pop()
    assert metric(text, "radixlm_router_decisions_total", replica=home, reason="prefix") >= 3
    assert metric(text, "radixlm_replica_cache_hit_rate", replica=home) > 0.5  # the shared prefix was reused
    assert metric(text, "radixlm_replica_up", replica=home) == 1.0


def test_client_that_leaves_a_stream_frees_everything(scaled):
    def stat(text: str, replica: str, name: str) -> float:
        return metric(text, "radixlm_replica_stat", replica=replica, name=name)

    before = httpx.get(scaled.url + "/metrics", headers=AUTH, timeout=60).text
    body = {"text": PREFIX_B + "leave", "sampling_params": {"max_new_tokens": 3000, "temperature": 0,
                                                              "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", scaled.url + "/generate", json=body, headers=AUTH, timeout=60) as r:
        replica = r.headers["x-radixlm-replica"]
        next(r.iter_lines())  # tokens flow; then the client goes away mid-stream
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        text = httpx.get(scaled.url + "/metrics", headers=AUTH, timeout=60).text
        if metric(text, "radixlm_replica_in_flight_requests", replica=replica) == 0 and \
                stat(text, replica, "in_flight") == 0:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the abandoned stream still holds the ingress's load or the replica's server")
    # it was aborted, not run to its 3000 tokens
    assert stat(text, replica, "generation_tokens") - stat(before, replica, "generation_tokens") < 2000


def _gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _kill_during_requests(url: str, home: str, pid: int) -> list[httpx.Response]:
    """Starts a long streamed and a long non-streamed request on replica `home`, kills `pid` once
    tokens flow, and returns both responses (each must end, with an error)."""
    results: list = [None, None]
    started = threading.Event()

    def streamed() -> None:
        body = {"text": PREFIX_A + "stream", "sampling_params": {"max_new_tokens": 3000, "temperature": 0,
                                                                   "ignore_eos": True}, "stream": True}
        with httpx.stream("POST", url + "/generate", json=body, headers=AUTH, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                started.set()
                if line:
                    lines.append(line)
            results[0] = (r, lines)

    def whole() -> None:
        results[1] = generate(url, PREFIX_A + "whole", max_new_tokens=3000, ignore_eos=True)

    threads = [threading.Thread(target=streamed), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    assert started.wait(120), "the stream never started"
    # Ray Serve holds a request it has not yet handed to a replica and gives it to the restarted one,
    # so the kill waits until both requests run on the replica's own scheduler.
    deadline = time.monotonic() + 60
    while replica_stats(int(home)).get("running", 0) < 2:
        assert time.monotonic() < deadline, "the non-streamed request never reached its replica"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(150)
        assert not t.is_alive(), "an in-flight request hung after its replica died"
    (stream_response, lines), whole_response = results
    assert stream_response.headers["x-radixlm-replica"] == home
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line != "data: [DONE]"]
    assert "error" in events[-1] and f"replica {home}" in events[-1]["error"]["message"]
    assert lines[-1] == "data: [DONE]"
    assert whole_response.status_code == 503 and f"replica {home}" in whole_response.json()["error"]["message"]
    return [stream_response, whole_response]


def _wait_restarted(url: str, home: str, restarts: float, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", headers=AUTH, timeout=60).text
        if metric(text, "radixlm_replica_restarts_total", replica=home) >= restarts and \
                metric(text, "radixlm_replica_up", replica=home) == 1.0:
            return
        time.sleep(1)
    raise AssertionError(f"replica {home} was not restarted within {timeout:.0f}s")


@pytest.mark.parametrize("victim", ["actor", "server"])
def test_killed_replica_fails_in_flight_requests_and_is_routed_around(scaled, victim):
    home = generate(scaled.url, PREFIX_A + "where").headers["x-radixlm-replica"]
    before = metric(httpx.get(scaled.url + "/metrics", headers=AUTH, timeout=60).text,
                    "radixlm_replica_restarts_total", replica=home)
    info = replica_info(int(home))
    _kill_during_requests(scaled.url, home, info["pid"] if victim == "actor" else info["server_pid"])
    for i in range(3):  # later requests complete, on the other replica
        r = generate(scaled.url, PREFIX_A + f"after {i}")
        assert r.status_code == 200 and r.headers["x-radixlm-replica"] != home
    assert _gone(info["server_pid"]), "the dead replica's server process is still running"
    _wait_restarted(scaled.url, home, before + 1)
    assert replica_info(int(home))["pid"] != info["pid"]
    assert generate(scaled.url, PREFIX_B + "back").status_code == 200


def test_cli_dispatches_replicas_to_ray(monkeypatch):
    from radixlm.server import cli
    from radixlm.server.scaleout import launch

    seen = {}
    monkeypatch.setattr(launch, "serve_replicas", lambda args, ns: seen.update(args=args, ns=ns) or 0)
    assert cli.main(["serve", "--model", "m", "--replicas", "3", "--router", "round-robin",
                     "--ray-address", "head:6379"]) == 0
    assert (seen["ns"].replicas, seen["ns"].router, seen["ns"].ray_address) == (3, "round-robin", "head:6379")
    assert seen["args"].model == "m"


# last in the module: it stops the `scaled` server
def test_sigterm_stops_cli_and_every_process_of_its_private_ray(scaled):
    """`radixlm serve --replicas` exits 0 on SIGTERM, and a few seconds later none of the processes it
    ran (GCS, raylet, DashboardAgent, RuntimeEnvAgent, monitors, Serve actors, the replicas' servers)
    nor any naming its Ray session dir is alive."""
    import psutil
    import ray

    ray.shutdown()  # this process leaves the cluster first: a driver still attached is not the CLI's to stop
    seen = scaled.seen
    for p in psutil.Process(scaled.proc.pid).children(recursive=True):
        seen[p.pid] = p
    cmdlines = [" ".join(p.cmdline()) for p in seen.values() if _alive(p)]
    session_dir = next(m.group(1) for c in cmdlines if (m := re.search(r"(/\S*/session_[^/\s]+)", c)))
    for p in _session_processes(session_dir):
        seen.setdefault(p.pid, p)
    names = {p.name() for p in seen.values() if _alive(p)}
    assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names

    scaled.proc.send_signal(signal.SIGTERM)
    rc = scaled.proc.wait(120)
    for p in _session_processes(session_dir):
        seen.setdefault(p.pid, p)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in seen.values()) and time.monotonic() < deadline:
        time.sleep(0.25)
    left = {p.pid: p.name() for p in seen.values() if _alive(p)}
    assert not left, f"still running after the server exited (exit status {rc}): {left}"
    assert rc == 0, "".join(scaled.output)
