#!/usr/bin/env bash
# The test command: lint, then the whole suite on the real bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
python -m pytest -q -ra "$@"
