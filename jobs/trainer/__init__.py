"""The trainer side of a job: the step loop the Ray trainers run, the workloads, and the servers they talk to."""
