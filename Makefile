# The two set-up commands of the README. Each installs what it needs (scripts/bootstrap.sh is idempotent).
.PHONY: job test setup lint ruff mypy
# ruff checks PACKAGES and tests/; mypy checks PACKAGES.
PACKAGES = fxdist recsys quant scheduling jobs

setup:
	bash scripts/bootstrap.sh

job: setup
	.venv/bin/fxdist launch

ruff: setup
	.venv/bin/ruff check $(PACKAGES) tests

mypy: setup
	.venv/bin/mypy $(PACKAGES)

lint: ruff mypy

test: setup lint
	.venv/bin/python -m pytest
