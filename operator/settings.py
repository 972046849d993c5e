"""The operator's settings: ``kvpool operator run`` flags or ``KVPOOL_OPERATOR_*`` variables."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvpool.settings_cli import build_settings, settings_values

from .render import Images

ENV_PREFIX = "KVPOOL_OPERATOR_"
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
    # kopf peering: two replicas of the operator with the same name take turns, one active
    peering: str | None = None
    liveness_port: int | None = Field(None, ge=1, le=65535)

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
