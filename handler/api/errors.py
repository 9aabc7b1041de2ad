"""Request errors: each broken rule names its field, the rule and what was given and allowed
(HTTP 400 with one entry per offending field)."""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

# A field the API does not know, as logs and metric labels name it.
UNKNOWN_FIELD_LABEL = "unknown_field"


@dataclass(frozen=True)
class FieldError:
    """One broken rule: which field, which rule, and a sentence saying what was given and allowed."""

    field: str
    rule: str
    message: str
    nested: bool = False  # a field inside a top-level one (``loras.0.name``)

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "rule": self.rule, "message": self.message}

    def label(self, known: frozenset[str]) -> str:
        """The field as logs and metric labels name it: one of the API's ``known`` fields (a
        nested one by its top field, as ``loras`` for ``loras.0.scale``), or "body". An unknown
        field's name is the client's text (newlines, commas, colons: TorchServe's metric lines are
        log lines split on them) and unbounded, so it is ``UNKNOWN_FIELD_LABEL``."""
        field = self.field.split(".")[0] if self.nested else self.field
        return field if field in known else UNKNOWN_FIELD_LABEL


class RequestError(Exception):
    """A request that cannot be served as sent (HTTP 400)."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(f"{e.field}: {e.message}" for e in errors))

    @classmethod
    def single(cls, field: str, rule: str, message: str) -> RequestError:
        return cls([FieldError(field, rule, message)])


def field_errors(error: ValidationError, allowed: Iterable[str]) -> list[FieldError]:
    errors = []
    for item in error.errors(include_url=False):
        field = ".".join(str(part) for part in item["loc"]) or "body"
        rule, message = item["type"], item["msg"]
        if rule == "extra_forbidden":
            rule = "unknown_field"
            message = f"unknown field {field!r}; allowed fields: {', '.join(allowed)}"
        elif rule != "missing" and "input" in item:
            given = _short_repr(item["input"])
            if given not in message:
                message = f"{message} (given: {given})"
        errors.append(FieldError(field, rule, message, nested=len(item["loc"]) > 1))
    return errors


def _short_repr(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if _json_safe(value) else reprlib.repr(value)  # reprlib: bounded depth and length
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_safe(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (str, int, bool, type(None)))
