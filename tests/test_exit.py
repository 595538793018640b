"""Programs that simply end: an Engine they never shut down, with work of run_batch, fork and
streaming just finished, stops before the interpreter finalizes (which otherwise ended the compute
thread inside a torch op: "terminate called without an active exception", exit code 134)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

PROGRAM = textwrap.dedent("""
    import sys
    import radixlm.lang as rl

    rl.set_default_backend(rl.Engine(model=sys.argv[1], log_level="warning"))

    @rl.function
    def qa(s, q):  # answers end at a stop string, found only once the next step is launched
        s += "Question: What is the capital of Germany?\\nAnswer: Berlin\\n\\nQuestion: " + q + "\\nAnswer:"
        s += rl.gen("a", stop="\\n", max_tokens=32, temperature=0)

    QUESTIONS = ["What is the capital of France?", "What do bees make?", "What color is grass?",
                 "What is the opposite of hot?"]

    @rl.function
    def branches(s):
        s += "Two ideas:"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" idea {i}:" + rl.gen("idea", max_tokens=6)
        forks.join()

    @rl.function
    def streamed(s):
        s += "Once upon a time" + rl.gen("story", max_tokens=12)

    {body}
""")

BODIES = {  # each ends right after its last request, with steps of the built-in model still in flight
    "run_batch": 'print([s["a"] for s in qa.run_batch([{"q": q} for q in QUESTIONS])])',
    "fork, streaming, run_batch": 'branches.run(); print("".join(streamed.run(stream=True).text_iter("story"))); '
                                  'qa.run_batch([{"q": q} for q in QUESTIONS[:2]])',
}


@pytest.mark.parametrize("name", list(BODIES))
def test_a_program_that_just_ends_exits_cleanly(name, smollm_folder, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.replace("{body}", BODIES[name]))
    done = subprocess.run([sys.executable, str(script), str(smollm_folder)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate" not in done.stderr and "Fatal Python error" not in done.stderr, done.stderr[-2000:]
