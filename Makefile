# The two set-up commands of the README. Each installs what it needs (scripts/bootstrap.sh is idempotent).
.PHONY: job test setup lint ruff mypy docs dist
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

# The docs site (mkdocs.yml, strict) into build/site; its reference pages are generated from the code.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --quiet

# The sdist and the wheel (with the compiled kernels) into dist/, offline: docs/install.md.
dist: setup
	.venv/bin/python -m build --no-isolation --outdir dist .

# Lint, the docs build and pytest in two lanes side by side (the tests that start Ray, and the others).
test: setup
	bash scripts/test.sh
