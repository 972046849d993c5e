"""Reading InferencePool manifests from YAML, as ``kubectl apply -f`` would take them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent, CollectionEndEvent, MappingStartEvent, ScalarEvent
from yaml.nodes import MappingNode, Node, SequenceNode

from .inferencepool import API_VERSION, KIND, InferencePoolSpec, validate_pool


class ManifestError(ValueError):
    """A manifest that is not YAML, or an InferencePool in it that is not valid."""


class _FlatLoader(yaml.SafeLoader):
    """PyYAML's safe loader, composing without recursion: its own composer recurses once per
    level, so a document nested a few hundred deep raised RecursionError (and libyaml's
    crashes the interpreter deeper still). Read whole, such a document is refused by
    validate_pool, which names the field. (No path resolvers: the safe loader has none.)"""

    def compose_node(self, parent: Node | None, index: object) -> Node:
        stack: list[list] = []  # [open collection, key waiting for its value (mappings)]
        while True:
            if stack and self.check_event(CollectionEndEvent):
                node = stack.pop()[0]
                node.end_mark = self.get_event().end_mark
            elif self.check_event(AliasEvent):
                event = self.get_event()
                if event.anchor not in self.anchors:
                    raise yaml.composer.ComposerError(
                        None, None, f"found undefined alias {event.anchor!r}", event.start_mark
                    )
                node = self.anchors[event.anchor]
            else:
                event = self.peek_event()
                if event.anchor is not None and event.anchor in self.anchors:
                    raise yaml.composer.ComposerError(
                        f"found duplicate anchor {event.anchor!r}; first occurrence",
                        self.anchors[event.anchor].start_mark,
                        "second occurrence",
                        event.start_mark,
                    )
                if self.check_event(ScalarEvent):
                    node = self.compose_scalar_node(event.anchor)
                else:
                    stack.append([self._open_collection(event.anchor), None])
                    continue
            if not stack:
                return node
            top = stack[-1]
            if isinstance(top[0], SequenceNode):
                top[0].value.append(node)
            elif top[1] is None:
                top[1] = node
            else:
                top[0].value.append((top[1], node))
                top[1] = None

    def _open_collection(self, anchor: str | None) -> Node:
        """compose_sequence_node and compose_mapping_node up to their first item."""
        start = self.get_event()
        kind = MappingNode if isinstance(start, MappingStartEvent) else SequenceNode
        tag = start.tag
        if tag is None or tag == "!":
            tag = self.resolve(kind, None, start.implicit)
        node = kind(tag, [], start.start_mark, None, flow_style=start.flow_style)
        if anchor is not None:
            self.anchors[anchor] = node
        return node


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a YAML file (``-``: standard input), each a mapping."""
    try:
        text = sys.stdin.read() if str(path) == "-" else Path(path).read_text()
        docs = [d for d in yaml.load_all(text, Loader=_FlatLoader) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"cannot read: {exc}") from None
    except RecursionError:  # merge keys (<<) chained hundreds deep
        raise ManifestError("cannot read: nested too deeply") from None
    for doc in docs:
        if not isinstance(doc, dict):
            raise ManifestError(f"a document is a {type(doc).__name__}, not a Kubernetes object")
    return docs


def is_pool(doc: dict[str, Any]) -> bool:
    return doc.get("kind") == KIND and str(doc.get("apiVersion", "")).startswith("kvpool.io/")


def load_pools(
    path: str | Path | list[dict[str, Any]], *, allow_host_access: bool = False
) -> list[tuple[str, InferencePoolSpec]]:
    """Every InferencePool in a YAML file (or in its documents, as :func:`load_documents`
    gave them), validated; other kinds are skipped.

    ``allow_host_access``: as ``validate_pool``'s (the operator's allowHostAccess)."""
    docs = path if isinstance(path, list) else load_documents(path)
    pools = []
    for doc in docs:
        if not is_pool(doc):
            continue
        if doc.get("apiVersion") != API_VERSION:
            raise ManifestError(f"apiVersion {doc.get('apiVersion')!r}: this kvpool serves "
                                f"{API_VERSION}")  # fmt: skip
        name = str((doc.get("metadata") or {}).get("name") or "")
        if not name:
            raise ManifestError("an InferencePool without metadata.name")
        try:
            spec = validate_pool(name, doc.get("spec") or {}, allow_host_access=allow_host_access)
            pools.append((name, spec))
        except ValueError as exc:
            raise ManifestError(f"InferencePool {name}: {exc}") from None
    return pools
