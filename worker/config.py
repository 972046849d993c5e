"""What the engine needs to know about a checkpoint, read from its Hugging Face ``config.json``.

One class covers the Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and Gemma (1) differ
only in flags (attention bias, tied embeddings, RoPE scaling, Qwen3's RMSNorm of each head's
q and k; Gemma's scaled embeddings, GELU MLP and RMSNorm weights stored as offsets from 1),
so they share one model. Gemma 2 and 3 are refused: they alternate sliding-window layers and
cap their logits, which this engine's attention does not do.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: architectures (``config.json`` ``architectures[0]``) this engine runs, by model type
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
}

#: MLP activations by their Hugging Face names (``hidden_act``, or Gemma's
#: ``hidden_activation``): SiLU, and the GELUs Gemma checkpoints name
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelLoadError(ValueError):
    """A model directory this engine cannot run, with the reason in the message."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        # transformers 5 writes ``rope_parameters`` (theta inside); older checkpoints write
        # ``rope_theta`` and an optional ``rope_scaling``.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise ModelLoadError(
                f"unsupported RoPE scaling {kind!r}: this engine runs default, linear and llama3"
            )
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    sliding_window: int | None = None  # Mistral v0.1: attention limited to this many tokens
    qk_norm: bool = False  # Qwen3: each head's q and k RMS-normalised before RoPE
    hidden_act: str = "silu"  # the MLP's gate activation (one of ACTIVATIONS)
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + weight)

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
        generation = Path(model_dir) / "generation_config.json"
        gen = json.loads(generation.read_text()) if generation.is_file() else {}
        return ModelConfig.from_hf(cfg, gen, where=str(path))

    @staticmethod
    def from_hf(
        cfg: dict[str, Any], generation: dict[str, Any] | None = None, where: str = "config"
    ) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{where}: unsupported architecture {arch!r}; this engine runs "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            gemma = model_type == "gemma"
            act = (cfg.get("hidden_activation") if gemma else None) or cfg.get("hidden_act")
            act = act or ("gelu_pytorch_tanh" if gemma else "silu")
            if act not in ACTIVATIONS:
                raise ModelLoadError(
                    f"{where}: hidden_act {act!r} is not one of {', '.join(ACTIVATIONS)}"
                )
            if heads % kv_heads:
                raise ModelLoadError(
                    f"{where}: {heads} attention heads do not divide into {kv_heads} KV heads"
                )
            eos: Any = (generation or {}).get("eos_token_id", cfg.get("eos_token_id"))
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            attention_bias = bool(cfg.get("attention_bias", False))
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            layer_types = cfg.get("layer_types") or []
            if any(t != "full_attention" for t in layer_types):
                kinds = sorted(set(layer_types) - {"full_attention"})
                raise ModelLoadError(
                    f"{where}: layers of type {', '.join(map(repr, kinds))}; this engine runs "
                    "full attention in every layer"
                )
            return ModelConfig(
                architecture=arch,
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position=int(cfg.get("max_position_embeddings", 4096)),
                rope=RopeConfig.from_hf(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has biases on q, k and v, never on o; Llama's flag covers all four.
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type != "qwen2" and attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
                sliding_window=int(window) if window else None,
                qk_norm=model_type == "qwen3",
                hidden_act=act,
                embed_scale=math.sqrt(hidden) if gemma else 1.0,
                norm_offset=1.0 if gemma else 0.0,
            )
        except KeyError as exc:
            raise ModelLoadError(f"{where}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"{where}: {exc}") from None
