"""Llama-family decoders over the KV pool: Llama, Qwen2, Mistral, Qwen3, Phi-3, and the sparse MoE
members Mixtral and Qwen3-MoE.

One implementation: the architectures differ in q/k/v biases (Qwen2), per-head q/k RMSNorm before
RoPE (Qwen3), partial rotary and LongRoPE (Phi-3 / Phi-4-mini), the MLP (dense, or top-k routed
experts: models/moe.py) and config names. Q/K/V and gate/up projections are fused at load time (Phi-3
ships them fused) so a layer runs four matmuls, which matters for small decode batches on CPU.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.executor.attention.base import AttentionBackend
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.model_config import head_shape
from radixlm.runtime.executor.models.linear import Linear, linear
from radixlm.runtime.executor.models.moe import SparseMoE


def rope_config(config) -> tuple[float, dict]:
    """(theta, scaling dict) across transformers versions (rope_parameters in v5, rope_scaling in v4)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    merged = {**scaling, **params}
    merged.pop("rope_theta", None)
    for name in ("partial_rotary_factor", "original_max_position_embeddings"):  # top-level in older configs
        if name not in merged and getattr(config, name, None) is not None:
            merged[name] = getattr(config, name)
    merged.setdefault("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    return float(theta), merged


def rotary_dim(head_dim: int, scaling: dict) -> int:
    """The leading dims of a head that RoPE rotates (Phi-4-mini rotates 3/4 of them)."""
    return int(head_dim * float(scaling.get("partial_rotary_factor", 1.0)))


def rope_angles(dim: int, max_positions: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """(angles [max_positions, dim / 2], the factor cos and sin are scaled by).

    LongRoPE (Phi-3 long-context, Phi-4-mini) divides each frequency by its short factor within the
    original context and by its long factor past it. The reference picks one set for a whole
    sequence by its length; here it is chosen per position, so a cached prefix's keys never
    change with what follows them. Up to the original context (4,096 tokens for Phi-3-mini and
    Phi-4-mini) both agree."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return torch.outer(positions, rope_inv_freq(dim, theta, scaling)), 1.0
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or (scaling.get("max_position_embeddings") or original) / original
    scale = scaling.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (torch.tensor(scaling[k], dtype=torch.float32) * theta ** shape)
                   for k in ("short_factor", "long_factor"))
    angles = torch.where((positions < original)[:, None], torch.outer(positions, short), torch.outer(positions, long))
    return angles, float(scale)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, longrope)")


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their positions. `tables` is looked up once per step and shared by every
    layer; `forward` rotates q and k together, as one view of the fused projection's output."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        self.dim = rotary_dim(head_dim, scaling)
        self.partial = self.dim < head_dim
        freqs, scale = rope_angles(self.dim, max_positions, theta, scaling)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): sign flips are exact, so this is
        # bit for bit the reference's formula with one negation fewer per call
        sin = freqs.sin() * scale
        self.register_buffer("sin_signed", torch.cat([-sin, sin], dim=-1), persistent=False)
        self.half = self.dim // 2

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [T, 1, D] for a step's positions."""
        return (self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype))

    def forward(self, tables: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated: x * cos + rotate_half(x) * sin."""
        cos, sin = tables
        if self.partial:  # the dims past the rotary ones pass through
            rot = x[..., :self.dim]
            rot = rot * cos + torch.cat([rot[..., self.half:], rot[..., :self.half]], dim=-1) * sin
            return torch.cat([rot, x[..., self.dim:]], dim=-1)
        return x * cos + torch.cat([x[..., self.half:], x[..., :self.half]], dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.fused(x)
        # the HF reference's ops, in float32 (bf16 runs agree with it). F.rms_norm gives the same bits
        # but on the CPU takes 4x as long on a long prefill and is no faster on one row
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """One kernel on CUDA where the reference's ops are seven, which would make norms about 40% of a
        decode step's kernels (benchmarks/README.md, "GPU"). It rounds once
        where the reference rounds twice in half precision."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config, layer_id: int, attn: AttentionBackend, rope: RotaryEmbedding, qkv_bias: bool,
                 qk_norm: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = head_shape(config)
        self.qk_norm = qk_norm
        if qk_norm:  # Qwen3: each head's q and k RMS-normalized before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.layer_id = layer_id
        # the layer's number as a tensor: a traced layer's ops then take it as an input, not a constant,
        # so one compiled layer serves them all (executor/compiled_forward.py)
        self.register_buffer("layer_tag", torch.tensor([layer_id]), persistent=False)
        self.attn = attn
        self.rope = rope

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None, rope_tables) -> torch.Tensor:
        # heads first, then slices: a view of a slice would make torch.compile trace a stride that differs
        # for one token (compiled_forward.py wants one graph for every token count)
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = qkv[:, :self.num_heads + self.num_kv_heads]
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        qk = self.rope(rope_tables, qk)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # strided views, like v
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        if batch is None:  # traced by torch.compile: the backend runs behind an op (executor/compiled_forward.py)
            out = torch.ops.radixlm.attention(q, k, v, self.layer_tag)
        else:
            out = self.attn.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(-1, self.q_size))

    def forward_fused(self, x: torch.Tensor, batch: ForwardBatch, rope_tables) -> torch.Tensor:
        """`forward` on the Triton backend: RoPE and the K/V writes in one kernel, the attention
        reading the pool only (models/triton_layer_ops.py)."""
        from radixlm.runtime.executor.models.triton_layer_ops import rope_store

        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            heads = self.num_heads + self.num_kv_heads
            qkv = torch.cat([self.q_norm(qkv[:, :self.num_heads]), self.k_norm(qkv[:, self.num_heads:heads]),
                             qkv[:, heads:]], dim=1)
        pool = batch.kv_pool
        q = rope_store(qkv, *rope_tables, self.num_heads, self.num_kv_heads, batch.out_cache_loc,
                       pool.k[self.layer_id], pool.v[self.layer_id])
        out = self.attn.forward(q, None, None, self.layer_id, batch, stored=True)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config, inter: int | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.inter = inter or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = Linear(self.inter, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")

    fused_ops = False  # SiLU(gate) * up as one Triton kernel (set by a model on the Triton backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops:
            from radixlm.runtime.executor.models.triton_layer_ops import silu_mul

            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id, attn, rope, qkv_bias, qk_norm: bool, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, attn, rope, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    @torch.compiler.nested_compile_region  # traced once for every layer (a no-op in eager mode)
    def forward(self, h: torch.Tensor, batch: ForwardBatch | None, rope_tables) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch, rope_tables)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, h: torch.Tensor, y: torch.Tensor, batch: ForwardBatch, rope_tables,
                      next_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` on the Triton backend's fused ops: ``h`` the residual stream and ``y`` its copy
        normalized by this layer's input norm; returns the layer's output and its copy normalized by
        ``next_norm`` (the next layer's input norm; None: the output alone), each residual add fused
        into the norm after it."""
        from radixlm.runtime.executor.models.triton_layer_ops import add_rms_norm

        post = self.post_attention_layernorm
        h, y = add_rms_norm(h, self.self_attn.forward_fused(y, batch, rope_tables), post.weight, post.eps)
        m = self.mlp(y)
        if next_norm is None:
            return h + m, None
        return add_rms_norm(h, m, next_norm.weight, next_norm.eps)


class LlamaForCausalLM(nn.Module):
    qkv_bias_default = False
    qk_norm = False
    graph_safe = True  # a CUDA graph can hold its decode (on CUDA even routed experts run with no host read)
    compile_safe = True  # torch.compile's one graph can hold its forward (set False by routed experts: the CPU's
    # grouped experts read their counts on the host)
    windowed = False  # its layers apply the config's sliding window themselves (else the context is capped at it)
    onednn = False  # matmuls on oneDNN (set_gemm)
    min_rows = 1  # matmuls of fewer rows are padded to this many (set_gemm)
    fused_ops = False  # the layers' small ops as Triton kernels (on the Triton backend, see __init__)

    def __init__(self, config, attn: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = config
        head_dim = head_shape(config).head_dim
        theta, scaling = rope_config(config)
        self.rope = rope = RotaryEmbedding(head_dim, max_positions, theta, scaling)
        qkv_bias = getattr(config, "attention_bias", self.qkv_bias_default) or self.qkv_bias_default
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, attn, rope, qkv_bias, self.qk_norm, self.make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.compile_safe = not any(isinstance(layer.mlp, SparseMoE) for layer in self.layers)
        # on the Triton backend (CUDA, or the CPU under TRITON_INTERPRET) the layers' small ops run as
        # fused Triton kernels (models/triton_layer_ops.py)
        self.fused_ops = getattr(attn, "reads_pool_only", False)
        for layer in self.layers:
            if isinstance(layer.mlp, MLP):
                layer.mlp.fused_ops = self.fused_ops
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return MLP(config)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the new tokens of `batch`; returns logits [len(batch.logits_indices), vocab]."""
        return self.run(batch.input_ids, batch.positions, batch.logits_indices, batch)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
            batch: ForwardBatch | None = None) -> torch.Tensor:
        """`forward` on the batch's tensors. Without `batch` (torch.compile traces this, see
        executor/compiled_forward.py) the attention backend is reached through an op that finds the step."""
        h = self.embed_tokens(input_ids)
        rope_tables = self.rope.tables(positions, h.dtype)
        if self.fused_ops and batch is not None:
            h = self._fused_layers(h, batch, rope_tables)
        else:
            for layer in self.layers:
                h = layer(h, batch, rope_tables)
        h = self.norm(h[logits_indices])
        head = getattr(self, "lm_head", None)  # tied embeddings have none, until quantization packs one
        if head is None:
            return linear(h, self.embed_tokens.weight, None, self.onednn, self.min_rows)
        return head(h)

    def _fused_layers(self, h: torch.Tensor, batch: ForwardBatch, rope_tables) -> torch.Tensor:
        from radixlm.runtime.executor.models.triton_layer_ops import add_rms_norm

        norm = self.layers[0].input_layernorm
        y = add_rms_norm(h, None, norm.weight, norm.eps)[1]
        for i, layer in enumerate(self.layers):
            following = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            h, y = layer.forward_fused(h, y, batch, rope_tables, following)
        return h

    def input_scale_folds(self) -> dict[str, tuple[str, slice | None]]:
        """Where int8 smoothing's input scale of a Linear can be applied for free (executor/cpu/quantization.py):
        linear -> (a norm's weight, None) when the linear's input is that norm's output, or (another
        linear, its output rows) when the input is those rows times something per channel (down_proj's
        input is silu(gate) * up). o_proj's input mixes the heads of a group, so it keeps its scale."""
        folds: dict[str, tuple[str, slice | None]] = {}
        for i, layer in enumerate(self.layers):
            folds[f"layers.{i}.self_attn.qkv_proj"] = (f"layers.{i}.input_layernorm.weight", None)
            if not isinstance(layer.mlp, MLP):  # experts are not Linears: nothing is smoothed
                continue
            inter = layer.mlp.inter
            folds[f"layers.{i}.mlp.gate_up_proj"] = (f"layers.{i}.post_attention_layernorm.weight", None)
            folds[f"layers.{i}.mlp.down_proj"] = (f"layers.{i}.mlp.gate_up_proj", slice(inter, 2 * inter))
        return folds

    def set_gemm(self, gemm: str, min_rows: int = 1) -> None:
        """'onednn' or 'torch' (see models/linear.py) for every matmul of the model, each run on at
        least `min_rows` rows (deterministic inference)."""
        self.onednn = gemm == "onednn"
        self.min_rows = min_rows
        for module in self.modules():
            if isinstance(module, Linear):
                module.onednn = self.onednn
                module.min_rows = min_rows

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Takes HF-named tensors; fuses q/k/v and gate/up, stacks experts. Raises on missing or
        unexpected names."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        pending: dict[str, dict[int, torch.Tensor]] = {}
        experts: dict[str, set[tuple[int, str]]] = {}  # per MoE block: the (expert, part) pieces loaded
        loaded = set()
        for name, tensor in weights.items():
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            expert = _EXPERT.fullmatch(name)
            if expert is not None:
                block, index, part = expert.group(1), int(expert.group(2)), _EXPERT_PARTS[expert.group(3)]
                module = self.get_submodule(block)
                if not isinstance(module, SparseMoE) or index >= module.w2.shape[0]:
                    raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
                module.load_expert(index, part, tensor)
                experts.setdefault(block, set()).add((index, part))
                continue
            name = _stacked_name(name) or name
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, index = fused[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                pending.setdefault(key, {})[index] = tensor
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        for key, pieces in pending.items():
            if key not in params or sorted(pieces) != list(range(len(pieces))):
                raise ValueError(f"cannot fuse weights into {key!r}")
            params[key].data.copy_(torch.cat([pieces[i] for i in range(len(pieces))], dim=0))
            loaded.add(key)
        for block, pieces in experts.items():
            count = self.get_submodule(block).w2.shape[0]
            if len(pieces) == 3 * count:
                loaded |= {f"{block}.w13", f"{block}.w2"}
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"missing weights: {missing[:5]}{'...' if len(missing) > 5 else ''}")


# one expert's matrix in the per-expert checkpoint layout (Qwen3-MoE's names, then Mixtral's)
_EXPERT = re.compile(r"(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# transformers' stacked layout: every expert's gate and up rows in one tensor, and their down
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def _stacked_name(name: str) -> str | None:
    """`layers.N.mlp.experts.gate_up_proj` -> `layers.N.mlp.w13` (None for any other name)."""
    head, _, last = name.rpartition(".experts.")
    return f"{head}.{_STACKED[last]}" if head and last in _STACKED else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4-mini: the checkpoint's projections come fused; partial rotary and LongRoPE
    are read from the config by `rope_config`."""


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return SparseMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                         config.num_experts_per_tok, normalize=True)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config, layer_id: int) -> nn.Module:
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
        step = getattr(config, "decoder_sparse_step", 1) or 1
        if (num_experts > 0 and layer_id not in (getattr(config, "mlp_only_layers", None) or [])
                and (layer_id + 1) % step == 0):
            return SparseMoE(config.hidden_size, config.moe_intermediate_size, num_experts,
                             config.num_experts_per_tok, normalize=bool(getattr(config, "norm_topk_prob", False)))
        return MLP(config)
