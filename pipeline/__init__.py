"""ncl-pipeline: soft correspondence labels for noisy image-text corpora, on Ray.

Public surface: `load_job` (YAML -> validated JobConfig), `run_job` (run it), `read_labels`,
and `setup_console` (show the pipeline's log on the terminal; see pipeline.runtime.console).
Importing the package configures no logging.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Every Ray worker process imports `pipeline.runtime.console` (the worker set-up hook, and thus this
# package) whether or not it runs pipeline code: Ray Train's controller, its placement-group
# cleaner, Ray Data's stats actor. Eager imports of pydantic and pyarrow.dataset here would cost
# each of them CPU seconds per training round (docs/architecture.md §4.8), so the public names
# load on first use (PEP 562).
_PUBLIC = {
    "JobConfig": "pipeline.config",
    "JobConfigError": "pipeline.config",
    "load_job": "pipeline.config",
    "setup_console": "pipeline.runtime.console",
    "read_labels": "pipeline.clients.read",
}

if TYPE_CHECKING:
    from pipeline.clients.read import read_labels
    from pipeline.config import JobConfig, JobConfigError, load_job
    from pipeline.runtime.console import setup_console


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


def run_job(job: JobConfig, until: str | None = None) -> dict:
    """Run `job` (see pipeline.run.runner.run_job); imported lazily: `import pipeline` stays light.

    `until` names a stage of the job's graph (e.g. "round0/keys", as `ncl-pipeline run
    --until`): the run stops once that stage is done.

    Progress goes to the `pipeline` logger. When nothing has configured logging yet, the
    terminal shows it as the CLI does (`pipeline.runtime.console.ensure_console`); an application
    with its own logging set-up keeps it.
    """
    from pipeline.run.runner import run_job as _run_job
    from pipeline.runtime.console import ensure_console

    ensure_console()
    return _run_job(job, until=until)


__all__ = [
    "JobConfig",
    "JobConfigError",
    "load_job",
    "read_labels",
    "run_job",
    "setup_console",
    "__version__",
]
