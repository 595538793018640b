"""A burst of clients joins one step: the HTTP process counts the generation requests on their way to
the scheduler (tokenizer_manager.Arrivals, app.CountArrivals), each request sent carries that count,
and an idle CPU scheduler waits, boundedly, for exactly those (driver.SchedulerDriver._arrivals)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.testclient import TestClient

from radixlm.runtime.driver import Abort, SchedulerDriver, Stop, Submit
from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.request.req import Req
from radixlm.server import messages as m
from radixlm.server.app import CountArrivals
from radixlm.server.metrics import Metrics
from radixlm.server.server_args import ServerArgs
from radixlm.server.tokenizer_manager import Arrivals, TokenizerManager


# ------------------------------------------------------------------------ the HTTP process's count
def counting_app(arrivals: Arrivals, seen: list[tuple[str, int]]) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")  # submits, then streams: the count drops at the submission, not the answer's end
    async def generate(request: Request):
        seen.append(("before submit", arrivals.count))
        arrivals.end(request.scope)  # what TokenizerManager.submit does with the handler's scope

        async def body():
            seen.append(("streaming", arrivals.count))
            yield b"data: x\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")  # refused before it is submitted
    async def refused(request: Request):
        seen.append(("refused", arrivals.count))
        return JSONResponse({"error": "bad"}, status_code=400)

    @app.post("/v1/completions")  # fails while it is prepared
    async def broken(request: Request):
        raise RuntimeError("tokenizer failed")

    @app.post("/tokenize")  # not a generation: never counted
    async def tokenize(request: Request):
        seen.append(("tokenize", arrivals.count))
        return JSONResponse({})

    app.add_middleware(CountArrivals, arrivals=arrivals)
    return app


def test_a_generation_counts_from_its_arrival_to_its_submission_or_its_answer():
    arrivals, seen = Arrivals(), []
    client = TestClient(counting_app(arrivals, seen), raise_server_exceptions=False)
    assert client.post("/generate", json={}).status_code == 200
    assert seen == [("before submit", 1), ("streaming", 0)]
    assert client.post("/v1/chat/completions", json={}).status_code == 400
    assert client.post("/v1/completions", json={}).status_code == 500
    assert client.post("/tokenize", json={}).status_code == 200
    assert seen[2:] == [("refused", 1), ("tokenize", 0)]
    assert arrivals.count == 0  # whatever became of them, none is left counted


def test_each_request_sent_carries_how_many_more_are_on_their_way():
    """Frames of one submission count the ones after them, plus the requests still being prepared."""
    tm = TokenizerManager.__new__(TokenizerManager)
    sent: list[bytes] = []
    tm.args, tm.failed, tm._closed, tm.states, tm.max_in_flight = ServerArgs(), None, False, {}, 64
    tm.metrics, tm.arrivals, tm._to_scheduler = Metrics(), Arrivals(), SimpleNamespace(send=sent.append)
    scope: dict = {}
    tm.arrivals.begin(scope)
    for other in ({}, {}):  # two more requests still being prepared
        tm.arrivals.begin(other)

    async def submit() -> None:
        reqs = [Req(rid=f"r{i}", input_ids=[1, 2], params=SamplingParams(max_new_tokens=1)) for i in range(3)]
        tm.submit(reqs, scope=scope)

    asyncio.run(submit())
    assert [m.decode(f).pending for f in sent] == [4, 3, 2]
    assert tm.arrivals.count == 2


# ------------------------------------------------------------------------------- the scheduler's wait
class ScriptedTransport:
    """Each receive returns the next scripted batch, whose requests say how many more are coming."""

    def __init__(self, script: list[tuple[list, int]], gather_max_s: float = 0.05):
        self.script = script
        self.gather_max_s = gather_max_s
        self.expecting = 0
        self.timeouts: list[float] = []

    def receive(self, timeout: float) -> list:
        self.timeouts.append(timeout)
        if not self.script:
            return []
        cmds, self.expecting = self.script.pop(0)
        return cmds


def gathered(transport) -> list:
    return SchedulerDriver._arrivals(SimpleNamespace(transport=transport))


def submit(rid: str) -> Submit:
    return Submit(Req(rid=rid, input_ids=[1], params=SamplingParams()))


def test_an_idle_scheduler_takes_the_burst_it_was_told_of_and_stops_when_none_is_left():
    t = ScriptedTransport([([submit("b")], 1), ([submit("c"), Abort("x")], 0), ([submit("late")], 0)])
    t.expecting = 2  # the first request said two more were coming
    cmds = gathered(t)
    assert [c.req.rid if isinstance(c, Submit) else c.rid for c in cmds] == ["b", "c", "x"]
    assert len(t.script) == 1  # the late request is left for the next round
    assert len(t.timeouts) == 2 and all(0 < s <= 0.05 for s in t.timeouts)


@pytest.mark.parametrize("case", ["none coming", "no gather (GPU, Engine)", "never arrives", "stop"])
def test_the_wait_is_for_announced_requests_only_and_bounded(case):
    if case == "none coming":
        t = ScriptedTransport([([submit("b")], 0)])
        assert gathered(t) == [] and t.timeouts == []  # a lone request waits for nothing
    elif case == "no gather (GPU, Engine)":
        t = ScriptedTransport([([submit("b")], 0)], gather_max_s=0.0)
        t.expecting = 3
        assert gathered(t) == [] and t.timeouts == []
        assert gathered(SimpleNamespace(receive=None)) == []  # a transport without the attributes
    elif case == "never arrives":  # announced, then refused by the HTTP process: the bound ends the wait
        t = ScriptedTransport([])
        t.expecting = 2
        assert gathered(t) == [] and len(t.timeouts) == 1 and t.timeouts[0] <= 0.05
    else:
        t = ScriptedTransport([([submit("b"), Stop("bye")], 5), ([submit("c")], 0)])
        t.expecting = 1
        cmds = gathered(t)
        assert isinstance(cmds[-1], Stop) and len(t.script) == 1
