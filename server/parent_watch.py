"""How a child process of the server notices that its parent is gone, even after kill -9.

A spawned child holds a sentinel of its parent that becomes readable the moment the parent exits;
a thread blocks on it (no polling, no dependence on the child being idle). Then the child stops:
its own loop sees `gone` at its next check, the ipc folder is removed (no one else will), and if
the loop is stuck in a long step the process exits anyway after a short grace.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import threading

logger = logging.getLogger("radixlm.server")

EXIT_GRACE_S = 2.0  # how long the child's own loop gets to stop cleanly before a hard exit


def watch_parent(addrs: dict[str, str], what: str) -> threading.Event:
    """Starts the watcher; returns the event set when the parent is gone."""
    gone = threading.Event()
    parent = multiprocessing.parent_process()
    if parent is None:
        return gone

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("the server process is gone; %s stopping", what)
        gone.set()
        for folder in {os.path.dirname(a.removeprefix("ipc://")) for a in addrs.values() if a.startswith("ipc://")}:
            shutil.rmtree(folder, ignore_errors=True)
        timer = threading.Timer(EXIT_GRACE_S, os._exit, (1,))
        timer.daemon = True
        timer.start()

    threading.Thread(target=wait, name="radixlm-parent-watch", daemon=True).start()
    return gone
