"""The InferencePool CustomResourceDefinition, generated from the pydantic models.

Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no ``$ref``, no
``additionalProperties: false`` beside ``properties`` (unknown fields are pruned instead),
``anyOf`` only for int-or-string. Pydantic writes JSON Schema 2020-12; this module turns one
into the other, adds each model's CEL rules, and wraps it in the CRD with its printer
columns and status subresource.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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
    "maxProperties",
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


# --- the API server's CEL cost limits, stood in for -----------------------------------------

#: the API server refuses a CRD whose validation rule is estimated to cost more than this
#: (apiextensions-apiserver's StaticEstimatedCostLimit), or whose rules together cost more
#: than ``PER_CRD_COST_LIMIT`` (StaticEstimatedCRDCostLimit)
PER_RULE_COST_LIMIT = 10_000_000
PER_CRD_COST_LIMIT = 100_000_000
#: the API server's guess at an unbounded list's or map's size: a 3 MiB request of its
#: smallest elements (about 393,000 entries of a map of strings, in its own estimate)
UNBOUNDED = 3 * 2**20 // 8

_COMPREHENSION = re.compile(r"self((?:\.[A-Za-z_]\w*)*)\.(?:all|exists_one|exists|map|filter)\(")
_FIELD = re.compile(r"self((?:\.[A-Za-z_]\w*)+)")


@dataclass
class RuleCost:
    """One validation rule's worst case, as the API server's estimate sees it: how many
    times it may run (the product of the sizes of the lists and maps above it) times what
    one run iterates and scans (its comprehensions' collections, its regexes' strings)."""

    path: str
    rule: str
    runs: int
    per_run: int
    problems: list[str]

    @property
    def cost(self) -> int:
        return self.runs * self.per_run


def rule_costs(crd: dict[str, Any]) -> list[RuleCost]:
    """Every x-kubernetes-validations rule of the CRD's schema with its worst-case cost
    (:class:`RuleCost`) and what makes it unbounded, a stand-in for the API server's cost
    estimator, which no test here can run. Its per-item weights are cruder (a rule's tokens
    count as its per-item work) and may price a rule lower than the API server does: what
    it enforces is that every collection and string a rule walks is bounded."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    out: list[RuleCost] = []
    _walk(schema, "", 1, [], out)
    return out


def _size(node: dict[str, Any]) -> int | None:
    if node.get("type") == "array":
        return node.get("maxItems")
    if node.get("type") == "object" and "additionalProperties" in node:
        return node.get("maxProperties")
    return 1


def _walk(
    node: dict[str, Any], path: str, runs: int, unbounded: list[str], out: list[RuleCost]
) -> None:
    for entry in node.get("x-kubernetes-validations", []):
        rule = entry["rule"]
        problems = [
            f"{path or '.'}: a rule runs once per item of {u}, which has no bound"
            for u in unbounded
        ]
        per_run = max(len(rule.split()), 1)
        for m in _COMPREHENSION.finditer(rule):
            target = _resolve(node, m.group(1))
            size = _size(target) if target is not None else None
            if size is None:
                problems.append(f"{path}{m.group(1)}: iterated by a rule, and has no maxProperties")
                size = UNBOUNDED
            per_run *= size
        if ".matches(" in rule:  # a regex costs the length of the strings it may be given
            for dotted in sorted({m.group(1) for m in _FIELD.finditer(rule)}):
                target = _resolve(node, dotted)
                if target is None or not _stringy(target) or target.get("enum"):
                    continue
                length = target.get("maxLength")
                if target.get("x-kubernetes-int-or-string"):
                    # API servers before 1.34 price an int-or-string at a whole request,
                    # whatever its maxLength (which still bounds what is accepted)
                    length = 3 * 2**20
                elif length is None:
                    problems.append(
                        f"{path}{dotted}: a rule's regex may read it, and has no maxLength"
                    )
                    length = 3 * 2**20
                per_run += length
        out.append(RuleCost(path or ".", rule, runs, per_run, problems))
    for name, child in node.get("properties", {}).items():
        _walk(child, f"{path}.{name}", runs, unbounded, out)
    for key in ("items", "additionalProperties"):
        child = node.get(key)
        if isinstance(child, dict):
            size = _size(node)
            here = f"{path}[*]" if key == "items" else f"{path}.*"
            more = [*unbounded, path] if size is None else unbounded
            _walk(child, here, runs * (size or UNBOUNDED), more, out)


def _stringy(node: dict[str, Any]) -> bool:
    return node.get("type") == "string" or bool(node.get("x-kubernetes-int-or-string"))


def _resolve(node: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    for name in [p for p in dotted.split(".") if p]:
        node = node.get("properties", {}).get(name)
        if node is None:
            return None
    return node


def cost_problems(crd: dict[str, Any]) -> list[str]:
    """Why the API server would refuse the CRD's rules: unbounded fields they touch, a rule
    over the per-rule limit, all of them over the per-CRD limit."""
    costs = rule_costs(crd)
    problems = [p for c in costs for p in c.problems]
    problems += [
        f"{c.path}: a rule's estimated cost {c.cost:,} exceeds {PER_RULE_COST_LIMIT:,}"
        for c in costs
        if c.cost > PER_RULE_COST_LIMIT
    ]
    total = sum(c.cost for c in costs)
    if total > PER_CRD_COST_LIMIT:
        problems.append(f"the rules' estimated cost {total:,} exceeds {PER_CRD_COST_LIMIT:,}")
    return problems
