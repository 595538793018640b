"""The Engine's in-process transport: a batch put together arrives together (an Engine.generate batch
joins one scheduling round whole), in order, however the driver's receives interleave with it."""

from __future__ import annotations

import sys
import threading

from radixlm.runtime.driver import Abort, QueueTransport


def test_a_batch_is_received_whole_and_in_order_while_the_driver_polls():
    transport, batches, size = QueueTransport(), 300, 5
    received: list[list[str]] = []
    done = threading.Event()

    def driver() -> None:  # polls as a busy driver does (timeout 0 while it has work)
        while not done.is_set() or not transport.inbox.empty():
            cmds = transport.receive(0.0)
            if cmds:
                received.append([c.rid for c in cmds])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as the interpreter lets them
    try:
        thread = threading.Thread(target=driver)
        thread.start()
        for b in range(batches):
            transport.put_all([Abort(f"{b}-{i}") for i in range(size)])
        transport.put(Abort("last"))
        done.set()
        thread.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not thread.is_alive()
    flat = [rid for chunk in received for rid in chunk]
    assert flat == [f"{b}-{i}" for b in range(batches) for i in range(size)] + ["last"]
    for chunk in received:  # whole batches only: a receive never ends inside one
        body = [rid for rid in chunk if rid != "last"]
        assert len(body) % size == 0 and all(rid.endswith(f"-{k % size}") for k, rid in enumerate(body))


def test_receive_waits_for_a_put_and_returns_nothing_after_its_timeout():
    transport = QueueTransport()
    assert transport.receive(0.01) == []
    timer = threading.Timer(0.05, lambda: transport.put_all([Abort("a"), Abort("b")]))
    timer.start()
    got = transport.receive(5.0)
    timer.join()
    assert [c.rid for c in got] == ["a", "b"]
