# The two set-up commands of the README. Each installs what it needs (scripts/bootstrap.sh is idempotent).
.PHONY: job test setup lint ruff mypy
# The packages that ruff and mypy check: the one list to extend (scheduling and jobs join later).
PACKAGES = fxdist recsys quant

setup:
	bash scripts/bootstrap.sh

job: setup
	.venv/bin/fxdist launch

ruff: setup
	.venv/bin/ruff check $(PACKAGES)

mypy: setup
	.venv/bin/mypy $(PACKAGES)

lint: ruff mypy

test: setup lint
	.venv/bin/python -m pytest
