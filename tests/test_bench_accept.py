"""The evaluation contract's criteria."""

from __future__ import annotations

import pytest

from kvserve.bench.accept import is_acceptable, validate_criterion

SCHEMA = {"type": "object", "properties": {"refund": {"type": "integer"}}, "required": ["refund"]}


@pytest.mark.parametrize(
    "criterion, text, ok",
    [
        ({"contains": "750"}, "The refund is 750 yuan.", True),
        ({"contains": "750"}, "The refund is 600 yuan.", False),
        ({"contains": ["750", "yuan"]}, "750 yuan", True),
        ({"contains": ["750", "yuan"]}, "750 CNY", False),
        ({"regex": r"\b750\s*yuan"}, "up to 750 yuan", True),
        ({"regex": r"^750"}, "up to 750", False),
        ({"equals": "Paris"}, "  Paris\n", True),
        ({"equals": "Paris"}, "Paris.", False),
        ({"json_schema": SCHEMA}, '{"refund": 750}', True),
        ({"json_schema": SCHEMA}, '{"refund": "750"}', False),
        ({"json_schema": SCHEMA}, "refund: 750", False),
        ({"contains": "750", "regex": "yuan$"}, "750 yuan", True),
        ({"contains": "750", "regex": "yuan$"}, "750 yuan.", False),
    ],
)
def test_criteria(criterion: dict, text: str, ok: bool) -> None:
    validate_criterion(criterion)
    assert is_acceptable(text, criterion) is ok


@pytest.mark.parametrize(
    "criterion",
    [{}, {"startswith": "x"}, {"contains": []}, {"contains": 3}, {"regex": "("}, {"equals": 1},
     {"json_schema": {"type": "no-such-type"}}],
)  # fmt: skip
def test_malformed_criteria_are_rejected(criterion: dict) -> None:
    with pytest.raises(ValueError):
        validate_criterion(criterion)
