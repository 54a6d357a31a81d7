#!/usr/bin/env bash
# The test command: lint, types and C++ format, then the whole suite on the real bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
mypy  # configured in pyproject.toml
clang-format --dry-run --Werror kvserve/kernels/cpu/*.cpp kvserve/kernels/cpu/*.h
python -m pytest -q -ra "$@"
