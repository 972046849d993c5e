"""The worker server's settings: one validated object, from flags and ``KVPOOL_*`` variables."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvpool.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED
from kvpool.signing import check_secret

from .engine import EngineConfig
from .sim import TimingModel

_WILDCARDS = {"", "0.0.0.0", "::", "*"}


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="a Hugging Face model directory")
    served_model_name: str | None = None  # default: the directory's name
    engine: Literal["kvpool", "sim"] = "kvpool"
    role: Literal["both", "prefill", "decode"] = "both"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # engine
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1)
    hash_seed: str = DEFAULT_HASH_SEED
    num_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_fraction: float | None = Field(None, gt=0, le=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    # decode attention: "paged" reads the cache in place (FlexAttention through Triton on
    # CUDA, a C kernel built on first use on CPU), "gather" copies each context into padded
    # batches (no compiler needed), "flex" is FlexAttention on any device; auto is paged on
    # CUDA and gather elsewhere; see kvpool.worker.attention
    attention: Literal["auto", "gather", "paged", "flex"] = "auto"
    seed: int = 0
    # serving
    max_waiting_tokens: int | None = Field(None, ge=1)  # default: 8 steps' worth of tokens
    max_request_body_bytes: int = Field(4 * 2**20, ge=1024)
    drain_timeout_s: float = Field(30.0, ge=0)
    # KV events
    kv_events_endpoint: str | None = None  # e.g. tcp://*:5557; None: no events
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_encoding: Literal["array", "map"] = "array"
    # prefill/decode hand-off
    kv_pin_timeout_s: float = Field(30.0, gt=0)
    kv_transfer_host: str | None = None  # the address decode workers reach us at
    kv_transfer_timeout_s: float = Field(30.0, gt=0)  # connecting, and each read of a pull
    # a whole pull, however its bytes trickle in: past it, the blocks that came whole are
    # kept and the rest of the prompt is computed here
    kv_transfer_deadline_s: float = Field(120.0, gt=0)
    # the pool's shared secret (router and workers): signs and checks hand-offs, and keys
    # the admin token and the KV event sockets' password. Unset: no hand-offs, admin from
    # loopback only, KV event sockets open. A file (a mounted Secret) works as well.
    pool_secret: SecretStr | None = None
    pool_secret_file: Path | None = None
    # the simulated engine's timing model (milliseconds; see kvpool.worker.sim)
    sim_a: float = TimingModel.a
    sim_b: float = TimingModel.b
    sim_c: float = TimingModel.c
    sim_d: float = TimingModel.d
    sim_e: float = TimingModel.e
    sim_f: float = TimingModel.f
    sim_time_scale: float = Field(TimingModel.time_scale, ge=0)
    sim_kv_bytes_per_token: int = Field(TimingModel.kv_bytes_per_token, ge=0)
    sim_transfer_gb_s: float = Field(TimingModel.transfer_gb_s, gt=0)

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model} is not a model directory (no config.json)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                f"max_num_seqs={self.max_num_seqs}"
            )
        if self.pool_secret_file is not None:
            if self.pool_secret is not None:
                raise ValueError("give pool_secret or pool_secret_file, not both")
            self.pool_secret = SecretStr(read_secret_file(self.pool_secret_file))
        if self.pool_secret is not None:
            check_secret(self.pool_secret.get_secret_value())
        return self

    @property
    def secret(self) -> str | None:
        """The pool secret's text, or ``None`` (never log it)."""
        return self.pool_secret.get_secret_value() if self.pool_secret is not None else None

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def waiting_token_limit(self) -> int:
        return self.max_waiting_tokens or 8 * self.max_num_batched_tokens

    def engine_config(self) -> EngineConfig:
        """The engine's settings: the fields both share, by name."""
        shared = {f.name for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{k: v for k, v in self.model_dump().items() if k in shared})

    def timing(self) -> TimingModel:
        return TimingModel(
            self.sim_a,
            self.sim_b,
            self.sim_c,
            self.sim_d,
            self.sim_e,
            self.sim_f,
            self.sim_time_scale,
            self.sim_kv_bytes_per_token,
            self.sim_transfer_gb_s,
        )

    def advertised_host(self) -> str:
        """Where other workers reach this one: the flag, else the pod's IP, else the bind
        address (or this host's address when bound to all interfaces)."""
        if self.kv_transfer_host:
            return self.kv_transfer_host
        if os.environ.get("POD_IP"):
            return os.environ["POD_IP"]
        if self.host not in _WILDCARDS:
            return self.host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def read_secret_file(path: Path) -> str:
    """A secret kept in a file (a mounted Kubernetes Secret), without its final newline."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the pool secret file {path}: {type(exc).__name__}") from None
    secret = text.strip()
    if not secret:
        raise ValueError(f"the pool secret file {path} is empty")
    return secret
