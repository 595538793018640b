"""Activation statistics for int8 smoothing: one float32 prefill of a fixed text through the model.

`input_channel_max(model, attn_backend, ids)` returns, for every Linear module, the largest |x| each
input channel took over the prefill. `executor/cpu/quantization.py` uses them to move activation outliers
into the weights before quantizing (per-channel smoothing, as in SmoothQuant, arXiv 2211.10438): the
per-token int8 activations of a small model lose far less that way (`benchmarks/README.md`, "CPU weight formats").

`CALIBRATION_TEXT` was written for this purpose (prose, chat turns, code, numbers, JSON, a few other
languages) and is not the text `benchmarks/quality.py` scores.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardBatch, ForwardMode
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool
from radixlm.runtime.executor.model_config import head_shape

CALIBRATION_TEXT = """\
The river town woke slowly. By six the bakery on the corner had its lights on, and the smell of bread \
drifted across the square where the market stalls were going up. A delivery van backed into the lane, \
beeping, while two cyclists argued about the quickest road to the station. Nobody was in a hurry yet; \
the first ferry would not leave until a quarter past seven.

Photosynthesis turns light into chemical energy. In the chloroplasts of a leaf, chlorophyll absorbs \
mostly red and blue light, splits water molecules, and releases oxygen. The energy captured this way \
drives the Calvin cycle, which fixes carbon dioxide into three-carbon sugars. Plants then build starch, \
cellulose and, eventually, everything that eats them.

User: How do I reverse a list in Python?
Assistant: You can call `items.reverse()` to reverse the list in place, or write `items[::-1]` to get a \
reversed copy. For example:

    numbers = [3, 1, 4, 1, 5]
    numbers.reverse()
    print(numbers)  # [5, 1, 4, 1, 3]

User: What is the difference between a process and a thread?
Assistant: A process has its own memory space; threads inside one process share memory. Switching \
between threads is cheaper, but shared memory means you need locks or queues to avoid races.

Quarterly results: revenue rose 12.4% to $3.18 billion, operating margin was 21%, and the company \
expects 2,500 new hires by March. Shares closed at 147.25, up 3.6 points.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id \
GROUP BY name ORDER BY orders DESC LIMIT 10;

Recipe for a simple tomato soup: soften one chopped onion and two cloves of garlic in olive oil, add a \
kilo of ripe tomatoes, a pinch of salt and a cup of stock, simmer for twenty minutes, then blend until \
smooth. Serve with basil and a slice of toasted bread.

{"id": 42, "name": "sensor-7", "readings": [21.5, 21.7, 22.0], "status": "ok", "tags": ["lab", "north"]}

The committee met on Tuesday to review the proposal. Several members worried about the cost of \
maintenance over ten years; others pointed out that the current system already fails twice a month. \
After a long discussion they agreed to fund a pilot in two districts and to report back in the spring.

In mathematics, a prime number is a natural number greater than 1 that has no divisors other than 1 \
and itself. The first primes are 2, 3, 5, 7, 11 and 13. Euclid showed that there are infinitely many: \
multiply any finite list of primes together, add one, and the result has a prime factor missing from \
the list.

Dear Ms. Alvarez, thank you for your letter of 4 June. I am pleased to confirm your appointment as \
project coordinator from the first of next month. Please bring your identity documents to the front \
desk on your first day. Kind regards, J. Okafor.

Les enfants jouaient dans le jardin pendant que leurs parents préparaient le dîner. Der Zug nach Berlin \
hat heute zwanzig Minuten Verspätung. El mercado abre todos los días a las ocho de la mañana.

Troubleshooting: if the device does not turn on, hold the power button for ten seconds, connect the \
charger, and wait until the light turns green. If the screen stays black, reset the device by pressing \
the small button on the back with a paper clip.

Once upon a time a fox found a bunch of grapes hanging from a high vine. He jumped and jumped but could \
not reach them. At last he walked away, saying to himself that the grapes were probably sour anyway.
"""


def prefill_once(model: nn.Module, attn_backend, ids: list[int]) -> torch.Tensor:
    """Runs `ids` as one request's prefill on a KV pool of its own (CPU, float32); the last token's logits."""
    cfg, n, cpu = model.config, len(ids), torch.device("cpu")
    _, kv_heads, head_dim = head_shape(cfg)
    kv_pool = KVPool(n, cfg.num_hidden_layers, kv_heads, head_dim, torch.float32, cpu)
    table = ReqToTokenPool(1, n + 1, cpu, dummy_slot=kv_pool.dummy_slot)
    row, slots = table.alloc(), torch.arange(n)
    table.write(row, 0, slots)
    plan = BatchPlan(ForwardMode.EXTEND, list(ids), slots, [row], [0], [n], [n - 1])
    batch = ForwardBatch.build(plan, table, kv_pool, cpu)
    attn_backend.init_forward_metadata(batch)
    return model(batch)


def input_channel_max(model: nn.Module, attn_backend, ids: list[int], window: int = 512) -> dict[str, torch.Tensor]:
    """name -> max |input| per input channel, for every nn.Linear module that prefills of `ids` run
    (in pieces of at most `window` tokens, which must fit the model's context)."""
    stats: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            stats[name] = torch.maximum(stats[name], x) if name in stats else x
        return hook

    hooks = [m.register_forward_pre_hook(record(name)) for name, m in model.named_modules()
             if isinstance(m, nn.Linear)]
    try:
        for start in range(0, len(ids), window):
            prefill_once(model, attn_backend, ids[start:start + window])
    finally:
        for h in hooks:
            h.remove()
    return stats
