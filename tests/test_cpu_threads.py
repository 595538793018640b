"""The CPU thread governor (runtime/executor/cpu/contention.py): it sizes torch's team to the cores
other processes leave free, only after readings agree, never below one thread or above the start;
the team's size moves logprobs in their last bits only. The rest of the suite runs with the governor
off (conftest.py), so that two runs of a test compute with the same team whatever else is running."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.executor.cpu import contention

TICK = 100  # clock ticks a second, as the fake readings count them


class FakeMachine:
    """/proc as the governor reads it: each `advance` is one interval in which other processes kept
    `others` cores busy and this one used `ours`, on `cores` cores."""

    def __init__(self, monkeypatch, cores: int):
        self.cores, self.idle, self.ours, self.now, self.reads = cores, 0, 0, 1000.0, 0
        self.team: list[int] = []
        monkeypatch.setattr(contention, "_read", self._read)
        monkeypatch.setattr(contention.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(contention.os, "sysconf", lambda name: TICK)
        monkeypatch.setattr(contention.torch, "set_num_threads", self.team.append)

    def _read(self) -> tuple[int, int]:
        self.reads += 1
        return self.idle, self.ours

    def advance(self, others: float, ours: float, part: float = 1.0) -> None:
        dt = contention.INTERVAL_S * part
        self.now += dt
        self.ours += round(ours * dt * TICK)
        self.idle += round(max(0.0, self.cores - others - ours) * dt * TICK)


def test_a_busy_neighbour_shrinks_the_team_and_its_leaving_restores_it(monkeypatch):
    machine = FakeMachine(monkeypatch, cores=2)
    governor = contention.ThreadGovernor(2)
    machine.advance(others=0.0, ours=2.0)
    governor.check()
    assert governor.threads == 2 and machine.team == []
    machine.advance(others=1.0, ours=1.0)  # a spinner takes a core: one reading is not enough
    governor.check()
    assert governor.threads == 2
    machine.advance(others=1.0, ours=1.0)
    governor.check()
    assert governor.threads == 1 and machine.team == [1]
    reads = machine.reads
    machine.advance(others=1.0, ours=1.0, part=0.5)  # within an interval nothing is read
    governor.check()
    assert machine.reads == reads
    for _ in range(2):  # the spinner leaves: our one thread and an idle core add up to two again
        machine.advance(others=0.0, ours=1.0)
        governor.check()
    assert governor.threads == 2 and machine.team == [1, 2]


@pytest.mark.parametrize("others,want", [(0.2, 4), (0.7, 3), (1.5, 2), (3.9, 1), (8.0, 1)])
def test_the_team_is_the_cores_left_over_within_bounds(monkeypatch, others, want):
    machine = FakeMachine(monkeypatch, cores=4)
    governor = contention.ThreadGovernor(4)
    for _ in range(contention.CONFIRM):
        machine.advance(others=others, ours=min(4.0, max(0.0, 4.0 - others)))
        governor.check()
    assert governor.threads == want


def test_off_switch_and_a_single_thread_need_no_governor(monkeypatch):
    monkeypatch.setenv(contention.OFF_ENV, "on")
    monkeypatch.setattr(contention.torch, "get_num_threads", lambda: 4)
    governor = contention.ThreadGovernor.for_this_machine()  # Linux: /proc is there
    assert governor is not None and governor.max_threads == governor.threads == 4
    monkeypatch.setenv(contention.OFF_ENV, "off")
    assert contention.ThreadGovernor.for_this_machine() is None
    monkeypatch.delenv(contention.OFF_ENV)
    monkeypatch.setattr(contention.torch, "get_num_threads", lambda: 1)
    assert contention.ThreadGovernor.for_this_machine() is None


def test_the_team_size_moves_no_greedy_choice(engine):
    """Greedy ids with 1 thread and with 2 (float32 engine) are the same and every logprob within
    1e-4: a team's size moves last bits only, as a batch's composition does."""
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    args = {"return_logprob": True, "logprob_start_len": 0}
    prompts = ["The lighthouse keeper climbed the stairs and", "Three prime numbers are"]
    runs = []
    before = engine.runner.compute.run(torch.get_num_threads)
    try:
        for threads in (1, 2):
            engine.runner.compute.run(torch.set_num_threads, threads)
            engine.flush_cache()
            runs.append(engine.generate(prompts, [params] * 2, **args))
    finally:
        engine.runner.compute.run(torch.set_num_threads, before)
    for one, two in zip(*runs):
        assert one["output_ids"] == two["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            a, b = one["meta_info"][key], two["meta_info"][key]
            assert [x[1] for x in a] == [x[1] for x in b]
            assert all(abs(x[0] - y[0]) < 1e-4 for x, y in zip(a, b) if x[0] is not None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_engine_shrinks_its_team_under_load_and_answers_the_same(make_tiny_model, monkeypatch, compiled):
    """The runner consults its governor before each CPU forward: under a (fake) load that leaves one
    core, the team drops to one thread mid-generation, and the greedy ids are the quiet run's. The
    compiled forward's one graph serves either team (no recompile is refused)."""
    from radixlm.runtime import Engine

    folder = make_tiny_model("LlamaForCausalLM", initializer_range=0.2)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = [[5, 9, 200, 31], list(range(300, 340))]
    monkeypatch.setenv(contention.OFF_ENV, "on")
    monkeypatch.setattr(contention, "INTERVAL_S", 0.0)  # read at every forward
    start, tick = contention.time.monotonic(), contention.os.sysconf("SC_CLK_TCK")

    def busy_read():  # no idle core, and half of one for this process, since the load began
        return 0, (contention.time.monotonic() - start) * tick * 0.5

    with Engine(model=str(folder), quantization="none", max_total_tokens=1024, log_level="warning",
                enable_torch_compile=compiled) as engine:
        before = engine.runner.compute.run(torch.get_num_threads)
        try:
            engine.runner.compute.run(torch.set_num_threads, 2)
            engine.runner.governor = engine.runner.compute.run(contention.ThreadGovernor.for_this_machine)
            quiet = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=[params] * 2)]
            monkeypatch.setattr(contention, "_read", busy_read)
            busy = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=[params] * 2)]
            assert engine.runner.governor.threads == 1
            assert engine.runner.compute.run(torch.get_num_threads) == 1
            assert not compiled or engine.runner.compiled.graphs() == 1
        finally:
            engine.runner.compute.run(torch.set_num_threads, before)
    assert busy == quiet
