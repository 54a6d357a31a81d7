"""Shared fixtures: the real bundled model, loaded once per test session."""

from __future__ import annotations

import pytest

from kvserve import LLM


@pytest.fixture(scope="session")
def llm_fp32() -> LLM:
    """The bundled SmolLM2-135M-Instruct in float32 with default engine limits."""
    return LLM(dtype="float32")
