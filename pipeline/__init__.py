"""ncl-pipeline: soft correspondence labels for noisy image-text corpora, on Ray.

Public surface: `load_job` (YAML -> validated JobConfig), `run_job` (run it), `read_labels`,
and `setup_console` (show the pipeline's log on the terminal; see pipeline.console). Importing
the package configures no logging.
"""

from pipeline.config import JobConfig, JobConfigError, load_job
from pipeline.console import setup_console
from pipeline.labels import read_labels

__version__ = "0.1.0"


def run_job(job: JobConfig) -> dict:
    """Run `job` (see pipeline.runner.run_job); imported lazily so `import pipeline` stays light.

    Progress goes to the `pipeline` logger. When nothing has configured logging yet, the
    terminal shows it as the CLI does (`pipeline.console.ensure_console`); an application with
    its own logging set-up keeps it.
    """
    from pipeline.console import ensure_console
    from pipeline.runner import run_job as _run_job

    ensure_console()
    return _run_job(job)


__all__ = [
    "JobConfig",
    "JobConfigError",
    "load_job",
    "read_labels",
    "run_job",
    "setup_console",
    "__version__",
]
