"""Checks of JSON-decoded values for the scale spec and its records.

Each check returns the value (numbers as ``float``) or raises a one-line :class:`SpecError` (a
``ValueError``) that names the field (``where``, a dotted path such as
``calibration.buckets[0].mass``) and the bad value.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, fields
from typing import Any

__all__ = ["SpecError", "json_type", "field_error", "check_int", "check_num", "check_str", "check_record"]


class SpecError(ValueError):
    """A scale spec (or one of its records) breaks the contract; the one-line message names the field
    and, when the spec came from a file, the file. Callers that face users (the CLI) turn it into
    their own error type; everything else may treat it as the ``ValueError`` it is."""


def json_type(value: Any) -> str:
    """What a JSON-decoded value is, in JSON's words: ``null``, ``an array``, ``a string``, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return json.dumps(value)
    for kind, name in ((dict, "an object"), (list, "an array"), (str, "a string"), ((int, float), "a number")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def field_error(where: str, message: str, value: Any) -> SpecError:
    """``spec field '<where>': <message>, got <value as JSON>`` (long values shortened)."""
    shown = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return SpecError(f"spec field '{where}': {message}, got {shown}")


def check_int(where, value, minimum=None, nullable=False, maximum=None):
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise field_error(where, "expected an integer", value)
    if minimum is not None and value < minimum:
        raise field_error(where, f"expected an integer >= {minimum}", value)
    if maximum is not None and value > maximum:
        raise field_error(where, f"expected an integer <= {maximum}", value)
    return value


def check_num(where, value, minimum=None, exclusive=False, nullable=False):
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise field_error(where, "expected a finite number", value)
    if minimum is not None and (value <= minimum if exclusive else value < minimum):
        raise field_error(where, f"expected a number {'>' if exclusive else '>='} {minimum}", value)
    return float(value)


def check_str(where, value, choices=None, nullable=False):
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise field_error(where, "expected a string", value)
    if choices is not None and value not in choices:
        raise field_error(where, f"expected one of {', '.join(choices)}", value)
    return value


def check_record(where, value, cls):
    """``value`` is a dict holding every required field of dataclass ``cls`` and no other."""
    if not isinstance(value, dict):
        raise field_error(where, "expected an object", value)
    known = {f.name for f in fields(cls)}
    extra = sorted(set(value) - known)
    if extra:
        raise field_error(f"{where}.{extra[0]}", f"unknown field (known: {', '.join(sorted(known))})", value[extra[0]])
    missing = [f.name for f in fields(cls)
               if f.name not in value and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise SpecError(f"spec field '{where}.{missing[0]}': required field is missing")
    return value
