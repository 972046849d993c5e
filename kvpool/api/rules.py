"""Cross-field rules, written once and enforced twice: by the API server and by the operator.

A rule carries a CEL expression, which goes into the CRD as an ``x-kubernetes-validations``
entry so that ``kubectl apply`` refuses a bad pool before it is stored, and a Python
predicate with the same meaning, which the pydantic model runs so that the operator (and
``kvpool check``) refuse it too: an API server without CEL, or a CRD older than the
operator, must not let a bad spec through to the children. A test evaluates both forms on
the same objects so that they cannot drift apart.

A CEL rule reads an absent field as its default (``has(self.port) ? self.port : 5557``): the
API server fills the schema's defaults in before it validates, but the rule then means what
the Python predicate means without them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, model_validator


@dataclass(frozen=True)
class Rule:
    cel: str  # evaluated with ``self`` bound to the object in its JSON form
    message: str
    check: Callable[[Any], bool]  # the same test, on the pydantic model

    def __post_init__(self) -> None:
        if "; " in self.message:
            raise ValueError(f"a rule's message has no '; ' (it joins messages): {self.message}")

    def crd_entry(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message}


class RuledModel(BaseModel):
    """A model whose ``rules`` hold after field validation, and go into the CRD."""

    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Any:
        broken = [rule.message for rule in type(self).rules if not rule.check(self)]
        if broken:
            raise ValueError("; ".join(broken))
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> Any:
        schema = handler(core_schema)
        if cls.rules:
            handler.resolve_ref_schema(schema)["x-kubernetes-validations"] = [
                rule.crd_entry() for rule in cls.rules
            ]
        return schema
