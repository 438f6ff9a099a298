# The two commands of the README: `make demo` (the whole pipeline on embedded defaults) and
# `make test` (the test suite, with the services it needs). Both do all set-up first.
SHELL := /bin/bash
export DELTALOOP_STATE ?= $(CURDIR)/.state
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: setup services demo test test-fast

setup:
	./scripts/setup.sh

services:
	./scripts/start_services.sh

demo: setup
	.venv/bin/deltaloop run configs/demo.yaml

test: services
	.venv/bin/lint-imports
	./scripts/run_tests.sh

test-fast: setup
	.venv/bin/python -m pytest -q tests/unit
