# The two set-up commands of the README. Each installs what it needs (scripts/bootstrap.sh is idempotent).
.PHONY: job test setup lint ruff mypy
# ruff and mypy check PACKAGES and ruff their tests; the packages of LATER_PACKAGES (being restructured) and
# their tests/ folders are not checked yet: move a name from LATER_PACKAGES to PACKAGES to check it.
PACKAGES = fxdist recsys quant scheduling
LATER_PACKAGES = jobs

setup:
	bash scripts/bootstrap.sh

job: setup
	.venv/bin/fxdist launch

ruff: setup
	.venv/bin/ruff check $(PACKAGES) tests $(addprefix --extend-exclude tests/,$(LATER_PACKAGES))

mypy: setup
	.venv/bin/mypy $(PACKAGES)

lint: ruff mypy

test: setup lint
	.venv/bin/python -m pytest
