"""Choosing the next tokens: ``kernels.py`` turns a batch of logits into ids (greedy, temperature,
top-k/p, min-p, penalties, seeded draws, logprobs) with tensors on the logits' device; ``step.py``
samples one scheduler step (grammar masks, one copy back, a failing row isolated from the rest)."""
