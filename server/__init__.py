"""RadixLM's HTTP server: OpenAI-compatible and native (SGLang) routes over the runtime.

    from radixlm.server import launch_server
    server = launch_server(model="smollm2-135m", port=0)   # returns once it accepts requests
    ... server.url ...
    server.shutdown()

From a shell: `python -m radixlm.server --model smollm2-135m` or `radixlm serve --model ...`.
Processes and modules:
    launch.py              process wiring, readiness, shutdown (SIGTERM drains)
    app.py                 FastAPI app: routers, guard (auth, limits, status counts), CORS, error handlers
    routes_openai.py       /v1/chat/completions, /v1/completions, /v1/models (openai_stream.py: SSE)
    openai_models.py       their request models (every OpenAI/SGLang name); openai_convert.py: conversions
    routes_native.py       SGLang's /generate, /apply_chat_template, /tokenize, /detokenize
    routes_admin.py        /health, /metrics, /flush_cache, /server_info, /abort_request (+ SGLang aliases), /docs
    common.py              the leaf under the routers: body reading, typed errors -> 4xx, submit, SSE
    tool_calls.py          tool-call prompting, constraints, parsing
    tool_stream.py         tool calls as they form: one incremental parser for streamed and whole answers
    tokenizer_manager.py   per-request state in the HTTP process, zmq fan-in/fan-out, metrics
    scheduler_process.py   runtime/driver.py's SchedulerDriver over a zmq transport
    detokenizer_process.py incremental detokenization in its own process
    messages.py            every cross-process message (msgspec, never pickle)
"""

from radixlm.server.launch import ServerHandle, launch_server, serve

__all__ = ["ServerHandle", "launch_server", "serve"]
