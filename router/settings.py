"""The router's settings: one validated object, from flags and ``KVPOOL_ROUTER_*`` variables."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvpool.cost import COST
from kvpool.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED
from kvpool.httpguard import Network, parse_networks

from .routing.planner import SplitConfig
from .routing.policy import POLICIES, PolicyConfig
from .routing.scorers import SCORERS
from .state.discovery import WorkerEndpoint, parse_static_worker
from .state.worker import PoolConfig

ENV_PREFIX = "KVPOOL_ROUTER_"


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the workers' model directory: tokenizer and chat template")
    served_model_name: str | None = None  # default: the directory's name
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    # router processes accepting from one listening socket, one per core to use; they
    # share their load through the peer link (router/processes.py)
    processes: int = Field(1, ge=1, le=64)
    # workers: a static list, or Kubernetes pods
    worker: list[str] = Field(default_factory=list)  # URL[,role=..][,events=..][,replay=..]
    discovery: Literal["static", "kubernetes"] = "static"
    namespace: str = "default"
    selector: str = "kvpool.io/component=worker"
    worker_port: str = "8000"  # a number or a container port name
    role_label: str = "kvpool.io/role"
    # Where a discovered worker publishes KV events, for workers without /kvpool/info (vLLM)
    worker_events_port: int | None = Field(None, ge=1, le=65535)
    worker_replay_port: int | None = Field(None, ge=1, le=65535)
    # sent as "Authorization: Bearer ..." to the workers (vLLM's --api-key); without it,
    # a client's own Authorization header is passed on
    worker_api_key: str | None = None
    # hashing: must be the workers'
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1)
    hash_seed: str = DEFAULT_HASH_SEED
    # how a LoRA adapter and a cache salt enter block hashes: tagged, as vLLM 0.32 and
    # kvpool's workers hash them, or bare, as older vLLMs did (the router says which one a
    # worker's KV events show, when they contradict this)
    extra_keys: Literal["tagged", "bare"] = "tagged"
    # policy
    policy: Literal["kvpool", "round-robin", "random", "least-loaded", "prefix-only"] = "kvpool"
    scorer: list[str] = Field(default_factory=list)  # name=weight, replaces the policy's
    guard_ratio: float = Field(COST.guard_ratio, ge=1.0)
    guard_slack: float = Field(COST.guard_slack, ge=0.0)
    # session affinity: a soft score for the worker a conversation was last sent to,
    # keyed by this header (a session is named, never guessed); weight 0 turns it off
    session_header: str = "x-session-id"
    # also key sessions by the body's "user" field when the header is absent: only for
    # clients whose user is one conversation (a backend that sends one user for all its
    # traffic would pin all of it to one worker)
    session_from_user: bool = False
    affinity_weight: float = Field(0.3, ge=0.0)
    session_ttl_s: float = Field(900.0, gt=0)
    session_capacity: int = Field(100_000, ge=1)
    # a request's speculative index entries live while it waits for its first token, then
    # this long for the worker's KV event to confirm them (router/state/index.py); and, as a
    # safety net for a request whose end never comes, a key no request has held anew for
    # speculative_hold_max_s is dropped (no request waits longer than its time limits)
    speculative_ttl_s: float = Field(2.0, gt=0)
    speculative_hold_max_s: float = Field(600.0, gt=0)
    # a request sharing at least this many prompt blocks with one still prefilling them on
    # its worker waits for that prefill before it is sent (kvpool policy; 0: never waits)
    prefix_wait_blocks: int = Field(4, ge=0)
    approx_ttl_s: float = Field(120.0, gt=0)
    approx_capacity_blocks: int = Field(50_000, ge=1)
    # prefill/decode split (the pool's disaggregation): when a request is prefilled on a
    # prefill worker and decoded on another (see policy.SplitConfig)
    pd_mode: Literal["Aggregated", "Disaggregated", "Auto"] = "Auto"
    pd_threshold_tokens: int = Field(512, ge=0)  # Auto: split above this many uncached tokens
    pd_prefill_timeout_s: float = Field(60.0, gt=0)  # one prefill leg; then another, or whole
    # workers' health and load
    health_interval_s: float = Field(0.5, gt=0)
    health_timeout_s: float = Field(1.0, gt=0)
    scrape_interval_s: float = Field(1.0, gt=0)
    models_interval_s: float = Field(10.0, gt=0)  # /v1/models again: adapters come and go
    # the longest a worker waits out of rotation for its KV event history to be replayed
    # into the index (router/state/pool.py)
    index_sync_timeout_s: float = Field(30.0, gt=0)
    # reliability
    max_attempts: int = Field(3, ge=1)
    retry_backoff_s: float = Field(0.05, ge=0)
    breaker_failures: int = Field(3, ge=1)
    breaker_cooldown_s: float = Field(5.0, gt=0)
    # each worker's last answers whose cached tokens (usage) are checked against the
    # index's predictions (0: no check), and the agreement under which it loses cache
    # credit (router/state/agreement.py)
    cache_check_answers: int = Field(32, ge=0, le=10_000)
    cache_check_flag_below: float = Field(0.25, ge=0.0, le=0.5)
    # whole answers (not streamed): the time for all of it
    request_timeout_s: float = Field(600.0, gt=0)
    # streams: the time to the first token (then retried elsewhere), and the longest
    # silence between chunks after it (then ended with an error event)
    first_token_timeout_s: float = Field(300.0, gt=0)
    stream_idle_timeout_s: float = Field(120.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    # requests in flight; more wait in the router (flow control) or get 429. Unset: as many
    # as this process's open files hold, two each (kvpool.httpguard.connections_bound)
    max_concurrency: int | None = Field(None, ge=1)
    max_request_body_bytes: int = Field(4 * 2**20, ge=1024)
    # the token ids of recent prompts' beginnings, kept so that a prompt beginning like one
    # of them is tokenized only past that beginning: at most this much memory
    token_cache_mib: float = Field(64.0, gt=0)
    # the prompt tokens one image, audio or video part of a message counts as in a worker's
    # load (the router cannot run the model's processor); unset: from the model's config
    # (a fixed-size vision encoder's count), else 576
    media_part_tokens: int | None = Field(None, ge=0)
    # how vLLM gives a message's content to the chat template: its own
    # --chat-template-content-format, which the router must follow (auto: read from the
    # template, as vLLM does)
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    drain_timeout_s: float = Field(30.0, ge=0)
    # tenants and keys: a YAML or JSON file of tenants (a mounted Secret, see tenants.py),
    # read again when it changes; without it no key is asked for
    api_keys_file: str | None = None
    api_keys_reload_s: float = Field(5.0, gt=0)
    # the pool's own secret, shared with its kvpool workers: the credential for their KV
    # event replay socket
    pool_secret: SecretStr | None = None
    # router replicas: each binds this ZMQ endpoint and subscribes to the others' (see
    # router/state/peers.py), sharing the load it sends each worker and its speculative entries
    peer_bind: str | None = None
    peer: list[str] = Field(default_factory=list)  # the other replicas' peer endpoints
    # or, with --discovery kubernetes, the other replicas' pods by label (their peer port
    # is --peer-bind's)
    peer_selector: str | None = None
    # flow control: when every eligible worker's predicted TTFT is over this bound (or its
    # decode guard trips), requests wait in the router, in priority bands, fair by tokens
    flow_control: bool = True
    saturation_ttft_s: float = Field(2.0, gt=0)
    queue_max_requests: int = Field(10_000, ge=0)
    queue_max_bytes: int = Field(512 * 2**20, ge=0)
    queue_timeout_s: float = Field(60.0, gt=0)
    priority_header: str = "x-kvpool-priority"  # high, normal or low
    deadline_header: str = "x-kvpool-ttft-deadline-ms"  # shed when the wait will exceed it
    default_max_tokens: int = Field(256, ge=1)  # reserved for tokens/minute when not given
    # abuse resistance: time and size limits on what a client sends
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    max_header_bytes: int = Field(32 * 2**10, ge=1024)
    # connections one address may hold idle or still sending its request (not those in
    # service: behind an ingress every client is one address; kvpool/httpguard.py)
    max_connections_per_client: int = Field(256, ge=1)
    # proxies in front (addresses or CIDR ranges): their connections are never counted, and
    # a request through them comes from the client their forwarding header names
    trusted_proxies: list[str] = Field(default_factory=list)
    client_address_header: Literal["x-forwarded-for", "forwarded"] = "x-forwarded-for"
    # requests in flight from one client address (behind trusted proxies, the client's),
    # for an operator who wants it; unset: no limit (tenants and keys limit one client)
    max_requests_per_client: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> RouterSettings:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model} is not a model directory (no config.json)")
        if self.discovery == "static" and not self.worker:
            raise ValueError("worker: give at least one --worker URL, or --discovery kubernetes")
        self.static_workers()  # a bad or repeated spec is named here, at start-up
        self.trusted_networks()
        if (self.peer or self.peer_selector) and not self.peer_bind:
            raise ValueError("peer, peer_selector: give --peer-bind too (where this one listens)")
        if self.peer_selector and self.discovery != "kubernetes":
            raise ValueError("peer_selector: needs --discovery kubernetes")
        self.policy_config()
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def trusted_networks(self) -> tuple[Network, ...]:
        return parse_networks(self.trusted_proxies)

    def static_workers(self) -> list[WorkerEndpoint]:
        endpoints = [parse_static_worker(spec) for spec in self.worker]
        ids = [e.id for e in endpoints]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker: the same worker is given twice in {ids}")
        return endpoints

    def pool_config(self) -> PoolConfig:
        """The worker pool's settings: the fields both share, by name."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(PoolConfig)}
        secret = {k: v.get_secret_value() for k, v in values.items() if isinstance(v, SecretStr)}
        return PoolConfig(**{**values, **secret})

    def leader_blocks(self) -> int:
        """``prefix_wait_blocks``, for the kvpool policy (the baselines send at once)."""
        return self.prefix_wait_blocks if self.policy == "kvpool" else 0

    def split_config(self) -> SplitConfig:
        return SplitConfig(mode=self.pd_mode, threshold_tokens=self.pd_threshold_tokens)

    def policy_config(self) -> PolicyConfig:
        from dataclasses import replace

        base = POLICIES[self.policy]
        changes: dict[str, object] = {
            "guard_ratio": self.guard_ratio,
            "guard_slack": self.guard_slack,
        }
        if self.scorer:
            weights = []
            for item in self.scorer:
                name, sep, weight = item.partition("=")
                if name not in SCORERS:
                    raise ValueError(
                        f"scorer: unknown scorer {name!r}: choose from {', '.join(SCORERS)}"
                    )
                try:
                    value = float(weight) if sep else 1.0
                except ValueError:
                    raise ValueError(f"scorer: {item!r} is not name=weight") from None
                weights.append((name, value))
            changes["scorers"] = tuple(weights)
        elif self.affinity_weight > 0 and self.policy == "kvpool":
            changes["scorers"] = (*base.scorers, ("affinity", self.affinity_weight))
        return replace(base, **changes)  # type: ignore[arg-type]
