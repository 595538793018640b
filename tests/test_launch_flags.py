"""SGLang's and vLLM's launch commands work unchanged: `python -m radixlm.launch_server` with their
flags (runtime/launch_flags.py), and values we cannot honour are refused with what to do instead."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from radixlm.server.server_args import ServerArgs

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli(parser.parse_args(list(argv)))


def test_their_spellings_set_our_fields():
    args = parse("--model-path", "m", "--max-model-len", "512", "--max-num-seqs", "7", "--seed", "3",
                 "--max-num-batched-tokens", "256", "--tp", "1", "--gpu-memory-utilization", "0.7",
                 "--no-enable-prefix-caching", "--enable-prefix-caching", "--enable-auto-tool-choice",
                 "--trust-remote-code", "--enable-metrics", "--tool-call-parser", "hermes")
    assert (args.model, args.context_length, args.max_running_requests, args.random_seed) == ("m", 512, 7, 3)
    assert (args.chunked_prefill_size, args.tp_size, args.mem_fraction_static) == (256, 1, 0.7)
    assert args.disable_radix_cache and args.trust_remote_code and args.tool_call_parser == "hermes"
    assert parse().disable_radix_cache is False  # the no-op spelling alone changes nothing


@pytest.mark.parametrize("argv, words", [
    (["--tp-size", "2"], ["tp_size 2", "one device"]),
    (["--tensor-parallel-size", "4"], ["tp_size 4"]),
    (["--dp-size", "2"], ["--replicas"]),
    (["--tool-call-parser", "pythonic"], ["pythonic", "hermes", "llama3", "mistral"]),
    (["--reasoning-parser", "granite"], ["granite", "qwen3", "deepseek-r1"]),
    (["--mem-fraction-static", "1.5"], ["mem_fraction_static", "(0, 1)"]),
    (["--attention-backend", "flashattn"], ["attention_backend", "triton"]),
])
def test_values_we_cannot_honour_are_refused_naming_the_way_out(argv, words):
    with pytest.raises(ValueError) as e:
        parse(*argv)
    for word in words:
        assert word in str(e.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_engine_takes_the_servers_options_and_ignores_them():
    """Engine(**kwargs) accepts every ServerArgs field, as SGLang's does (the HTTP ones change
    nothing in-process), and still names a keyword no API defines."""
    from radixlm.runtime.engine_args import EngineArgs

    args = EngineArgs.from_kwargs(model="m", port=8000, api_key="k", tool_call_parser="hermes", max_running_requests=3)
    assert type(args) is EngineArgs and args.max_running_requests == 3 and not hasattr(args, "port")
    with pytest.raises(TypeError, match="unknown EngineArgs option.*: prot"):
        EngineArgs.from_kwargs(model="m", prot=8000)
    with pytest.raises(TypeError, match="unknown ServerArgs option.*: prot"):
        ServerArgs.from_kwargs(model="m", prot=8000)


def test_keywords_take_sglang_and_vllm_spellings():
    """`Engine(model_path=...)` is how SGLang's docs build an engine, `LLM(max_model_len=...)` vLLM's:
    each spelling of a launch flag is a keyword too, and two spellings that disagree are refused."""
    from radixlm.runtime.engine_args import EngineArgs

    args = EngineArgs.from_kwargs(model_path="m", max_model_len=512, seed=3, max_num_seqs=4)
    assert (args.model, args.context_length, args.random_seed, args.max_running_requests) == ("m", 512, 3, 4)
    assert ServerArgs.from_kwargs(model_path="m", port=8000).model == "m"
    assert EngineArgs.from_kwargs(model="m", model_path="m").model == "m"
    with pytest.raises(TypeError, match="model_path='a' and model='b' name the same option"):
        EngineArgs.from_kwargs(model_path="a", model="b")


def test_sglang_launch_command_serves_with_its_chat_template(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    port = _free_port()
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--model-path", "smollm2-135m", "--port", str(port),
           "--tp-size", "1", "--mem-fraction-static", "0.8", "--chat-template", str(template),
           "--tool-call-parser", "qwen25", "--trust-remote-code", "--enable-metrics", "--max-total-tokens", "2048",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else "server exited"
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.5)
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
            text = http.post("/apply_chat_template", json={"messages": messages, "add_generation_prompt": True})
            assert text.json()["text"] == "[system] Be brief.\n[user] hi\n[assistant] "
            chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
            # the prompt is the custom template's rendering: its token count says so
            ids = http.post("/tokenize", json={"prompt": "[system] Be brief.\n[user] hi\n[assistant] "}).json()
            assert chat.json()["usage"]["prompt_tokens"] == ids["count"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
