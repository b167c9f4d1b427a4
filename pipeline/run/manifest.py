"""Reading `manifest.json`, the run state's record: a damaged file is never fatal.

A manifest that cannot be read as a JSON object (cut short by a full disk, overwritten,
corrupted) gives one warning and a run state rebuilt from what the outputs themselves record
(`rebuild_stages`): every stage other than an embed pass writes its run-state key
(`RUN_STATE_FIELD`: stage, key, config, inputs) into the summary it writes last (the keys
check's `_keys.json`, `train_summary.json`, a label pass's `_label_pass.json`, a baseline's
`_baseline.json`, the published generation's `_label_pass.json`), and each embeddings table
carries its shard's key in its footer (`pipeline.run.state.table_keys`). The rebuilt records go
through the same decisions as a manifest's (`pipeline.run.state.decide`): a stage is reused only
when its recorded key is the key the job computes now and its outputs are there; anything else
is recomputed. `run_job` keeps the damaged file aside as `manifest.json.damaged-<time>`;
`ncl-pipeline status` reads the same way and changes nothing. `check_resume` refuses a directory
that holds another job's results.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging

from pipeline.config import JobConfig
from pipeline.errors import UserError
from pipeline.io.layout import BASELINE_SUMMARY, LABEL_PASS_SUMMARY, RUN_STATE_FIELD, RunLayout

__all__ = [
    "DAMAGED_SUFFIX",
    "REBUILT",
    "RunConflictError",
    "check_resume",
    "read_manifest",
    "rebuild_stages",
]

logger = logging.getLogger(__name__)

DAMAGED_SUFFIX = ".damaged-"  # manifest.json.damaged-<UTC time>: a damaged manifest kept aside
REBUILT = "rebuilt_from_outputs"  # set in a manifest rebuilt from the outputs' own records


def _load(path: str) -> dict | None:
    """The manifest at `path`; None when there is none. Raises ValueError when damaged."""
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return None
    with fs.open(fs_path, "rb") as handle:
        raw = handle.read()
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(manifest, dict):
        raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
    if not isinstance(manifest.get("stages", {}), dict):
        raise ValueError("its 'stages' is not an object")
    return manifest


def _summaries(layout: RunLayout) -> list[str]:
    """The summary files that may record a stage's key, in run order."""
    from pipeline.io.generations import published_labels_folder
    from pipeline.io.paths import folder_names

    rounds = sorted(int(name) for name in folder_names(layout.rounds_dir) if name.isdigit())
    paths = [layout.keys_summary]
    for r in rounds:
        paths.append(layout.train_summary(r))
        paths += [f"{layout.labels_round_dir(r, v)}/{LABEL_PASS_SUMMARY}" for v in ("a", "b")]
        paths += [
            f"{layout.baseline_dir(r, mode)}/{BASELINE_SUMMARY}"
            for mode in ("oracle", "cosine_filter")
        ]
    paths.append(f"{published_labels_folder(layout.labels_dir)}/{LABEL_PASS_SUMMARY}")
    return paths


def rebuild_stages(layout: RunLayout) -> dict[str, dict]:
    """The run-state records (manifest.json's `stages`) that the outputs record: one done record
    per stage summary holding its key; the embed passes are decided by their tables' footers.
    Unreadable or unkeyed summaries are left out (those stages are recomputed)."""
    from pipeline.io.tables import read_json

    records: dict[str, dict] = {}
    for path in _summaries(layout):
        try:
            summary = read_json(path)
        except (ValueError, OSError) as exc:
            logger.debug(f"{path}: unreadable ({exc}); its stage is recomputed")
            continue
        stamp = summary.get(RUN_STATE_FIELD) if isinstance(summary, dict) else None
        if not isinstance(stamp, dict) or not isinstance(stamp.get("stage"), str):
            continue
        records[stamp["stage"]] = {
            "key": stamp.get("key"),
            "config": stamp.get("config") or {},
            "inputs": stamp.get("inputs") or {},
            "status": "done",
            "summary": summary,
            "rebuilt_from": path,
        }
    return records


def read_manifest(layout: RunLayout, *, keep_aside: bool) -> dict | None:
    """The run directory's manifest; None when it has none; when it is damaged, one rebuilt
    from the outputs: {"stages": rebuild_stages(layout), REBUILT: why it was damaged}.

    Args:
        keep_aside: rename a damaged manifest to `manifest.json.damaged-<time>` (a run, which
            then writes a new one); False for readers (`status`), which change nothing.
    """
    path = layout.manifest
    try:
        return _load(path)
    except (ValueError, OSError) as exc:
        why = str(exc) if isinstance(exc, ValueError) else f"unreadable: {exc}"
    stages = rebuild_stages(layout)
    rebuilt = {"stages": stages, REBUILT: why}
    how = (
        f"the run state is rebuilt from what the outputs record ({len(stages)} stage "
        "summaries and the embeddings tables' footers hold their stage keys): a stage is "
        "reused when its recorded key is the one this job computes now, the others are "
        "recomputed"
    )
    if not keep_aside:
        logger.warning(
            f"{path} is damaged ({why}); showing what the outputs record. A rerun keeps the "
            f"file aside as manifest.json{DAMAGED_SUFFIX}<time> and {how}."
        )
        return rebuilt
    import fsspec

    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = f"{path}{DAMAGED_SUFFIX}{stamp}"
    fs, fs_path = fsspec.core.url_to_fs(path)
    try:
        fs.mv(fs_path, fsspec.core.url_to_fs(aside)[1])
        kept = f"kept aside as {aside}"
    except OSError as error:
        kept = f"could not be kept aside ({error}) and is replaced"
    logger.warning(f"{path} is damaged ({why}); it is {kept}, and {how}.")
    return rebuilt


class RunConflictError(UserError, RuntimeError):
    """The output directory holds the results of another job (another job name)."""


def check_resume(job: JobConfig, layout: RunLayout) -> dict:
    """The output directory's manifest; refuse a directory that holds another job's results.

    A changed configuration of the same job is not refused: the run state recomputes what it
    changed (docs/architecture.md §4.3). Another job name is: running it there would replace
    the other job's labels, which is more likely a wrong `output` than an intent.
    """
    manifest = read_manifest(layout, keep_aside=True) or {}
    recorded = manifest.get("job_name")
    if recorded and recorded != job.name and manifest.get("stages"):
        raise RunConflictError(
            f"output '{layout.output}' holds the results of job '{recorded}', not '{job.name}'; "
            f"running it there would replace them. Use a new output directory (--set "
            f"output=...), or --set name={recorded} to update that run with this configuration."
        )
    return manifest
