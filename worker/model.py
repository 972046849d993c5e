"""The Llama architecture over a flat ragged batch (no padding) and a paged KV cache.

Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and Gemma share this code: RMSNorm, rotary position
embeddings (default, linear or llama3 scaling), grouped-query attention with optional biases
(and, in Qwen3, an RMSNorm of each head's q and k before RoPE), a gated MLP (SwiGLU, or
Gemma's GELU) and optionally tied embeddings (Gemma also scales its embeddings by the square
root of the hidden size and stores its norms' weights as offsets from 1). The projections
for q/k/v and for gate/up are fused into one matrix each, so a layer is four matrix
products; :meth:`LlamaModel.weight_map` tells the loader which slice of which parameter
each checkpoint tensor fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig


class RMSNorm(nn.Module):
    """``offset``: Gemma stores each weight as its offset from 1 and scales in float32."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def _norm(config: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, config.norm_offset)


class Rotary(nn.Module):
    """cos/sin tables for every position, computed once; rotate-half layout as in HF."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv = config.rope.inv_freq(config.head_dim)
        freqs = torch.outer(torch.arange(config.max_position, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin of this step's positions, looked up once and shared by every layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(
            1
        )


RopeTables = tuple[torch.Tensor, torch.Tensor]


def apply_rope(
    tables: RopeTables, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = tables
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.scale = self.head_dim**-0.5
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # one weight per channel of a head, shared by the heads
            self.q_norm = _norm(config, self.head_dim)
            self.k_norm = _norm(config, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(rope, q, k)
        cache = kv_cache[self.layer]
        out = paged_attention(q, k, v, cache[0], cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=config.mlp_bias)

        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = _norm(config, config.hidden_size)
        self.post_attention_layernorm = _norm(config, config.hidden_size)

    def forward(
        self, x: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class TensorTarget:
    """Where one checkpoint tensor goes: a parameter and the rows it fills."""

    param: str
    rows: slice | None
    shape: tuple[int, ...]


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = _norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a flat batch of ``T`` tokens."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: rounded to the model's dtype first, as HF
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        rope = self.rotary.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def weight_map(self) -> dict[str, TensorTarget]:
        """Every tensor a Hugging Face checkpoint of this config must hold."""
        c = self.config
        h, inter = c.hidden_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        out: dict[str, TensorTarget] = {}

        def linear(
            src: str, dst: str, out_features: int, in_features: int, bias: bool, rows=None
        ) -> None:
            """A projection's weight (and bias), possibly into ``rows`` of a fused one."""
            out[f"{src}.weight"] = TensorTarget(f"{dst}.weight", rows, (out_features, in_features))
            if bias:
                out[f"{src}.bias"] = TensorTarget(f"{dst}.bias", rows, (out_features,))

        out["model.embed_tokens.weight"] = TensorTarget(
            "embed_tokens.weight", None, (c.vocab_size, h)
        )
        out["model.norm.weight"] = TensorTarget("norm.weight", None, (h,))
        if not c.tie_word_embeddings:
            linear("lm_head", "lm_head", c.vocab_size, h, False)
        fused = {
            "self_attn.qkv_proj": [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)],
            "mlp.gate_up_proj": [("gate", 0, inter), ("up", inter, inter)],
        }
        for i in range(c.num_layers):
            src, dst = f"model.layers.{i}", f"layers.{i}"
            for target, parts in fused.items():
                bias = c.qkv_bias if target.startswith("self_attn") else c.mlp_bias
                module = target.split(".")[0]
                for name, start, n in parts:
                    rows = slice(start, start + n)
                    linear(f"{src}.{module}.{name}_proj", f"{dst}.{target}", n, h, bias, rows)
            linear(f"{src}.self_attn.o_proj", f"{dst}.self_attn.o_proj", h, q, c.o_bias)
            if c.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    out[f"{src}.self_attn.{norm}.weight"] = TensorTarget(
                        f"{dst}.self_attn.{norm}.weight", None, (c.head_dim,)
                    )
            linear(f"{src}.mlp.down_proj", f"{dst}.mlp.down_proj", h, inter, c.mlp_bias)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"{src}.{norm}.weight"] = TensorTarget(f"{dst}.{norm}.weight", None, (h,))
        return out
