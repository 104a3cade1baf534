# The two set-up commands of the README. Each creates .venv first when needed.
.PHONY: run test setup

setup:
	bash scripts/setup.sh

run: setup
	HF_HUB_OFFLINE=1 .venv/bin/pagedllm generate

test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q tests
