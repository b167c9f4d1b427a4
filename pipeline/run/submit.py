"""`ncl-pipeline submit`: run a job on a Ray cluster through the Ray Jobs API.

The job is validated locally first, then the fully resolved job (overrides applied) is shipped
as the runtime env's working directory and run there as `ncl-pipeline run job.yaml`. Paths in
the job are the cluster's paths. The cluster must have ncl-pipeline installed (docker/).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path

import yaml

from pipeline.config import load_job
from pipeline.errors import UserError

__all__ = ["SubmitError", "submit_job"]

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}

logger = logging.getLogger(__name__)


class SubmitError(UserError, RuntimeError):
    """The cluster could not be reached or refused the job; the message says what to do."""


def _token_configured() -> bool:
    return bool(
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    )


def _explain(address: str, exc: Exception) -> SubmitError:
    text = str(exc)
    lowered = text.lower()
    if any(word in lowered for word in ("401", "403", "unauthorized", "unauthenticated", "token")):
        return SubmitError(
            f"the Ray cluster at {address} requires an auth token. Set RAY_AUTH_MODE=token and "
            "RAY_AUTH_TOKEN=<token> (or RAY_AUTH_TOKEN_PATH=<file>), using the token of the "
            f"cluster (on its head node: ~/.ray/auth_token). Ray said: {text.strip()[:300]}"
        )
    return SubmitError(
        f"cannot reach the Ray Jobs API at {address}: {text.strip()[:300]}. Check the address "
        "(the dashboard port, usually 8265) and that the cluster runs ray[default]."
    )


def _submit_with_retry(client, address: str, attempts: int = 20, **kwargs) -> str:
    """Submit, waiting out a freshly started head whose job agent is not up yet."""
    for attempt in range(attempts):
        try:
            return client.submit_job(**kwargs)
        except Exception as exc:
            transient = "no available agent" in str(exc).lower()
            if not transient or attempt == attempts - 1:
                raise _explain(address, exc) from None
            time.sleep(min(0.5 * 2**attempt, 5.0))
    raise AssertionError("unreachable")


def submit_job(
    job_file: str | Path,
    address: str,
    overrides: list[str] | None = None,
    *,
    follow: bool = False,
) -> str:
    """Submit `job_file` to the cluster at `address`.

    Returns:
        The job's status: its final status when `follow`, else the status right after submission.

    Raises:
        JobConfigError: the job file is invalid (checked before contacting the cluster).
        SubmitError: the cluster is unreachable, needs a token, or rejected the job.
    """
    from ray.job_submission import JobSubmissionClient

    job = load_job(job_file, overrides)
    try:
        client = JobSubmissionClient(address)
    except Exception as exc:  # Ray raises plain ConnectionError/RuntimeError variants
        raise _explain(address, exc) from None
    if not _token_configured() and address.startswith("http"):
        logger.warning(
            "no Ray auth token configured and the cluster accepted the connection: "
            "if its token auth is off, anyone who can reach this address can run code there"
        )
    with tempfile.TemporaryDirectory(prefix="ncl-submit-") as workdir:
        resolved = job.model_dump(mode="json")
        (Path(workdir) / "job.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        submission_id = f"ncl-{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        job_id = _submit_with_retry(
            client,
            address,
            entrypoint="ncl-pipeline run job.yaml",
            submission_id=submission_id,
            runtime_env={"working_dir": workdir},
            metadata={"ncl.job_name": job.name, "ncl.job_hash": job.stage_hash()},
        )
    logger.info(f"submitted {job_id} to {address}")
    if not follow:
        logger.info(f"follow it with: ray job logs --address {address} --follow {job_id}")
        return str(client.get_job_status(job_id))

    async def _tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            for line in lines.rstrip("\n").split("\n"):
                logger.info(line)

    asyncio.run(_tail())
    status = client.get_job_status(job_id)
    while str(status) not in TERMINAL:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    logger.info(f"job {job_id} finished: {status}")
    return str(status)
