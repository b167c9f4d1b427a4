"""Orchestration: the runner, the run state, status, summaries, failures, cluster submission
(see docs/architecture.md §1)."""
