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

KUBERNETES_VERSION = "1.37.0"  # the newest schema kubernetes-validate 1.37 ships
# The API server drops unknown fields with a warning (fieldValidation=Warn, its default) but
# refuses wrong types and missing required fields: so does the non-strict schema.
_SCHEMAS = f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local"
_MAX_MESSAGE = 200
_CONTAINER_LISTS = ("containers", "initContainers")


def check_children(children: list[dict[str, Any]]) -> None:
    """Raise ValueError naming each rendered Deployment that the API server would refuse:
    ``Deployment tiny-decode: spec.template.spec.containers[0].ports[0].containerPort: 'abc'
    is not of type 'integer'``. Other kinds are the operator's own rendering, unchecked."""
    problems = []
    for child in children:
        if child.get("kind") != "Deployment":
            continue
        problem = _problem(child)
        if problem:
            name = (child.get("metadata") or {}).get("name", "?")
            problems.append(f"Deployment {name}: {problem}")
    if problems:
        raise ValueError("; ".join(problems))


def _problem(deployment: dict[str, Any]) -> str | None:
    """The most relevant schema error of a Deployment, else its first pod problem."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator().iter_errors(deployment))
    if error is not None:
        return f"{_path(error.absolute_path)}: {_short(error.message)}"
    return _pod_problem(deployment)


def _pod_problem(deployment: dict[str, Any]) -> str | None:
    """What the API server checks beyond the schema that a merged template gets wrong most:
    a container without an image, a mount of a volume the pod does not have."""
    pod = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
    volumes = {v.get("name") for v in pod.get("volumes") or ()}
    for key in _CONTAINER_LISTS:
        for i, container in enumerate(pod.get(key) or ()):
            path = f"spec.template.spec.{key}[{i}]"
            if not container.get("image"):
                return f"{path}.image: required (container {container.get('name')!r})"
            for j, mount in enumerate(container.get("volumeMounts") or ()):
                if mount.get("name") not in volumes:
                    return f"{path}.volumeMounts[{j}].name: no volume {mount.get('name')!r}"
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
