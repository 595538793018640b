"""Gemma 3 (text) over the KV pool.

Gemma 3 differs from the Llama family in every layer: token embeddings scaled by sqrt(hidden),
RMSNorms that multiply by (1 + w) in float32, a norm after attention and after the MLP as well as
before each, GeGLU (tanh-approximated GELU) MLPs, per-head q/k norms, a query scale of its own
(`query_pre_attn_scalar`), and interleaved sliding-window and global layers, each kind with its own
RoPE base.

A sliding layer's query sees itself and the window - 1 keys before it. A backend with sliding
windows (`supports_window`: the Triton kernels) applies it itself, reading nothing on the host, so
decode runs in CUDA graphs. Otherwise, while no sequence of a step is longer than the window, that
is every key and the layer runs on the backend like a global one; past it, `windowed_attention`
attends each request over the window's keys, read from the pool by position (a decode step's rows
in one call), so a cached prefix longer than the window gives the reference's answer. That reads
the step's lengths on the host, so a CUDA graph cannot record it: the model runs eager there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.executor.attention.base import AttentionBackend
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.executor.model_config import head_shape
from radixlm.runtime.executor.models.linear import Linear, linear
from radixlm.runtime.executor.models.llama import LlamaForCausalLM, RotaryEmbedding

SLIDING, GLOBAL = "sliding_attention", "full_attention"


class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    return [GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


def layer_rope(config, kind: str) -> tuple[float, dict]:
    """(theta, scaling) of one kind of layer: transformers 5 keeps them per kind in rope_parameters;
    older configs name the global base rope_theta (with rope_scaling) and the local one rope_local_base_freq."""
    params = getattr(config, "rope_parameters", None) or {}
    if kind in params:
        p = dict(params[kind])
        return float(p.pop("rope_theta")), p
    if kind == SLIDING:
        return float(getattr(config, "rope_local_base_freq", 10000.0)), {}
    return float(getattr(config, "rope_theta", 1000000.0)), dict(getattr(config, "rope_scaling", None) or {})


def windowed_attention(q: torch.Tensor, layer: int, batch: ForwardBatch, window: int, scale: float) -> torch.Tensor:
    """q [T, H, D] of the step's new tokens over the keys of their window (the new K/V already in
    the pool) -> [T, H, D]: a decode step's rows at once, an extend's request by request."""
    pool_k, pool_v = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
    if batch.mode is ForwardMode.DECODE:
        return _windowed_decode(q, pool_k, pool_v, batch, window, scale)
    out = torch.empty_like(q)
    qo = kv = 0
    for n_new, n_all in zip(batch.extend_lens_host, batch.seq_lens_host):
        first = max(0, n_all - n_new - window + 1)  # the earliest key any of its queries sees
        slots = batch.kv_indices[kv + first : kv + n_all]
        keys = pool_k.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        values = pool_v.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(n_all - n_new, n_all, device=q.device)[:, None]
        k_pos = torch.arange(first, n_all, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (q_pos - k_pos < window)
        o = F.scaled_dot_product_attention(q[qo : qo + n_new].transpose(0, 1).unsqueeze(0), keys, values,
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[qo : qo + n_new] = o[0].transpose(0, 1)
        qo, kv = qo + n_new, kv + n_all
    return out


def _windowed_decode(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, batch: ForwardBatch, window: int,
                     scale: float) -> torch.Tensor:
    """Each row's one query over its last `window` keys, read from the req->token table, in one
    attention call: rows with fewer keys are padded and the padding masked (whole masked blocks
    add nothing to a row's softmax, so its answer does not depend on the others' lengths)."""
    seq = batch.seq_lens
    width = min(window, max(batch.seq_lens_host))
    pos = (seq - window).clamp_min(0)[:, None] + torch.arange(width, device=q.device)[None, :]
    valid = pos < seq[:, None]
    slots = batch.req_to_token[batch.req_rows[:, None], torch.minimum(pos, seq[:, None] - 1)]
    keys = pool_k[slots].transpose(1, 2)  # [B, KVH, width, D]
    values = pool_v[slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_id: int, attn: AttentionBackend, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = head_shape(config)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.layer_id, self.attn, self.window = layer_id, attn, window
        self.scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        # the backends scale by 1/sqrt(head_dim): q is rescaled so that their product is Gemma's
        self.q_factor = self.scale * math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: RotaryEmbedding, tables) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        h = self.num_heads
        qk = torch.cat([self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + self.num_kv_heads])], dim=1)
        qk = rope(tables, qk)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + self.num_kv_heads :]
        window = self.window if self.attn.supports_window else None  # the backend applies it
        if self.window is not None and window is None and max(batch.seq_lens_host) > self.window:
            batch.kv_pool.write(self.layer_id, batch.out_cache_loc, k, v)
            out = windowed_attention(q, self.layer_id, batch, self.window, self.scale)
        else:
            out = self.attn.forward(q * self.q_factor if self.q_factor != 1.0 else q, k, v, self.layer_id, batch,
                                    window=window)
        return self.o_proj(out.reshape(-1, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, config.hidden_size, bias=False)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 3 (only gelu_pytorch_tanh)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, attn: AttentionBackend, kind: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.kind = kind
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, layer_id, attn, config.sliding_window if kind == SLIDING else None)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, rope: RotaryEmbedding, tables) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), batch, rope, tables))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    compile_safe = False
    windowed = True

    def __init__(self, config, attn: AttentionBackend, max_positions: int):
        nn.Module.__init__(self)
        self.config = config
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma 3 with attn_logit_softcapping is not supported (Gemma 3's own configs have none)")
        head_dim = head_shape(config).head_dim
        kinds = layer_types(config)
        self.ropes = nn.ModuleDict({kind: RotaryEmbedding(head_dim, max_positions, *layer_rope(config, kind))
                                    for kind in sorted(set(kinds))})
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, attn, kind) for i, kind in enumerate(kinds))
        self.graph_safe = attn.supports_window  # else its sliding layers read the step's lengths
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
            batch: ForwardBatch | None = None) -> torch.Tensor:
        if batch is None:
            raise ValueError("Gemma 3 runs eagerly (its sliding layers read the step's lengths)")
        h = self.embed_tokens(input_ids)
        h = h * self.embed_scale.to(h.dtype)  # in the weights' dtype, as the reference
        tables = {kind: rope.tables(positions, h.dtype) for kind, rope in self.ropes.items()}
        for layer in self.layers:
            h = layer(h, batch, self.ropes[layer.kind], tables[layer.kind])
        h = self.norm(h[logits_indices])
        head = getattr(self, "lm_head", None)
        logits = linear(h, self.embed_tokens.weight, None, self.onednn, self.min_rows) if head is None else head(h)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def input_scale_folds(self) -> dict[str, tuple[str, slice | None]]:
        """None: a (1 + w) norm cannot take a smoothing scale into its weight as a plain one can."""
        return {}
