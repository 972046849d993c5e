"""One command-line flag and one environment variable per field of a pydantic settings
model, so every component is configured the same way and validated in one place.

A flag wins over the variable; list fields take the flag several times, or the variable as
whitespace-separated items. A bad value becomes one :class:`ValueError` naming the fields.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

S = TypeVar("S", bound=BaseModel)

__all__ = ["add_settings_arguments", "build_settings", "settings_values"]


def _field_type(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(_field_type(annotation)) is list


def _default_text(info: FieldInfo) -> str:
    """What the help says a field falls back to: ``required`` where there is nothing to fall
    back to, ``none`` for an empty list (the flag not given once), ``unset`` for ``None``."""
    if info.is_required():
        return "required"
    try:
        default = info.get_default(call_default_factory=True)
    except TypeError:  # a factory that needs the other fields' values
        return "computed"
    if default is None:
        return "default unset"
    if isinstance(default, list | tuple | set | dict) and not default:
        return "default none"
    if isinstance(default, list | tuple | set):
        return "default " + " ".join(str(x) for x in default)
    if default == "":
        return 'default ""'
    return f"default {default}"


def add_settings_arguments(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    env_prefix: str,
    skip: tuple[str, ...] = (),
) -> None:
    """One ``--flag-name`` per field; values are left as text for the model to validate."""
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        kind = _field_type(info.annotation)
        choices = list(typing.get_args(kind)) if typing.get_origin(kind) is typing.Literal else None
        parts = [info.description] if info.description else []
        parts += [f"env {env_prefix}{name.upper()}", _default_text(info)]
        if _is_list(info.annotation):
            parts.append("repeat for several")
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            choices=choices,
            action="append" if _is_list(info.annotation) else "store",
            default=argparse.SUPPRESS,
            # argparse %-formats help texts: a literal % in a description must be doubled
            help="; ".join(parts).replace("%", "%%"),
        )


def settings_values(
    args: argparse.Namespace, model: type[BaseModel], env_prefix: str, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The flags given, over the environment variables set."""
    values: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        env = os.environ.get(f"{env_prefix}{name.upper()}")
        if hasattr(args, name):
            values[name] = getattr(args, name)
        elif env is not None:
            values[name] = env.split() if _is_list(info.annotation) else env
    return values


def build_settings(model: type[S], values: dict[str, Any]) -> S:
    """The validated settings, or one :class:`ValueError` that names every bad field."""
    try:
        return model(**values)
    except ValidationError as exc:
        problems = "; ".join(
            (f"{'.'.join(str(p) for p in e['loc'])}: " if e["loc"] else "")
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors(include_url=False)
        )
        raise ValueError(f"bad settings: {problems}") from None
