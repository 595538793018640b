"""A ReAct-style agent: the model thinks, picks an action, and calls a Python tool (a calculator).

Run it:  python examples/react_agent.py

What it shows:
- Control flow is plain Python: a loop that reads the model's choices (`s["action_0"]`) and
  calls real code with them. Reading a variable waits for the model; appending does not.
- `select` picks the action from a fixed list, and a `regex` constraint makes the calculator's
  input an arithmetic expression, so the tool call always parses (no output parsing by hand).
- Every step resends the growing transcript; the radix cache holds the earlier steps, so each
  step only computes what was added since the last one.
"""

from __future__ import annotations

import ast
import operator
import os

import radixlm.lang as rl

MAX_TOKENS = int(os.environ.get("RADIXLM_EXAMPLE_MAX_TOKENS", "32"))
MAX_STEPS = 4

INSTRUCTIONS = """Answer the question. Use the calculator for any arithmetic.
Each step is a Thought, then an Action: calculator[expression] or finish[answer].

Question: A box holds 12 pencils. How many pencils are in 7 boxes?
Thought: I should use the calculator to multiply 12 by 7.
Action: calculator[12 * 7]
Observation: 84
Thought: The calculator says 84, so I can finish.
Action: finish[84]

Question: Sam had 50 dollars and spent 18. How much is left?
Thought: I should use the calculator to subtract 18 from 50.
Action: calculator[50 - 18]
Observation: 32
Thought: The calculator says 32, so I can finish.
Action: finish[32]
"""

# --- the tool: a calculator that evaluates arithmetic safely (no eval) ------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


# --- the agent --------------------------------------------------------------------------------

@rl.function
def agent(s, question):
    s += INSTRUCTIONS + "\nQuestion: " + question + "\n"
    for step in range(MAX_STEPS):
        s += "Thought:" + rl.gen(f"thought_{step}", max_tokens=MAX_TOKENS, stop="\n") + "\n"
        s += "Action: " + rl.select(f"action_{step}", choices=["calculator", "finish"]) + "["
        if s[f"action_{step}"] == "finish":
            s += rl.gen("answer", max_tokens=MAX_TOKENS, stop=["]", "\n"]) + "]\n"
            return step + 1
        # the constraint: digits, operators, parentheses and spaces, closed by "]"
        s += rl.gen(f"expression_{step}", regex=r"[0-9(][0-9+\-*/(). ]{0,40}\]", max_tokens=MAX_TOKENS) + "\n"
        expression = s[f"expression_{step}"].rstrip("]")
        s[f"observation_{step}"] = calculator(expression)   # the tool call, in plain Python
        s += "Observation: " + s[f"observation_{step}"] + "\n"
    return MAX_STEPS


def main(backend=None) -> dict:
    backend = backend or rl.Engine(model="smollm2-135m")
    question = "A shop sold 135 apples on Monday and 87 on Tuesday. How many apples did it sell?"
    state = agent.run(question=question, backend=backend, temperature=0)
    print(state.text()[len(INSTRUCTIONS):])
    steps = state.ret_value
    calls = [(state[f"expression_{i}"].rstrip("]"), state[f"observation_{i}"])
             for i in range(steps) if f"expression_{i}" in state]
    answer = state["answer"] if "answer" in state else None
    return {"steps": steps, "tool_calls": calls, "answer": answer, "text": state.text()}


if __name__ == "__main__":
    main()
