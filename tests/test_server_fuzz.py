"""Schemathesis against the server's complete /openapi.json (issue 13): every documented operation,
bodies generated from the published request models, and not one 5xx.

The document is built at collection time by the code that serves it (schemathesis' lazy fixture
loader does not work with pytest 9); a test checks the live server publishes exactly that one.
The server runs a tiny random Llama, so a generated request that is valid runs for real, fast."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis_budget import examples

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402

from radixlm.server.app import openapi_document  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_server(make_tiny_model):
    from radixlm.server import launch_server

    # small limits keep each valid generated request short: n <= 8, 16 tokens unless it asks for more
    handle = launch_server(model=str(make_tiny_model()), port=0, log_level="error", max_total_tokens=1024,
                           max_running_requests=4, max_queued_requests=4, default_max_tokens=16,
                           max_request_seconds=60)
    yield handle
    handle.shutdown()


DOCUMENT = openapi_document()
schema = schemathesis.openapi.from_dict(DOCUMENT)


def test_the_server_publishes_the_fuzzed_document(fuzz_server):
    assert httpx.get(fuzz_server.url + "/openapi.json", timeout=60).json() == DOCUMENT


@schema.parametrize()
@settings(max_examples=examples(15), deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, fuzz_server):
    response = case.call(base_url=fuzz_server.url, timeout=120)
    case.validate_response(response, checks=[not_a_server_error])


def test_server_is_healthy_after_fuzzing(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}
        info = http.get("/server_info").json()
        assert info["in_flight"] == 0 and info["cache"]["protected_size"] == 0
        r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
        assert r.json()["meta_info"]["completion_tokens"] == 3
