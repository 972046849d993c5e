"""The ``InferencePool`` API (``kvpool.io/v1alpha1``): models, rules and the generated CRD."""

from .inferencepool import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    ROLES,
    SHORT_NAMES,
    VERSION,
    AutoscalerStatus,
    Condition,
    InferencePoolSpec,
    InferencePoolStatus,
    RoleStatus,
    RouterStatus,
    ScalingDecision,
    validate_pool,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "ROLES",
    "SHORT_NAMES",
    "VERSION",
    "AutoscalerStatus",
    "Condition",
    "InferencePoolSpec",
    "InferencePoolStatus",
    "RoleStatus",
    "RouterStatus",
    "ScalingDecision",
    "validate_pool",
]
