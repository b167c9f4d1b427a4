"""ncl-pipeline: soft correspondence labels for noisy image-text corpora, on Ray.

Public surface: `load_job` (YAML -> validated JobConfig) and `run_job` (run it).
"""

from pipeline.config import JobConfig, JobConfigError, load_job
from pipeline.labels import read_labels

__version__ = "0.1.0"


def run_job(job: JobConfig, log=print) -> dict:
    """Run `job` (see pipeline.runner.run_job); imported lazily so `import pipeline` stays light."""
    from pipeline.runner import run_job as _run_job

    return _run_job(job, log=log)


__all__ = ["JobConfig", "JobConfigError", "load_job", "read_labels", "run_job", "__version__"]
