"""Fault injection for tests/test_server_faults.py, inside real server processes.

`server_main` is a launch target (radixlm.server.launch.launch): it runs the normal HTTP process but
makes it start `run_scheduler` as its scheduler process, which patches the scheduler so that
requests whose rid starts with
  - "fault500-" fail inside the runtime after their second token (an abort with code 500),
  - "slow-" make every step they take part in last SLOW_STEP_S longer,
and grammar specs containing "__slow_compile__" take SLOW_COMPILE_S longer to compile.
  - "fault400-" are refused by the runtime after their second token (an abort with code 400 naming
    stop_regex),
and the HTTP process so that rendering a /generate result of a "crash-" request raises (an
unexpected exception in a route). Other requests are untouched. Spawned children import this
module by name (tests/ is on sys.path).
"""

from __future__ import annotations

import time

SLOW_STEP_S = 0.05
SLOW_COMPILE_S = 3.0


def server_main(args_dict: dict, ready_conn) -> None:
    from radixlm.server import children
    from radixlm.server.launch import _server_main
    from radixlm.server.request_state import ReqState

    children.CHILD_MAINS["scheduler"] = f"{__name__}:run_scheduler"  # start_children reads it at call time
    real_meta = ReqState.meta

    def meta(self):
        if self.rid.startswith("crash-"):
            raise RuntimeError("injected fault in the HTTP process")
        return real_meta(self)

    ReqState.meta = meta
    _server_main(args_dict, ready_conn)


def run_scheduler(args_dict: dict, addrs: dict, ready_conn) -> None:
    from radixlm.constrained.base import GrammarBackend
    from radixlm.runtime.request.req import FinishReason
    from radixlm.runtime.scheduler.scheduler import Scheduler
    from radixlm.server.scheduler_process import run_scheduler_process

    real_advance = Scheduler._advance

    def advance(self, req, token, out, i):
        if req.rid.startswith("slow-"):
            time.sleep(SLOW_STEP_S)
        if req.rid.startswith("fault500-") and len(req.output_ids) >= 2:
            raise RuntimeError("injected fault after two tokens")
        real_advance(self, req, token, out, i)
        if req.rid.startswith("fault400-") and len(req.output_ids) >= 2 and req.finish is None:
            req.finish = FinishReason("abort", message="stop_regex: injected refusal", code=400, field="stop_regex")

    Scheduler._advance = advance
    real_compile = GrammarBackend._compile_checked

    def compile_checked(self, kind, spec):
        if "__slow_compile__" in spec:
            time.sleep(SLOW_COMPILE_S)
        return real_compile(self, kind, spec)

    GrammarBackend._compile_checked = compile_checked
    run_scheduler_process(args_dict, addrs, ready_conn)
