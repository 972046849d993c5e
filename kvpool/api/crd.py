"""The InferencePool CustomResourceDefinition, generated from the pydantic models.

Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no ``$ref``, no
``additionalProperties: false`` beside ``properties`` (unknown fields are pruned instead),
``anyOf`` only for int-or-string. Pydantic writes JSON Schema 2020-12; this module turns one
into the other, adds each model's CEL rules, and wraps it in the CRD with its printer
columns and status subresource.
"""

from __future__ import annotations

from typing import Any

import yaml

from .inferencepool import (
    API_VERSION,
    GROUP,
    KIND,
    NAME_RULE,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferencePoolSpec,
    InferencePoolStatus,
)

# Keys of JSON Schema that a structural schema keeps as they are.
_KEPT = (
    "description",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "default",
    "x-kubernetes-validations",
)

PRINTER_COLUMNS = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    },
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary"},
    {"name": "Mode", "type": "string", "jsonPath": ".spec.disaggregation.mode", "priority": 1},
    # The engine the operator resolved (the spec may leave it to the GPUs the workers ask for).
    {"name": "Engine", "type": "string", "jsonPath": ".status.engine.type", "priority": 1},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One JSON Schema node (pydantic's) as a structural OpenAPI v3 node."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        local = {k: v for k, v in node.items() if k != "$ref"}
        return structural({**target, **local}, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            del rest["default"]
        if len(branches) == 1:
            return structural({**branches[0], **rest}, defs)
        types = {b.get("type") for b in branches}
        if types != {"integer", "string"}:
            raise ValueError(f"no structural form for a union of {sorted(map(str, types))}")
        out = _kept(rest)
        for branch in branches:  # the string's pattern, the integer's minimum: each checks its own
            out.update(_kept(branch))
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        out["x-kubernetes-int-or-string"] = True
        return _ordered(out)
    return _ordered(_typed(node, defs))


def _typed(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    out = _kept(node)
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out["minimum"] = node["exclusiveMinimum"]
        out["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node:
        out["maximum"] = node["exclusiveMaximum"]
        out["exclusiveMaximum"] = True
    kind = node.get("type")
    if kind is None and "const" in node:
        kind = "string" if isinstance(node["const"], str) else None
    if kind == "object":
        props = node.get("properties")
        extra = node.get("additionalProperties")
        out["type"] = "object"
        if props:
            out["properties"] = {k: structural(v, defs) for k, v in props.items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = structural(extra, defs)
        elif len(node.get("patternProperties", {})) == 1:
            # Keys with a pattern (router.settings): the values are typed here; the keys are
            # the model's to check, as a structural schema has no patternProperties.
            (values,) = node["patternProperties"].values()
            out["additionalProperties"] = structural(values, defs)
        else:  # a free-form object (affinity, podTemplate...): the API server keeps it whole
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array":
        out["type"] = "array"
        out["items"] = structural(node.get("items", {}), defs)
    elif kind is not None:
        out["type"] = kind
    else:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _kept(node: dict[str, Any]) -> dict[str, Any]:
    return {k: node[k] for k in _KEPT if k in node}


_ORDER = ("type", "description", "properties", "required", "items", "additionalProperties")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """Keys in the order people read a schema in: type and description first."""
    first = {k: node[k] for k in _ORDER if k in node}
    return {**first, **{k: v for k, v in node.items() if k not in first}}


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return structural(schema, schema.get("$defs", {}))


def custom_resource_definition() -> dict[str, Any]:
    """The CRD as a Kubernetes object."""
    spec = openapi_schema(InferencePoolSpec)
    status = openapi_schema(InferencePoolStatus)
    root = {
        "type": "object",
        "description": f"{KIND} ({API_VERSION}): a model served by prefill and decode workers"
        " behind kvpool's KV-cache-aware router. Not the Gateway API Inference Extension's"
        " InferencePool (inference.networking.k8s.io): `kubectl get kvpool` shows these.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
        "x-kubernetes-validations": [NAME_RULE.crd_entry()],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "kvpool", "app.kubernetes.io/part-of": "kvpool"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["kvpool"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `kvpool crd` from kvpool/api: do not edit; run `make crd`.\n"


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # a schema shared by two fields is written out twice, not as &id001/*id001


def crd_yaml() -> str:
    body = yaml.dump(custom_resource_definition(), Dumper=_Dumper, sort_keys=False, width=100)
    return HEADER + body
