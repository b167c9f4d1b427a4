"""Readers of a finished run directory: the HTML report, `ncl-pipeline inspect` (see
docs/architecture.md §1)."""
