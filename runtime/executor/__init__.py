"""Running the model: weights in, logits out.

``loader.py`` resolves and loads a model (HF folder, GGUF, the built-in alias) and its tokenizer;
``models/`` holds our Llama-family modules and their CPU matmul kernels; ``kv_pool.py`` the
token-granular KV pool, the request->token table and the slot allocator; ``forward_batch.py`` the
flat per-step batch description built once on the host; ``attention/`` the attention backends
behind one interface; ``model_runner.py`` ties them together (``forward(batch) -> logits``).
"""
