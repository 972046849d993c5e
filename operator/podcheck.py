"""The rendered Deployments against Kubernetes' own schema, before anything is applied.

A pool's ``podTemplate`` is merged over what the operator renders, and the models cannot
type it (``kvpool.api.podtemplate`` checks only what it may ask for). Without this check a
bad one (a port that is not a number, a sidecar without an image) reaches the API server,
which refuses the Deployment halfway through applying the pool's children; here the pool
is refused whole, with the child and the field named, before any child is touched.

The schemas are kubernetes-validate's (the OpenAPI of one Kubernetes release, as JSON
Schema). It runs on every sync of every pool, so the validator is built once (about 70 ms);
a pool's Deployments then take about 1.5 ms each, too little to be worth a cache.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from importlib import resources
from typing import Any

from .standins import KUBERNETES_VERSION, check_objects

# The API server drops unknown fields with a warning (fieldValidation=Warn, its default) but
# refuses wrong types and missing required fields: so does the non-strict schema.
_SCHEMAS = f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local"
_MAX_MESSAGE = 200


def check_children(children: list[dict[str, Any]]) -> None:
    """Raise ValueError naming each rendered child that the API server would refuse:
    ``Deployment tiny-decode: spec.template.spec.containers[0].ports[0].containerPort: 'abc'
    is not of type 'integer'``. Deployments against the schema, then every child against
    the stand-ins of the API server's pod validation and server-side apply
    (:mod:`.standins`)."""
    problems = []
    for child in children:
        if child.get("kind") != "Deployment":
            continue
        problem = _problem(child)
        if problem:
            name = (child.get("metadata") or {}).get("name", "?")
            problems.append(f"Deployment {name}: {problem}")
    if not problems:
        findings = check_objects(children, ("pod-validation", "server-side-apply"))
        problems = [f"{f.obj}: {f.path}: {f.message}" for f in findings]
    if problems:
        raise ValueError("; ".join(problems))


def pod_security_warning(children: list[dict[str, Any]]) -> str | None:
    """What of the rendered pods Pod Security "restricted" would refuse, in words (None:
    nothing). Not a refusal: only a namespace that enforces the profile refuses them, and
    then the pool's status shows the Deployment's FailedCreate."""
    findings = check_objects(children, ("pod-security-restricted",))
    if not findings:
        return None
    return ("in a namespace enforcing Pod Security \"restricted\", these pods would be "
            "refused: " + "; ".join(f"{f.obj}: {f.path}: {f.message}" for f in findings[:8])
            + (f" (and {len(findings) - 8} more)" if len(findings) > 8 else ""))  # fmt: skip


def _problem(deployment: dict[str, Any]) -> str | None:
    """The most relevant schema error of a Deployment."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator().iter_errors(deployment))
    if error is not None:
        return f"{_path(error.absolute_path)}: {_short(error.message)}"
    return None


def _path(parts: Iterable[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(the object)"


def _short(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."


@functools.cache
def _validator() -> Any:
    import jsonschema
    from referencing import Registry, Resource

    root = resources.files("kubernetes_validate").joinpath(_SCHEMAS)
    schema = json.loads(root.joinpath("deployment-apps-v1.json").read_text())
    definitions = json.loads(root.joinpath("_definitions.json").read_text())
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)
