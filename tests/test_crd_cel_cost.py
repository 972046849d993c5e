"""The API server refuses a CRD whose CEL rules it estimates to cost too much (per rule and
in all); no API server runs here, so this stands in for its estimate. The rule that once
iterated an unbounded ``router.settings`` map (the API server assumes ~393,000 entries)
would have made ``helm install`` fail with "estimated rule cost exceeds budget"."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from kvpool.api.crd import (
    PER_CRD_COST_LIMIT,
    PER_RULE_COST_LIMIT,
    cost_problems,
    custom_resource_definition,
    rule_costs,
)


def test_every_rule_reads_only_bounded_fields_and_costs_under_the_limits() -> None:
    crd = custom_resource_definition()
    costs = rule_costs(crd)
    for c in sorted(costs, key=lambda c: -c.cost):
        print(f"{c.cost:>12,}  {c.runs:>6,} x {c.per_run:<8,} {c.path}")
    assert cost_problems(crd) == []
    assert max(c.cost for c in costs) <= PER_RULE_COST_LIMIT
    assert sum(c.cost for c in costs) <= PER_CRD_COST_LIMIT
    # the CRD that is shipped is this one
    with open(Path(__file__).parent.parent / "crds" / "inferencepool.yaml") as f:
        assert yaml.safe_load(f) == crd


def _schema(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_an_unbounded_map_or_string_a_rule_reads_is_named() -> None:
    crd = custom_resource_definition()
    loose = copy.deepcopy(crd)
    del _schema(loose)["properties"]["router"]["properties"]["settings"]["maxProperties"]
    assert cost_problems(loose) == [
        ".spec.router.settings: iterated by a rule, and has no maxProperties"
    ]
    assert max(c.cost for c in rule_costs(loose)) > 1_000_000  # priced as ~393,000 entries
    loose = copy.deepcopy(crd)
    del _schema(loose)["properties"]["engine"]["properties"]["hashSeed"]["maxLength"]
    assert cost_problems(loose) == [
        ".spec.engine.hashSeed: a rule's regex may read it, and has no maxLength"
    ]
