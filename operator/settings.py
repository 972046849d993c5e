"""The operator's settings: ``kvpool operator run`` flags or ``KVPOOL_OPERATOR_*`` variables."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from kvpool.api.inferencepool import LabelSelector, NetworkPolicyPeer
from kvpool.settings_cli import build_settings, settings_values

from .leader import LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S, check_durations
from .render import DEFAULT_METRICS_FROM, Images, Peers

ENV_PREFIX = "KVPOOL_OPERATOR_"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
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
    # Leader election: the replicas share this coordination.k8s.io/v1 Lease, and only its
    # holder acts (see kvpool.operator.leader). Unset: no election, this process acts alone.
    lease_name: str | None = Field(None, min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)
    # Where the Lease lives; unset: pod_namespace.
    lease_namespace: str | None = Field(None, min_length=1, max_length=63)
    # client-go's three durations: how long a holding lasts without renewal (judged on each
    # replica's own clock), how long the holder keeps trying to renew before it stops, how
    # often it renews (and a candidate tries).
    lease_duration_s: float = Field(LEASE_DURATION_S, gt=0, le=3600)
    renew_deadline_s: float = Field(RENEW_DEADLINE_S, gt=0, le=3600)
    retry_period_s: float = Field(RETRY_PERIOD_S, gt=0, le=3600)
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

    @model_validator(mode="after")
    def _check_lease(self) -> OperatorSettings:
        if self.lease_name is not None and self.lease() is None:
            raise ValueError("lease_name: give lease_namespace (or pod_namespace) as well")
        check_durations(self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)
        return self

    def lease(self) -> tuple[str, str] | None:
        """(namespace, name) of the leader election Lease; None: no election."""
        namespace = self.lease_namespace or self.pod_namespace
        if self.lease_name is None or namespace is None:
            return None
        return namespace, self.lease_name

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
