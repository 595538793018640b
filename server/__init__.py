"""RadixLM's HTTP server: OpenAI-compatible and native (SGLang) routes over the runtime.

    from radixlm.server import launch_server
    server = launch_server(model="smollm2-135m", port=0)   # returns once it accepts requests
    ... server.url ...
    server.shutdown()

From a shell: `python -m radixlm.server --model smollm2-135m` or `radixlm serve --model ...`.
Processes and modules:
    launch.py             process wiring, readiness, shutdown (SIGTERM drains)
    app.py                FastAPI app, guard (auth, limits), native routes
    openai_routes.py      /v1/chat/completions, /v1/completions; openai_api.py: their models
    tool_calls.py         tool-call prompting, constraints, parsing
    tokenizer_manager.py  per-request state in the HTTP process, zmq fan-in/fan-out
    scheduler_process.py  the Scheduler's loop in its own process
    detokenizer_process.py incremental detokenization in its own process
    messages.py           every cross-process message (msgspec, never pickle)
"""

from radixlm.server.launch import ServerHandle, launch_server, serve

__all__ = ["ServerHandle", "launch_server", "serve"]
