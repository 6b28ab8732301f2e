"""The launcher side of a job: the CLI, the plan, the launch, and what it writes (state, report, Prometheus files)."""
