"""Ray plumbing the stages use: start-up, devices, preflight, progress, the console (see
docs/architecture.md §1)."""
