"""The InferencePool API as a user meets it: the committed CRD, the API server's CEL rules,
``validate_pool``'s messages, and ``kvpool check``.

The CEL rules are evaluated here as the API server evaluates them (cel-python standing in for
cel-go): the schema and the object are walked together and every ``x-kubernetes-validations``
rule runs with ``self`` bound to its part of the object. Each example is judged twice, before
and after the schema's defaults are filled in, so a rule cannot lean on a default.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.api import API_VERSION, KIND, validate_pool
from kvpool.api import inferencepool as ip
from kvpool.api.crd import PRINTER_COLUMNS, crd_yaml, custom_resource_definition
from kvpool.api.rules import Rule, RuledModel
from kvpool.cli import STAND_INS, main

CRD_FILE = Path(__file__).resolve().parents[1] / "crds" / "inferencepool.yaml"
CRD = custom_resource_definition()
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]

MODEL = {"name": "tiny", "source": {"builtin": {}}}
MINIMAL = {"model": MODEL}


# --- drift ----------------------------------------------------------------------------------


def test_committed_crd_is_the_one_the_models_generate() -> None:
    committed, generated = CRD_FILE.read_text(), crd_yaml()
    diff = "".join(
        list(
            difflib.unified_diff(
                committed.splitlines(True), generated.splitlines(True), "committed", "generated"
            )
        )[:40]
    )
    assert committed == generated, f"crds/inferencepool.yaml is stale: run `make crd`\n{diff}"


def test_crd_command_writes_the_generated_crd(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "crd.yaml"
    assert main(["crd", "-o", str(out)]) == 0
    assert out.read_text() == crd_yaml()
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == crd_yaml()


def test_crd_yaml_reads_back_as_the_crd_object() -> None:
    # No anchors or aliases either: every tool reads the file the same way.
    assert "&id" not in crd_yaml() and "*id" not in crd_yaml()
    assert yaml.safe_load(crd_yaml()) == CRD


# --- a structural schema --------------------------------------------------------------------

# What a structural OpenAPI v3 node may say (apiextensions.k8s.io/v1).
ALLOWED_KEYS = {
    "type",
    "description",
    "properties",
    "required",
    "items",
    "additionalProperties",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "maxProperties",  # a map's bound (apiextensions v1 JSONSchemaProps)
    "default",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
}
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
JSON_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
}


def schema_nodes(node: dict[str, Any], path: str = "") -> Any:
    """Every node of a schema, with its path (``.spec.engine.port``, ``.x[]``, ``.x{}``)."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


def structural_problems(schema: dict[str, Any]) -> list[str]:
    problems = []
    for path, node in schema_nodes(schema):
        where = path or "<root>"
        if unknown := set(node) - ALLOWED_KEYS:
            problems.append(f"{where}: not structural: {sorted(unknown)}")  # $ref, title, const...
        if not (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ):
            problems.append(f"{where}: no type")
        if "anyOf" in node and (
            node["anyOf"] != INT_OR_STRING or not node.get("x-kubernetes-int-or-string")
        ):
            problems.append(f"{where}: anyOf other than int-or-string")
        if "additionalProperties" in node:
            if not isinstance(node["additionalProperties"], dict):
                problems.append(f"{where}: additionalProperties: {node['additionalProperties']}")
            if "properties" in node:
                problems.append(f"{where}: both properties and additionalProperties")
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node and not isinstance(node[key], bool):
                problems.append(f"{where}: {key} is not a boolean")
        if missing := set(node.get("required", ())) - set(node.get("properties", {})):
            problems.append(f"{where}: required but not declared: {sorted(missing)}")
        if "default" in node:
            default = node["default"]
            if "type" in node and not (
                isinstance(default, JSON_TYPES[node["type"]])
                and (node["type"] == "boolean" or not isinstance(default, bool))
            ):
                problems.append(f"{where}: default {default!r} is not a {node['type']}")
            if "enum" in node and default not in node["enum"]:
                problems.append(f"{where}: default {default!r} is not one of {node['enum']}")
    return problems


def test_crd_schema_is_structural() -> None:
    assert structural_problems(SCHEMA) == []


def test_the_structural_check_catches_what_the_api_server_refuses() -> None:
    bad = {
        "type": "object",
        "title": "Pool",
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "b": {"type": "number", "minimum": 0, "exclusiveMinimum": 0},
            "c": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "d": {
                "type": "object",
                "properties": {"x": {"type": "string"}},
                "additionalProperties": False,
            },
            "e": {"const": "x"},
        },
    }
    found = "\n".join(structural_problems(bad))
    for expected in (
        "<root>: not structural: ['title']",
        ".a: not structural: ['$ref']",
        ".a: no type",
        ".b: exclusiveMinimum is not a boolean",
        ".c: anyOf other than int-or-string",
        ".d: additionalProperties: False",
        ".d: both properties and additionalProperties",
        ".e: not structural: ['const']",
    ):
        assert expected in found


def test_crd_names_the_resource_as_kubectl_finds_it() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "inferencepools.kvpool.io"
    assert spec["group"] == "kvpool.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["plural"] == "inferencepools"
    assert spec["names"]["kind"] == "InferencePool"
    assert spec["names"]["shortNames"] == ["kvpool"]
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]
    assert VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"] == {"status": {}}
    assert SCHEMA["required"] == ["spec"]


def resolve_json_path(json_path: str) -> dict[str, Any] | None:
    """The schema node a printer column's JSONPath points at (None: no such field)."""
    node = SCHEMA
    for step in re.sub(r"\[\?\(.*?\)\]", "[]", json_path).lstrip(".").split("."):
        name, is_list = step.removesuffix("[]"), step.endswith("[]")
        if node is SCHEMA and name == "metadata":
            return {"type": "object"}  # ObjectMeta: the API server's, not ours to declare
        node = node.get("properties", {}).get(name)
        if node is None:
            return None
        if is_list:
            if node.get("type") != "array":
                return None
            node = node["items"]
    return node


def test_printer_columns_show_ready_roles_and_age_from_fields_that_exist() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert VERSION["additionalPrinterColumns"] == PRINTER_COLUMNS
    assert {"Ready", "Prefill", "Decode", "Age"} <= set(columns)
    # Shown by a plain `kubectl get kvpool` (priority 0), in this order.
    default_columns = [c["name"] for c in PRINTER_COLUMNS if not c.get("priority")]
    assert default_columns == ["Ready", "Prefill", "Decode", "Age"]
    assert columns["Prefill"]["jsonPath"] == ".status.prefill.summary"
    assert columns["Decode"]["jsonPath"] == ".status.decode.summary"
    assert columns["Age"] == {
        "name": "Age",
        "type": "date",
        "jsonPath": ".metadata.creationTimestamp",
    }
    ready = resolve_json_path(columns["Ready"]["jsonPath"])  # the Ready condition's status
    assert ready is not None and "True" in ready["enum"]
    assert "Ready" in resolve_json_path(".status.conditions[].type")["enum"]
    for column in PRINTER_COLUMNS:
        node = resolve_json_path(column["jsonPath"])
        assert node is not None, f"column {column['name']}: {column['jsonPath']} is not a field"
        if column["type"] == "string":
            assert node["type"] == "string", column["name"]


# --- CEL rules, evaluated as the API server does --------------------------------------------

_CEL = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def cel_verdict(rule: str, value: Any) -> bool | str:
    """True or False, or the text of the error the rule ran into (the API server counts an
    error as a failure, with its own message instead of the rule's)."""
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _CEL.program(_CEL.compile(rule))
    try:
        result = _PROGRAMS[rule].evaluate({"self": celpy.json_to_cel(value)})
    except celpy.CELEvalError as exc:
        return f"error: {exc}"
    if not isinstance(result, celpy.celtypes.BoolType):
        return f"error: {result!r} is not a bool"
    return bool(result)


def cel_failures(
    value: Any, node: dict[str, Any] = SCHEMA, path: str = ""
) -> list[tuple[str, str]]:
    """(path, message) of every rule that does not hold, and (path, error) of every rule that
    errs, walking the object and its schema together; absent parts are not validated."""
    failed = []
    for entry in node.get("x-kubernetes-validations", ()):
        verdict = cel_verdict(entry["rule"], value)
        if verdict is not True:
            failed.append((path, entry["message"] if verdict is False else verdict))
    props, extra = node.get("properties"), node.get("additionalProperties")
    if isinstance(value, dict) and props is not None:
        for key, child in value.items():
            if key in props:
                failed += cel_failures(child, props[key], f"{path}.{key}" if path else key)
    elif isinstance(value, dict) and isinstance(extra, dict):
        for key, child in value.items():
            failed += cel_failures(child, extra, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and "items" in node:
        for i, child in enumerate(value):
            failed += cel_failures(child, node["items"], f"{path}.{i}")
    return failed


def with_defaults(value: Any, node: dict[str, Any] = SCHEMA) -> Any:
    """The object as the API server validates it: nulls pruned, the schema's defaults filled
    in wherever the parent object is present."""
    props, extra = node.get("properties"), node.get("additionalProperties")
    if isinstance(value, dict) and props is not None:
        out = {k: with_defaults(v, props.get(k, {})) for k, v in value.items() if v is not None}
        for key, child in props.items():
            if key not in out and "default" in child:
                out[key] = with_defaults(copy.deepcopy(child["default"]), child)
        return out
    if isinstance(value, dict) and isinstance(extra, dict):
        return {k: with_defaults(v, extra) for k, v in value.items()}
    if isinstance(value, list) and "items" in node:
        return [with_defaults(v, node["items"]) for v in value]
    return value


def pool_object(name: str, spec: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}


def api_server_failures(name: str, spec: Any) -> set[tuple[str, str]]:
    """What the API server refuses the pool for, the same with or without defaulting."""
    raw = set(cel_failures(pool_object(name, spec)))
    defaulted = set(cel_failures(with_defaults(pool_object(name, spec))))
    errors = sorted(f for f in raw | defaulted if f[1].startswith("error: "))
    assert not errors, f"CEL rules ran into errors on {spec}: {errors}"
    assert raw == defaulted, f"a rule depends on a default: {raw} vs {defaulted} for {spec}"
    return raw


def operator_failures(name: str, spec: Any) -> set[tuple[str, str]]:
    """(path, message) of every problem ``validate_pool`` reports; paths as the CEL walk
    writes them (``spec.autoscaling.decode``; "" for the root object's rule)."""
    try:
        validate_pool(name, spec)
    except ValueError as exc:
        problems, path = set(), None
        for piece in str(exc).split("; "):
            if piece.startswith("metadata."):
                problems.add(("", piece))  # the root's rule names its field itself
            elif m := re.fullmatch(r"(spec(?:\.\S+?)?): (.*)", piece, re.S):
                path, message = m.groups()
                problems.add((path, message))
            else:  # a model's next rule message, after "; "
                assert path is not None, str(exc)
                problems.add((path, piece))
        return problems
    return set()


def reported_first(failures: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The failures pydantic reports: a model's rules run once its fields are valid, so a
    rule is only heard when nothing below it failed. The name is checked on its own."""
    return {
        (path, msg)
        for path, msg in failures
        if path == ""
        or not any(other.startswith(path + ".") for other, _ in failures if other != "")
    }


def all_rules() -> list[Rule]:
    """Every rule of the API: each model's, and the root object's name rule."""
    rules = [ip.NAME_RULE]
    for obj in vars(ip).values():
        if isinstance(obj, type) and issubclass(obj, RuledModel):
            rules += vars(obj).get("rules", ())
    return rules


def rule_message(fragment: str) -> str:
    """The message of the one rule whose message contains ``fragment``."""
    (message,) = [rule.message for rule in all_rules() if fragment in rule.message]
    return message


def test_crd_carries_every_rule_of_the_models() -> None:
    in_crd = {
        (entry["rule"], entry["message"])
        for _, node in schema_nodes(SCHEMA)
        for entry in node.get("x-kubernetes-validations", ())
    }
    assert in_crd == {(rule.cel, rule.message) for rule in all_rules()}
    assert len({rule.message for rule in all_rules()}) == len(all_rules())  # told apart by it


def spec_with(**parts: Any) -> dict[str, Any]:
    return {"model": MODEL, **parts}


VLLM = {"type": "vllm"}
# Roles that ask for GPUs: with no engine named, the pool runs vLLM (and its rules apply).
GPU_DECODE = {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}}
GPU_PREFILL = {"resources": {"requests": {"nvidia.com/gpu": "1"}}}
BOUNDS = {"minReplicas": 1, "maxReplicas": 4}
SLO = {"ttftMilliseconds": 500}
ON = {"enabled": True, "decode": BOUNDS}

# (name, spec): pools both sides accept.
VALID = {
    "minimal": ("tiny", MINIMAL),
    "longest name": ("p" * ip.MAX_NAME_LENGTH, MINIMAL),
    "disaggregated vllm, autoscaled": (
        "big",
        {
            "model": {
                "name": "meta-llama/Llama-3.1-8B",
                "source": {"pvc": {"claimName": "w"}},
                "tokenizer": "meta-llama/Llama-3.1-8B",
            },
            "engine": {
                "type": "vllm",
                "hashSeed": "4294967295",
                "blockSize": 32,
                "kvEvents": {"port": 6000, "replayPort": 6001},
            },
            "disaggregation": {"mode": "Disaggregated"},
            "prefill": {"replicas": 2, "rollout": {"maxSurge": "25%", "maxUnavailable": 0}},
            "decode": {"replicas": 3, "rollout": {"maxSurge": 0, "maxUnavailable": 1}},
            "slo": {"ttftMilliseconds": 800, "itlMilliseconds": 40, "quantile": 0.95},
            "autoscaling": {"enabled": True, "prefill": {"maxReplicas": 4}, "decode": BOUNDS},
        },
    ),
    "auto, advisory autoscaling": (
        "auto",
        spec_with(
            disaggregation={"mode": "Auto"},
            prefill={},
            autoscaling={"enabled": True, "mode": "Advisory", "prefill": BOUNDS, "decode": BOUNDS},
            slo={"itlMilliseconds": 20},
        ),
    ),
    "aggregated, autoscaled": ("agg", spec_with(autoscaling=ON, slo=SLO)),
    "autoscaling off needs no bounds": ("off", spec_with(autoscaling={"enabled": False})),
    "kvpool engine: any seed and block size": (
        "kv",
        spec_with(engine={"type": "kvpool", "hashSeed": "not-a-number", "blockSize": 20}),
    ),
    "vllm defaults": ("v", spec_with(engine=VLLM)),
    "one port moved": ("ports", spec_with(engine={"kvEvents": {"port": 5559}})),
    "equal bounds": ("eq", spec_with(autoscaling={"decode": {"minReplicas": 3, "maxReplicas": 3}})),
    "surge only": ("surge", spec_with(decode={"rollout": {"maxSurge": "10%"}})),
    "locked down: keys, own pool secret, peers": (
        "locked",
        spec_with(
            router={
                "auth": {"secretName": "tenants"},
                "flowControl": {"enabled": True, "saturationTtftSeconds": 1.5},
                "clientLimits": {"headerTimeoutSeconds": 5, "maxConnectionsPerClient": 8},
                "settings": {"maxConcurrency": "512"},
            },
            poolSecret={"secretName": "mine", "key": "hmac"},
            networkPolicy={
                "metricsFrom": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                        },
                        "podSelector": {
                            "matchExpressions": [
                                {"key": "app", "operator": "In", "values": ["prometheus"]},
                                {"key": "shard", "operator": "Exists"},
                            ]
                        },
                    }
                ],
                "clientsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}}],
            },
        ),
    ),
    "vllm: no pool secret, no policies": (
        "v",
        spec_with(engine=VLLM, networkPolicy={"enabled": False, "metricsFrom": []}),
    ),
    "gpus, no engine named: vllm's seed, block size and tokenizer": (
        "g",
        spec_with(
            model={**MODEL, "tokenizer": "org/t"},
            engine={"hashSeed": "7", "blockSize": 32},
            decode=GPU_DECODE,
        ),
    ),
    "gpus, kvpool named: any seed and block size, a pool secret": (
        "g",
        spec_with(
            engine={"type": "kvpool", "hashSeed": "any", "blockSize": 20},
            decode=GPU_DECODE,
            poolSecret={"secretName": "mine"},
        ),
    ),
    "no gpus, no engine named: kvpool's any seed and block size, a pool secret": (
        "c",
        spec_with(
            engine={"hashSeed": "any", "blockSize": 20},
            decode={"resources": {"limits": {"cpu": "4", "memory": "8Gi"}}},
            poolSecret={"secretName": "mine"},
        ),
    ),
}

# (name, spec, substrings of the messages of the rules the API server refuses it for)
INVALID = {
    "no model source": ("p", spec_with(model={"name": "m", "source": {}}), ["exactly one model"]),
    "two model sources": (
        "p",
        spec_with(model={"name": "m", "source": {"builtin": {}, "image": {"path": "/m"}}}),
        ["exactly one model"],
    ),
    "vllm seed not a number": ("p", spec_with(engine={**VLLM, "hashSeed": "abc"}), ["hashSeed"]),
    "vllm seed of unicode digits": ("p", spec_with(engine={**VLLM, "hashSeed": "²"}), ["hashSeed"]),
    "vllm seed with a newline": ("p", spec_with(engine={**VLLM, "hashSeed": "7\n"}), ["hashSeed"]),
    "vllm seed out of range": (
        "p",
        spec_with(engine={**VLLM, "hashSeed": "4294967296"}),
        ["hashSeed"],
    ),
    "vllm block size": ("p", spec_with(engine={**VLLM, "blockSize": 20}), ["blockSize"]),
    "gpus, no engine named: vllm's seed": (
        "p",
        spec_with(engine={"hashSeed": "abc"}, decode=GPU_DECODE),
        ["hashSeed"],
    ),
    "a prefill gpu, no engine named: vllm's block sizes": (
        "p",
        spec_with(
            engine={"blockSize": 20},
            disaggregation={"mode": "Disaggregated"},
            prefill=GPU_PREFILL,
        ),
        ["blockSize"],
    ),
    "gpus, no engine named: no pool secret": (
        "p",
        spec_with(decode=GPU_DECODE, poolSecret={"secretName": "s"}),
        ["poolSecret is for kvpool"],
    ),
    "gpus, kvpool named: no tokenizer": (
        "p",
        spec_with(model={**MODEL, "tokenizer": "t"}, engine={"type": "kvpool"}, decode=GPU_DECODE),
        ["model.tokenizer"],
    ),
    "vllm seed and block size": (
        "p",
        spec_with(engine={**VLLM, "hashSeed": "-1", "blockSize": 512}),
        ["hashSeed", "blockSize"],
    ),
    "equal event ports": (
        "p",
        spec_with(engine={"kvEvents": {"port": 7000, "replayPort": 7000}}),
        ["replayPort must differ"],
    ),
    "event port on the default replay port": (
        "p",
        spec_with(engine={"kvEvents": {"port": 5558}}),
        ["replayPort must differ"],
    ),
    "no surge, no unavailable": (
        "p",
        spec_with(decode={"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}),
        ["both be zero"],
    ),
    "prefill rollout": (
        "p",
        spec_with(
            disaggregation={"mode": "Disaggregated"},
            prefill={"rollout": {"maxSurge": "0%", "maxUnavailable": 0}},
        ),
        ["both be zero"],
    ),
    "empty slo": ("p", spec_with(slo={}), ["slo needs"]),
    "slo with only a quantile": ("p", spec_with(slo={"quantile": 0.5}), ["slo needs"]),
    "min above max": (
        "p",
        spec_with(autoscaling={"decode": {"minReplicas": 5, "maxReplicas": 2}}),
        ["must not exceed"],
    ),
    "prefill bounds, min above max": (
        "p",
        spec_with(
            disaggregation={"mode": "Auto"},
            prefill={},
            autoscaling={"prefill": {"maxReplicas": 1, "minReplicas": 2}},
        ),
        ["must not exceed"],
    ),
    "enabled without decode bounds": (
        "p",
        spec_with(autoscaling={"enabled": True}, slo=SLO),
        ["autoscaling.decode"],
    ),
    "disaggregated without prefill": (
        "p",
        spec_with(disaggregation={"mode": "Disaggregated"}),
        ["prefill is required"],
    ),
    "auto without prefill": (
        "p",
        spec_with(disaggregation={"mode": "Auto"}),
        ["prefill is required"],
    ),
    "aggregated with prefill": (
        "p",
        spec_with(disaggregation={"mode": "Aggregated"}, prefill={}),
        ["prefill must be omitted"],
    ),
    "default mode with prefill": ("p", spec_with(prefill={"replicas": 1}), ["must be omitted"]),
    "autoscaled disaggregated pool without prefill bounds": (
        "p",
        spec_with(disaggregation={"mode": "Disaggregated"}, prefill={}, autoscaling=ON, slo=SLO),
        ["autoscaling.prefill"],
    ),
    "autoscaled without slo": ("p", spec_with(autoscaling=ON), ["slo is required"]),
    "autoscaled auto pool, no prefill bounds, no slo": (
        "p",
        spec_with(disaggregation={"mode": "Auto"}, prefill={}, autoscaling=ON),
        ["autoscaling.prefill", "slo is required"],
    ),
    "tokenizer for kvpool workers": (
        "p",
        spec_with(model={**MODEL, "tokenizer": "t"}, engine={"type": "kvpool"}),
        ["model.tokenizer"],
    ),
    "tokenizer, default engine": (
        "p",
        spec_with(model={**MODEL, "tokenizer": "t"}),
        ["model.tokenizer"],
    ),
    "pool secret for vllm workers": (
        "p",
        spec_with(engine=VLLM, poolSecret={"secretName": "s"}),
        ["poolSecret is for kvpool"],
    ),
    "a secret in a ConfigMap": (
        "p",
        spec_with(router={"settings": {"poolSecret": "hunter2"}}),
        ["router.settings may not"],
    ),
    "a flow control setting in two places": (
        "p",
        spec_with(router={"settings": {"queueTimeoutS": "5"}}),
        ["router.settings may not"],
    ),
    "a peer that names nobody": (
        "p",
        spec_with(networkPolicy={"metricsFrom": [{}]}),
        ["a peer needs"],
    ),
    "an ipBlock with a selector": (
        "p",
        spec_with(
            networkPolicy={
                "clientsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "namespaceSelector": {}}]
            }
        ),
        ["ipBlock goes alone"],
    ),
    "In without values": (
        "p",
        spec_with(
            networkPolicy={
                "metricsFrom": [
                    {"podSelector": {"matchExpressions": [{"key": "app", "operator": "In"}]}}
                ]
            }
        ),
        ["values: some for In"],
    ),
    "Exists with values": (
        "p",
        spec_with(
            networkPolicy={
                "metricsFrom": [
                    {
                        "podSelector": {
                            "matchExpressions": [
                                {"key": "app", "operator": "Exists", "values": ["x"]}
                            ]
                        }
                    }
                ]
            }
        ),
        ["values: some for In"],
    ),
    "name too long": ("p" * (ip.MAX_NAME_LENGTH + 1), MINIMAL, ["metadata.name"]),
    "name too long and no prefill": (
        "p" * 60,
        spec_with(disaggregation={"mode": "Disaggregated"}),
        ["metadata.name", "prefill is required"],
    ),
    # All four are the pool's rules (the engine's type may be the operator's choice, by the
    # roles' GPUs): the API server and the operator report them all.
    "engine and pool rules at once": (
        "p",
        spec_with(
            engine={**VLLM, "blockSize": 3},
            disaggregation={"mode": "Auto"},
            autoscaling=ON,
            model={**MODEL, "tokenizer": "t"},
        ),
        ["blockSize", "prefill is required", "autoscaling.prefill", "slo is required"],
    ),
}


@pytest.mark.parametrize("name, spec", VALID.values(), ids=list(VALID))
def test_valid_pools_pass_cel_and_pydantic(name: str, spec: dict[str, Any]) -> None:
    assert api_server_failures(name, spec) == set()
    validate_pool(name, spec)


@pytest.mark.parametrize("name, spec, broken", INVALID.values(), ids=list(INVALID))
def test_cel_and_pydantic_refuse_a_pool_for_the_same_rules(
    name: str, spec: dict[str, Any], broken: list[str]
) -> None:
    cel = api_server_failures(name, spec)
    assert {msg for _, msg in cel} == {rule_message(fragment) for fragment in broken}
    assert operator_failures(name, spec) == reported_first(cel)


def test_every_rule_is_broken_by_some_example() -> None:
    broken = {
        rule_message(fragment) for _, _, fragments in INVALID.values() for fragment in fragments
    }
    assert {rule.message for rule in all_rules()} - broken == set()


# Specs whose fields are all valid, in every combination of the parts the rules look at.
_ROLLOUT_VALUE = st.sampled_from([0, 1, "0%", "00%", "25%"])
_RESOURCES = st.fixed_dictionaries(
    {},
    optional={
        kind: st.dictionaries(
            st.sampled_from(["nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/xe", "cpu"]),
            st.sampled_from([0, 1, "2"]),
            max_size=2,
        )
        for kind in ("requests", "limits")
    },
)
_ROLE = st.fixed_dictionaries(
    {},
    optional={
        "replicas": st.integers(0, 4),
        "resources": _RESOURCES,
        "rollout": st.fixed_dictionaries(
            {}, optional={"maxSurge": _ROLLOUT_VALUE, "maxUnavailable": _ROLLOUT_VALUE}
        ),
    },
)
_BOUNDS = st.fixed_dictionaries(
    {"maxReplicas": st.integers(1, 4)}, optional={"minReplicas": st.integers(1, 4)}
)
_HASH_SEED = st.one_of(
    st.sampled_from(["0", "4294967295", "4294967296", "0000000007", "00000000007", "²", "١٢",
                     "12\n", "-1", " 1", "1e3", "random"]),
    st.integers(0, 2**33).map(str),
)  # fmt: skip
_PORT = st.sampled_from([5557, 5558, 6000])
_ENGINE = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["vllm", "kvpool"]),
        "hashSeed": _HASH_SEED,
        "blockSize": st.sampled_from([1, 16, 20, 256, 512, 1024]),
        "kvEvents": st.fixed_dictionaries({}, optional={"port": _PORT, "replayPort": _PORT}),
    },
)
_SOURCES = {
    "pvc": {"claimName": "weights"},
    "hostPath": {"path": "/models/m"},
    "image": {"path": "/model"},
    "builtin": {},
    "huggingface": {"repo": "org/m", "revision": "main"},
}
_MODEL = st.fixed_dictionaries(
    {
        "name": st.just("m"),
        "source": st.sets(st.sampled_from(sorted(_SOURCES)), max_size=3).map(
            lambda keys: {k: _SOURCES[k] for k in keys}
        ),
    },
    optional={"tokenizer": st.just("org/tokenizer")},
)
_SPEC = st.fixed_dictionaries(
    {"model": _MODEL},
    optional={
        "engine": _ENGINE,
        "disaggregation": st.fixed_dictionaries(
            {}, optional={"mode": st.sampled_from(["Aggregated", "Disaggregated", "Auto"])}
        ),
        "prefill": _ROLE,
        "decode": _ROLE,
        "slo": st.fixed_dictionaries(
            {},
            optional={
                "quantile": st.just(0.99),
                "ttftMilliseconds": st.just(300),
                "itlMilliseconds": st.just(25.5),
            },
        ),
        "autoscaling": st.fixed_dictionaries(
            {},
            optional={
                "enabled": st.booleans(),
                "mode": st.sampled_from(["Active", "Advisory"]),
                "prefill": _BOUNDS,
                "decode": _BOUNDS,
            },
        ),
        "poolSecret": st.just({"secretName": "mine"}),
    },
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name_length=st.sampled_from([1, 47, 48, 49, 63]), spec=_SPEC)
def test_cel_and_pydantic_agree_on_any_combination(name_length: int, spec: dict) -> None:
    name = "p" * name_length
    cel = api_server_failures(name, spec)
    operator = operator_failures(name, spec)
    assert bool(cel) == bool(operator), (cel, operator)
    assert operator == reported_first(cel)


# --- validate_pool --------------------------------------------------------------------------


def problems_of(name: str, spec: Any) -> list[str]:
    with pytest.raises(ValueError) as exc_info:
        validate_pool(name, spec)
    return str(exc_info.value).split("; ")


# (name, spec, the one problem reported, from its start)
PROBLEMS = {
    "unknown engine": (
        "p",
        spec_with(engine={"type": "tensorrt"}),
        "spec.engine.type: Input should be 'kvpool' or 'vllm'",
    ),
    "unknown field": (
        "p",
        spec_with(decode={"replica": 2}),
        "spec.decode.replica: Extra inputs are not permitted",
    ),
    "min above max": (
        "p",
        spec_with(autoscaling={"decode": {"minReplicas": 4, "maxReplicas": 2}}),
        "spec.autoscaling.decode: minReplicas must not exceed maxReplicas",
    ),
    "no model source": ("p", spec_with(model={"name": "m"}), "spec.model.source: Field required"),
    "empty model source": (
        "p",
        spec_with(model={"name": "m", "source": {}}),
        "spec.model.source: give exactly one model source: pvc, hostPath, image, builtin"
        " or huggingface",
    ),
    "no model": ("p", {}, "spec.model: Field required"),
    "name too long": ("p" * 49, MINIMAL, "metadata.name: at most 48 characters"),
    "negative replicas": (
        "p",
        spec_with(decode={"replicas": -1}),
        "spec.decode.replicas: Input should be greater than or equal to 0",
    ),
    "port out of range": (
        "p",
        spec_with(engine={"kvEvents": {"port": 70000}}),
        "spec.engine.kvEvents.port: Input should be less than or equal to 65535",
    ),
    "bad quantity": (
        "p",
        spec_with(decode={"resources": {"limits": {"memory": "lots"}}}),
        "spec.decode.resources.limits.memory: not a quantity: 'lots'",
    ),
    "surge neither count nor percentage": (
        "p",
        spec_with(decode={"rollout": {"maxSurge": "1"}}),
        "spec.decode.rollout.maxSurge: not a count or a percentage: '1'",
    ),
    "negative unavailable": (
        "p",
        spec_with(decode={"rollout": {"maxUnavailable": -1}}),
        "spec.decode.rollout.maxUnavailable: not a count or a percentage: -1",
    ),
    "router setting not a string": (
        "p",
        spec_with(router={"settings": {"maxConcurrency": 512}}),
        "spec.router.settings.maxConcurrency: Input should be a valid string",
    ),
    "spec not an object": ("p", ["model"], "spec: Input should be a valid dictionary"),
    "tenants Secret not a name": (
        "p",
        spec_with(router={"auth": {"secretName": "Team_A"}}),
        "spec.router.auth.secretName: not a DNS-1123 name: 'Team_A'",
    ),
    "tenants key not a file name": (
        "p",
        spec_with(router={"auth": {"secretName": "keys", "key": ".."}}),
        "spec.router.auth.key: not a Secret key: '..'",
    ),
    "bad CIDR": (
        "p",
        spec_with(networkPolicy={"clientsFrom": [{"ipBlock": {"cidr": "10.0.0.300/8"}}]}),
        "spec.networkPolicy.clientsFrom.0.ipBlock.cidr: not a CIDR: '10.0.0.300/8'",
    ),
    "bad label value": (
        "p",
        spec_with(
            networkPolicy={"metricsFrom": [{"podSelector": {"matchLabels": {"app": "not ok"}}}]}
        ),
        "spec.networkPolicy.metricsFrom.0.podSelector.matchLabels.app: not a label value",
    ),
    "label name part too long": (
        "p",
        spec_with(
            networkPolicy={
                "metricsFrom": [{"podSelector": {"matchLabels": {"example.com/" + "a" * 64: "x"}}}]
            }
        ),
        "spec.networkPolicy.metricsFrom.0.podSelector.matchLabels.example.com/",
    ),
    "flow control bound not positive": (
        "p",
        spec_with(router={"flowControl": {"saturationTtftSeconds": 0}}),
        "spec.router.flowControl.saturationTtftSeconds: Input should be greater than 0",
    ),
}


@pytest.mark.parametrize("name, spec, problem", PROBLEMS.values(), ids=list(PROBLEMS))
def test_validate_pool_names_the_field_and_the_problem(name: str, spec: Any, problem: str) -> None:
    found = problems_of(name, spec)
    assert len(found) == 1 and found[0].startswith(problem), found


def test_validate_pool_reports_every_problem_at_once() -> None:
    spec = spec_with(
        engine={"type": "tensorrt"},
        decode={"replica": 2},
        autoscaling={"decode": {"minReplicas": 4, "maxReplicas": 2}},
        slo={},
    )
    found = problems_of("p" * 50, spec)
    assert [p.split(":")[0] for p in found] == [
        "metadata.name",
        "spec.engine.type",
        "spec.decode.replica",
        "spec.slo",
        "spec.autoscaling.decode",
    ]


def test_a_minimal_pool_gets_the_documented_defaults() -> None:
    pool = validate_pool("tiny", MINIMAL)
    assert pool.model.source.builtin is not None
    assert pool.model.source.builtin.name == "tiny-llama"
    assert pool.disaggregation.mode == "Aggregated"
    # no engine named and no GPU asked for: kvpool's own engine, blocks of 16
    assert pool.engine.type is None and pool.engine.block_size is None
    assert (pool.engine_type, pool.block_size) == ("kvpool", 16)
    assert (pool.engine.port, pool.engine.hash_seed) == (8000, "0")
    assert (pool.engine.kv_events.port, pool.engine.kv_events.replay_port) == (5557, 5558)
    assert pool.prefill is None
    assert pool.decode.replicas == 1
    # a roll-out the operator chooses: one that finishes on a full cluster (see test_render)
    assert (pool.decode.rollout.max_surge, pool.decode.rollout.max_unavailable) == (None, None)
    assert pool.decode.rollout.strategy(gpu=False) == (1, 0)
    assert pool.decode.rollout.strategy(gpu=True) == (0, 1)
    assert pool.router.replicas == 1 and pool.router.policy == "kvpool"
    assert pool.router.service.type == "ClusterIP" and pool.router.service.port == 80
    assert pool.slo is None
    assert pool.autoscaling.enabled is False and pool.autoscaling.mode == "Active"


def test_camel_case_on_the_wire_snake_case_in_python() -> None:
    pool = validate_pool("p", spec_with(engine={"blockSize": 32, "kvEvents": {"replayPort": 6}}))
    assert pool.engine.block_size == 32 and pool.engine.kv_events.replay_port == 6
    wire = pool.model_dump(by_alias=True, exclude_unset=True)
    assert wire["engine"] == {"blockSize": 32, "kvEvents": {"replayPort": 6}}


@pytest.mark.parametrize(
    "mode, roles, labels",
    [
        ("Aggregated", ["decode"], {"decode": "both"}),
        ("Disaggregated", ["prefill", "decode"], {"prefill": "prefill", "decode": "decode"}),
        ("Auto", ["prefill", "decode"], {"prefill": "prefill", "decode": "both"}),
    ],
)
def test_roles_and_their_labels_follow_the_mode(
    mode: str, roles: list[str], labels: dict[str, str]
) -> None:
    prefill = {} if mode == "Aggregated" else {"prefill": {"replicas": 2}}
    pool = validate_pool("p", spec_with(disaggregation={"mode": mode}, **prefill))
    assert list(pool.roles()) == roles
    assert pool.roles()["decode"] is pool.decode
    assert {role: pool.worker_role_label(role) for role in roles} == labels


ROLES_OFF = {"prefill": False, "decode": False}


@pytest.mark.parametrize(
    "autoscaling, autoscaled",
    [
        ({}, ROLES_OFF),
        ({"enabled": False, "prefill": BOUNDS, "decode": BOUNDS}, ROLES_OFF),
        ({"enabled": True, "prefill": BOUNDS, "decode": BOUNDS}, {"prefill": True, "decode": True}),
        ({"enabled": True, "mode": "Advisory", "prefill": BOUNDS, "decode": BOUNDS}, ROLES_OFF),
    ],
    ids=["off by default", "disabled", "enabled and active", "advisory"],
)
def test_autoscaled_only_when_enabled_active_and_bounded(
    autoscaling: dict[str, Any], autoscaled: dict[str, bool]
) -> None:
    pool = validate_pool(
        "p",
        spec_with(disaggregation={"mode": "Auto"}, prefill={}, autoscaling=autoscaling, slo=SLO),
    )
    assert {role: pool.autoscaled(role) for role in ("prefill", "decode")} == autoscaled


def test_autoscaled_only_for_a_role_with_bounds() -> None:
    pool = validate_pool("p", spec_with(autoscaling=ON, slo=SLO))  # decode bounds only
    assert pool.autoscaled("decode") and not pool.autoscaled("prefill")


# --- kvpool check ---------------------------------------------------------------------------

POOL_YAML = """\
apiVersion: kvpool.io/v1alpha1
kind: InferencePool
metadata:
  name: tiny
spec:
  model:
    name: tiny
    source:
      builtin: {}
"""
CONFIG_MAP_YAML = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: settings
data:
  prefill: "yes"
"""


def check(tmp_path: Path, text: str, capsys: Any) -> tuple[int, str, str]:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    code = main(["check", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_accepts_a_valid_pool_and_skips_other_kinds(tmp_path: Path, capsys: Any) -> None:
    code, out, err = check(tmp_path, f"{CONFIG_MAP_YAML}---\n{POOL_YAML}", capsys)
    assert code == 0, err
    assert out.splitlines() == [
        f"{tmp_path / 'pool.yaml'}: InferencePool tiny: valid (engine kvpool, block size 16)"
    ]
    # the ConfigMap is checked as the API server would check it (kvpool.operator.standins)
    assert err.splitlines() == [
        f"{tmp_path / 'pool.yaml'}: 1 other object(s) pass cel-cost, pod-validation, "
        "pod-security-restricted, server-side-apply",
        "checked as the API server would: cel-cost, pod-validation, pod-security-restricted, "
        "server-side-apply",
    ]


@pytest.mark.parametrize(
    ("engine", "resources", "says"),
    [
        ("", "{limits: {nvidia.com/gpu: 1}}", "engine vllm, block size 16"),
        ("engine: {type: vllm}\n  ", "{limits: {cpu: 4}}", "engine vllm, block size 32"),
        ("engine: {type: kvpool, blockSize: 64}\n  ", "{limits: {nvidia.com/gpu: 1}}",
         "engine kvpool, block size 64"),
    ],
    ids=["gpus, no engine named", "vllm without gpus", "named"],
)  # fmt: skip
def test_check_says_which_engine_and_block_size_the_operator_will_use(
    tmp_path: Path, capsys: Any, engine: str, resources: str, says: str
) -> None:
    pool = (
        "apiVersion: kvpool.io/v1alpha1\nkind: InferencePool\nmetadata: {name: p}\n"
        "spec:\n  model: {name: m, source: {pvc: {claimName: w}}}\n"
        f"  {engine}decode: {{resources: {resources}}}\n"
    )
    code, out, err = check(tmp_path, pool, capsys)
    assert code == 0, err
    assert out.splitlines() == [f"{tmp_path / 'pool.yaml'}: InferencePool p: valid ({says})"]


def test_check_skips_the_gateway_apis_inferencepool(tmp_path: Path, capsys: Any) -> None:
    other = "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\n"
    other += "metadata: {name: gw}\nspec: {targetPorts: [{number: 8000}]}\n"
    code, out, _ = check(tmp_path, f"{other}---\n{POOL_YAML}", capsys)
    # (only ours is named: the file's path may hold "gw", as pytest-xdist's workers' do)
    assert code == 0
    assert out.splitlines() == [
        f"{tmp_path / 'pool.yaml'}: InferencePool tiny: valid (engine kvpool, block size 16)"
    ]


def test_check_refuses_an_invalid_pool_with_the_precise_problem(
    tmp_path: Path, capsys: Any
) -> None:
    bad = POOL_YAML + "  disaggregation:\n    mode: Disaggregated\n  decode:\n    replica: 2\n"
    code, out, err = check(tmp_path, bad, capsys)
    assert code == 1
    assert out == ""
    assert "InferencePool tiny: spec.decode.replica: Extra inputs are not permitted" in err


def test_check_refuses_a_rule_broken_only_at_the_pool_level(tmp_path: Path, capsys: Any) -> None:
    code, _, err = check(tmp_path, POOL_YAML + "  disaggregation: {mode: Auto}\n", capsys)
    assert code == 1
    assert "spec: prefill is required when disaggregation.mode is Disaggregated or Auto" in err


def test_check_refuses_malformed_yaml_clearly(tmp_path: Path, capsys: Any) -> None:
    code, out, err = check(tmp_path, POOL_YAML + "  decode: [replicas: 2\n", capsys)
    assert code == 1 and out == ""
    assert "pool.yaml: cannot read:" in err and "line" in err


def test_check_refuses_a_missing_file(tmp_path: Path, capsys: Any) -> None:
    assert main(["check", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml: cannot read:" in capsys.readouterr().err


def test_check_refuses_an_unserved_version_naming_the_served_one(
    tmp_path: Path, capsys: Any
) -> None:
    code, _, err = check(tmp_path, POOL_YAML.replace("v1alpha1", "v1"), capsys)
    assert code == 1
    assert "apiVersion 'kvpool.io/v1'" in err and "kvpool.io/v1alpha1" in err


def test_check_says_when_a_file_holds_no_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert main(["check", str(path)]) == 0  # checked as the API server would check it
    assert f"{path}: 1 other object(s) pass" in capsys.readouterr().err
    skip_all = [a for c in STAND_INS for a in ("--skip", c)]
    assert main(["check", *skip_all, str(path)]) == 1
    assert "no InferencePool (kvpool.io) in it" in capsys.readouterr().err
    path.write_text("# nothing\n")
    assert main(["check", str(path)]) == 1
    assert "no Kubernetes object in it" in capsys.readouterr().err


def test_prefill_is_not_autoscaled_in_an_aggregated_pool() -> None:
    spec = validate_pool(
        "p",
        {
            "model": {"name": "m", "source": {"builtin": {}}},
            "slo": {"ttftMilliseconds": 500},
            "autoscaling": {
                "enabled": True,
                "decode": {"maxReplicas": 4},
                "prefill": {"maxReplicas": 4},
            },
        },
    )
    assert spec.autoscaled("decode") and not spec.autoscaled("prefill")


def test_a_minimal_pool_is_locked_down_but_asks_for_no_key() -> None:
    """NetworkPolicies on, the operator's pool secret; no API keys (router.auth unset):
    whoever reaches the router may use the pool, as the CRD's description says."""
    pool = validate_pool("tiny", MINIMAL)
    assert pool.network_policy.enabled is True
    assert pool.network_policy.metrics_from is None  # the operator's default scrapers
    assert pool.network_policy.clients_from is None  # anyone may reach the router
    assert pool.pool_secret is None  # the operator makes one
    assert pool.router.auth is None
    auth = SCHEMA["properties"]["spec"]["properties"]["router"]["properties"]["auth"]
    assert "asks for no key" in auth["description"]
    assert validate_pool("t", spec_with(router={"auth": {"secretName": "k"}})).router.auth.key == (
        "tenants.yaml"
    )


def test_check_refuses_a_trusted_proxy_that_is_no_address(tmp_path: Path, capsys: Any) -> None:
    # No OpenAPI schema can say "a CIDR range": the operator's check (and kvpool check) does.
    bad = POOL_YAML + "  router:\n    clientLimits:\n      trustedProxies: [10.0.0.0/8, ingress]\n"
    code, _, err = check(tmp_path, bad, capsys)
    assert code == 1
    assert "spec.router.clientLimits.trustedProxies" in err
    assert "'ingress' is not an IP address or a CIDR range" in err
