"""The operator's settings: ``kvpool operator run`` flags or ``KVPOOL_OPERATOR_*`` variables."""

from __future__ import annotations

import argparse
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvpool.settings_cli import build_settings, settings_values

from .render import Images

ENV_PREFIX = "KVPOOL_OPERATOR_"
MAX_PRIORITY = 2**31 - 1
_DEFAULT_IMAGES = Images()


class OperatorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: list[str] = Field(default_factory=list)  # none: every namespace
    # default images of the children, when a pool's spec names none
    worker_image: str = _DEFAULT_IMAGES.worker
    worker_cpu_image: str = _DEFAULT_IMAGES.worker_cpu
    vllm_image: str = _DEFAULT_IMAGES.vllm
    router_image: str = _DEFAULT_IMAGES.router
    # how often every pool is reconciled even when nothing was seen to change
    resync_interval_s: float = Field(60.0, gt=0)
    scrape_timeout_s: float = Field(2.0, gt=0)
    # Pools' podTemplates may ask for host access (privileged, host namespaces, hostPath,
    # hostPort): off, whoever may create a pool cannot get this operator's rights through one.
    allow_host_access: bool = False
    # kopf peering: two replicas of the operator with the same name take turns, one active
    peering: str | None = None
    # The highest live priority is the active replica; equal priorities freeze every replica,
    # so unset means a random one, chosen at start (see :func:`peer_priority`).
    priority: int | None = Field(None, ge=0, le=MAX_PRIORITY)
    # how long a replica that stopped sending keep-alives counts as alive (kopf's lifetime)
    peering_lifetime_s: int = Field(60, ge=1, le=3600)
    liveness_port: int | None = Field(None, ge=1, le=65535)
    # Prometheus /metrics of the operator itself; 0: a free port (logged); unset: not served
    metrics_port: int | None = Field(None, ge=0, le=65535)

    def peer_priority(self) -> int:
        """The priority given, or a random one: two replicas drawing from two billion values
        do not tie in practice, and a tie would pause both (kopf's rule)."""
        if self.priority is not None:
            return self.priority
        return random.SystemRandom().randint(1, MAX_PRIORITY)

    def images(self) -> Images:
        return Images(
            worker=self.worker_image,
            worker_cpu=self.worker_cpu_image,
            vllm=self.vllm_image,
            router=self.router_image,
        )


def from_environment() -> OperatorSettings:
    """The settings from ``KVPOOL_OPERATOR_*`` alone (kopf started by ``kopf run -m``)."""
    return load(argparse.Namespace())


def load(args: Any, skip: tuple[str, ...] = ()) -> OperatorSettings:
    values = settings_values(args, OperatorSettings, ENV_PREFIX, skip)
    return build_settings(OperatorSettings, values)
