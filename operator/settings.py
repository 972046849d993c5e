"""The operator's settings: ``kvpool operator run`` flags or ``KVPOOL_OPERATOR_*`` variables."""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from kvpool.api.inferencepool import LabelSelector, NetworkPolicyPeer
from kvpool.settings_cli import build_settings, settings_values

from .render import DEFAULT_METRICS_FROM, Images, Peers

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
    # The operator's own pods (the chart sets both): the pools' NetworkPolicies let them
    # reach routers and workers, which the autoscaler scrapes. Unset: the operator is not a
    # pod of this cluster (a workstation), and no policy names it.
    pod_namespace: str | None = Field(None, min_length=1, max_length=63)
    pod_selector: str | None = Field(None, description="its pods' labels, k=v,k=v")
    # Who scrapes the pools' /metrics when a pool's networkPolicy.metricsFrom says nothing:
    # a JSON list of NetworkPolicy peers; unset: Prometheus pods in any namespace.
    metrics_from: str | None = None

    @model_validator(mode="after")
    def _check_peers(self) -> OperatorSettings:
        if (self.pod_namespace is None) != (self.pod_selector is None):
            raise ValueError("pod_namespace and pod_selector: give both or neither")
        self.peers()  # a bad selector or peer list is named here, at start-up
        return self

    def peer_priority(self) -> int:
        """The priority given, or a random one: two replicas drawing from two billion values
        do not tie in practice, and a tie would pause both (kopf's rule)."""
        if self.priority is not None:
            return self.priority
        return random.SystemRandom().randint(1, MAX_PRIORITY)

    def peers(self) -> Peers:
        """Who the pools' NetworkPolicies let in besides their own pods."""
        metrics = DEFAULT_METRICS_FROM
        if self.metrics_from is not None:
            try:
                given = _PEERS.validate_python(json.loads(self.metrics_from))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                problem = first["msg"].removeprefix("Value error, ")
                raise ValueError(f"metrics_from: at {where or 'the top'}: {problem}") from None
            except ValueError as exc:
                raise ValueError(f"metrics_from: not JSON: {exc}") from None
            metrics = tuple(p.model_dump(by_alias=True, exclude_defaults=True) for p in given)
        operator = None
        if self.pod_namespace is not None and self.pod_selector is not None:
            operator = {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": self.pod_namespace}
                },
                "podSelector": {"matchLabels": _labels(self.pod_selector)},
            }
        return Peers(metrics=metrics, operator=operator)

    def images(self) -> Images:
        return Images(
            worker=self.worker_image,
            worker_cpu=self.worker_cpu_image,
            vllm=self.vllm_image,
            router=self.router_image,
        )


_PEERS = TypeAdapter(list[NetworkPolicyPeer])


def _labels(selector: str) -> dict[str, str]:
    """``k=v,k2=v2`` as labels, each key and value checked as Kubernetes does."""
    pairs = [item.split("=", 1) for item in selector.split(",") if item.strip()]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError(f"pod_selector: not k=v,k=v: {selector!r}")
    labels = {k.strip(): v.strip() for k, v in pairs}
    try:
        LabelSelector(match_labels=labels)
    except ValidationError as exc:
        raise ValueError(f"pod_selector: {exc.errors()[0]['msg']}") from None
    return labels


def from_environment() -> OperatorSettings:
    """The settings from ``KVPOOL_OPERATOR_*`` alone (kopf started by ``kopf run -m``)."""
    return load(argparse.Namespace())


def load(args: Any, skip: tuple[str, ...] = ()) -> OperatorSettings:
    values = settings_values(args, OperatorSettings, ENV_PREFIX, skip)
    return build_settings(OperatorSettings, values)
