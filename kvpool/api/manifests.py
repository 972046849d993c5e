"""Reading InferencePool manifests from YAML, as ``kubectl apply -f`` would take them."""

from __future__ import annotations

from pathlib import Path

import yaml

from .inferencepool import API_VERSION, KIND, InferencePoolSpec, validate_pool


class ManifestError(ValueError):
    """A manifest that is not YAML, or an InferencePool in it that is not valid."""


def load_pools(path: str | Path) -> list[tuple[str, InferencePoolSpec]]:
    """Every InferencePool in a YAML file, validated; other kinds are skipped."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"cannot read: {exc}") from None
    pools = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise ManifestError(f"a document is a {type(doc).__name__}, not a Kubernetes object")
        if doc.get("kind") != KIND or not str(doc.get("apiVersion", "")).startswith("kvpool.io/"):
            continue
        if doc.get("apiVersion") != API_VERSION:
            raise ManifestError(f"apiVersion {doc.get('apiVersion')!r}: this kvpool serves "
                                f"{API_VERSION}")  # fmt: skip
        name = str((doc.get("metadata") or {}).get("name") or "")
        if not name:
            raise ManifestError("an InferencePool without metadata.name")
        try:
            pools.append((name, validate_pool(name, doc.get("spec") or {})))
        except ValueError as exc:
            raise ManifestError(f"InferencePool {name}: {exc}") from None
    return pools
