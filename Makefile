# The two set-up commands of the README. Each installs what it needs (scripts/bootstrap.sh is idempotent).
.PHONY: job test setup
setup:
	bash scripts/bootstrap.sh

job: setup
	.venv/bin/fxdist launch

test: setup
	.venv/bin/python -m pytest
