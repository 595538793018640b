"""Grammar compiles are bounded (issue 13, items 2 and 3), against a real server and on the backend:
a self-referencing or external `$ref` is a 400 naming the schema problem; a spec's size is capped;
a slow compile never starves small ones, times out per request and is abandoned (cancelled or
dropped from the cache) once no request waits for it; the compile cache counts memory against a
budget. Slow compiles come from tests/fault_hooks.py ("__slow_compile__" in a spec: +3 s)."""

from __future__ import annotations

import concurrent.futures as cf
import json

import fault_hooks
import httpx
import pytest
import torch
from server_helpers import CHAT, assert_error, assert_healthy, chat, gen, start, wait_in_flight

pytestmark = pytest.mark.slow

COMPILE_TIMEOUT = 2.0  # below fault_hooks.SLOW_COMPILE_S: every slow compile times out
SELF_REF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
assert COMPILE_TIMEOUT < fault_hooks.SLOW_COMPILE_S


@pytest.fixture(scope="module")
def server(make_tiny_model):
    handle = start(make_tiny_model(), grammar_compile_timeout=COMPILE_TIMEOUT)
    yield handle
    handle.shutdown()


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def slow_schema(i: int) -> str:
    """A distinct schema past the large-spec size (its own compile lane) that compiles slowly."""
    return json.dumps({"type": "string", "description": f"__slow_compile__ {i} " + "x" * 9000})


def grammar_cache(http: httpx.Client) -> dict:
    return http.get("/server_info").json()["grammar_cache"]


# --------------------------------------------------------------------------- 2: $ref
@pytest.mark.parametrize("schema, words", [
    (SELF_REF, ["cycle", "#/$defs/a"]),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/a"}}}, ["cycle"]),
    ({"$ref": "file:///etc/passwd"}, ["file:///etc/passwd", "not a local reference"]),
    ({"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}, ["not a local reference"]),
    ({"$ref": "#/$defs/missing"}, ["does not resolve"]),
])
def test_bad_refs_are_a_400_naming_the_schema_problem(http, schema, words):
    assert_error(http.post(CHAT, json=chat(response_format=schema_format(schema))), 400, *words, param="json_schema")
    r = http.post(CHAT, json=chat(response_format=schema_format(schema), stream=True))
    assert_error(r, 400, *words)
    assert_error(http.post("/generate", json=gen(sampling_params={"json_schema": json.dumps(schema)})), 400, *words,
                 param="sampling_params.json_schema")
    assert_healthy(http)


def test_a_recursive_schema_with_a_base_case_still_works(http):
    tree = {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"},
                                                             "next": {"anyOf": [{"$ref": "#/$defs/n"},
                                                                                {"type": "null"}]}},
                            "required": ["v", "next"]}}, "$ref": "#/$defs/n"}
    r = http.post(CHAT, json=chat(max_tokens=40, response_format=schema_format(tree)))
    assert r.status_code == 200, r.text
    assert_healthy(http)


# --------------------------------------------------------------------------- 3: bounded compiles
def test_schema_size_is_bounded(http):
    huge = {"enum": [f"value-{i}" for i in range(12_000)]}  # ~160 kB
    assert_error(http.post(CHAT, json=chat(response_format=schema_format(huge))), 400, "100000", param="json_schema")
    assert_error(http.post("/generate", json=gen(sampling_params={"regex": "a" * 100_001})), 400, "100000",
                 param="sampling_params.regex")
    assert_healthy(http)


def test_slow_compiles_time_out_never_starve_small_ones_and_are_abandoned(http):
    before = grammar_cache(http) or {"size": 0, "abandoned": 0}
    with cf.ThreadPoolExecutor(3) as pool:
        slow = [pool.submit(http.post, "/generate", json=gen(sampling_params={"max_new_tokens": 4,
                                                                              "json_schema": slow_schema(i)}))
                for i in range(3)]
        wait_in_flight(http, 3, slow)
        small = http.post(CHAT, json=chat(max_tokens=8, response_format=schema_format({"type": "boolean"})))
        assert small.status_code == 200, small.text
        assert not any(f.done() for f in slow), "the small schema waited for the slow ones"
        for f in slow:
            assert_error(f.result(), 400, "grammar_compile_timeout", param="sampling_params.json_schema")
    after = grammar_cache(http)
    assert after["abandoned"] - before["abandoned"] == 3  # one dropped while running, two cancelled in the queue
    assert after["size"] == before["size"] + 1, "an abandoned compile stayed in the cache"  # + the small one
    assert_healthy(http)


def test_aborted_requests_abandon_their_compiles(http):
    before = grammar_cache(http)
    with cf.ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(http.post, "/generate", json=gen(rid=f"abandon-{i}", sampling_params={
            "max_new_tokens": 4, "json_schema": slow_schema(100 + i)})) for i in range(2)]
        wait_in_flight(http, 2, slow)
        for i in range(2):
            assert http.post("/abort_request", json={"rid": f"abandon-{i}"}).json()["success"] is True
        assert [f.result().json()["meta_info"]["finish_reason"]["type"] for f in slow] == ["abort", "abort"]
    after = grammar_cache(http)
    assert after["abandoned"] - before["abandoned"] == 2 and after["size"] == before["size"]
    assert_healthy(http)


# --------------------------------------------------------------------------- the backend, in process
def test_the_compile_cache_keeps_to_its_memory_budget(tokenizer):
    from radixlm.constrained import create_grammar_backend

    backend = create_grammar_backend("xgrammar", tokenizer, len(tokenizer))
    try:
        sizes = []
        for i in range(4):
            backend.compile("regex", f"[a-z]{{{i + 1},20}}x{i}")
            sizes.append(backend.cache_info().bytes)
        assert sizes == sorted(sizes) and sizes[0] > 0
        backend._cache_bytes = sizes[1]  # room for about two: older entries are evicted
        backend.compile("regex", "[0-9]{3}")
        info = backend.cache_info()
        assert info.size < 5 and (info.bytes <= sizes[1] or info.size == 1)
        assert backend.compile("regex", "[0-9]{3}") is not None and backend.cache_info().hits >= 1
    finally:
        backend.shutdown()


def test_a_grammar_that_admits_nothing_fails_its_request_with_a_400():
    from concurrent.futures import Future

    from radixlm.runtime.request.params import SamplingParams
    from radixlm.runtime.request.req import Req
    from radixlm.runtime.scheduler.grammars import GrammarManager

    class Dead:
        def fill_mask(self, bitmask, row):
            bitmask[row].zero_()

        def batch_target(self):
            return None  # fills its own row

    class Backend:
        stop_token_ids = (0,)

        def compile_async(self, kind, spec):
            fut: Future = Future()
            fut.set_result(Dead())
            return fut

    manager = GrammarManager("xgrammar", None, 64, [0], jump_forward=False)
    manager._backend = Backend()
    req = Req(rid="r", input_ids=[1], params=SamplingParams(regex="x"))
    manager.submit(req)
    ready, failed = manager.poll()
    assert ready == [] and failed == [req]
    assert req.finish.code == 400 and "admits no output" in req.finish.message
    live = Req(rid="s", input_ids=[1], params=SamplingParams(regex="x"))
    live.grammar = Dead()
    mask = manager.vocab_mask([live], 64, torch.device("cpu"))
    assert live.finish.code == 400 and "no continuation" in live.finish.message and bool(mask.all())
