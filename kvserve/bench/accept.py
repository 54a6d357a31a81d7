"""The evaluation contract: what counts as an acceptable answer (book §31.7, "the most important
denominator").

A criterion is a JSON object with one or more of these keys; every key given must hold:

- ``contains``: a string (or list of strings) that must all occur in the answer;
- ``regex``: a Python regular expression searched anywhere in the answer;
- ``equals``: the answer, stripped of surrounding whitespace, must equal this string;
- ``json_schema``: the answer must parse as JSON and validate against this schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

CRITERIA = ("contains", "regex", "equals", "json_schema")


def validate_criterion(criterion: dict[str, Any]) -> None:
    """Raise ValueError when a criterion is malformed, so a bad workload fails when loaded."""
    if not isinstance(criterion, dict) or not criterion:
        raise ValueError(f"accept must be a non-empty object with keys from {CRITERIA}, got {criterion!r}")
    unknown = set(criterion) - set(CRITERIA)
    if unknown:
        raise ValueError(f"accept has unknown keys {sorted(unknown)}; allowed: {CRITERIA}")
    if "contains" in criterion:
        needles = criterion["contains"]
        if isinstance(needles, str):
            needles = [needles]
        if not isinstance(needles, list) or not needles or not all(isinstance(n, str) for n in needles):
            raise ValueError("accept.contains must be a string or a non-empty list of strings")
    if "regex" in criterion:
        try:
            re.compile(criterion["regex"])
        except (re.error, TypeError) as exc:
            raise ValueError(f"accept.regex does not compile: {exc}") from exc
    if "equals" in criterion and not isinstance(criterion["equals"], str):
        raise ValueError("accept.equals must be a string")
    if "json_schema" in criterion:
        try:
            jsonschema.validators.validator_for(criterion["json_schema"]).check_schema(criterion["json_schema"])
        except jsonschema.SchemaError as exc:
            raise ValueError(f"accept.json_schema is not a valid schema: {exc.message}") from exc


def is_acceptable(text: str, criterion: dict[str, Any]) -> bool:
    """True when ``text`` satisfies every key of ``criterion``."""
    if "contains" in criterion:
        needles = criterion["contains"]
        if any(n not in text for n in ([needles] if isinstance(needles, str) else needles)):
            return False
    if "regex" in criterion and re.search(criterion["regex"], text) is None:
        return False
    if "equals" in criterion and text.strip() != criterion["equals"]:
        return False
    if "json_schema" in criterion:
        try:
            jsonschema.validate(json.loads(text), criterion["json_schema"])
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
    return True
