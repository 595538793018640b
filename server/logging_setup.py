"""One log format for the three server processes: `[time radixlm <process>] message`."""

from __future__ import annotations

import logging


def setup_logging(level: str, process: str) -> None:
    root = logging.getLogger("radixlm")
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[%(asctime)s radixlm {process}] %(levelname)s %(message)s",
                                           "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
