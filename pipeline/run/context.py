"""`RunContext`: what the stages of one run share as it goes (docs/architecture.md §4.3).

It holds the job, the run directory, the run state (manifest.json's `stages`), metrics.json,
and the run's moving facts: the round-0 key of every input shard, the admitted shards still
usable (an output of the round-0 embed pass, narrowed when shards change), the latest
checkpoints of models A and B, and the stage running now (for error messages). The stage kinds
(`pipeline.run.kinds`) read and update it; the runner only loops.
"""

from __future__ import annotations

import logging
import platform
from importlib import metadata
from typing import Any

from pipeline.config import JobConfig
from pipeline.io.layout import RunLayout
from pipeline.io.shards import shard_name
from pipeline.io.tables import write_json_atomic
from pipeline.run.manifest import REBUILT
from pipeline.run.state import RunState

__all__ = ["RunContext"]

logger = logging.getLogger(__name__)


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("ncl-pipeline", "torch", "open_clip_torch", "ray", "pyarrow", "faiss-cpu"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions


class RunContext:
    """One run: its records (manifest.json, metrics.json) and the shards and models it is at."""

    def __init__(
        self, job: JobConfig, layout: RunLayout, manifest: dict, shard_paths: list[str]
    ) -> None:
        self.job = job
        self.layout = layout
        self.manifest = manifest
        manifest.update(
            {
                "job_name": job.name,
                "job_hash": job.stage_hash(),
                "job": job.model_dump(mode="json"),
                "versions": _versions(),
            }
        )
        manifest.pop("stage_hashes", None)  # older run directories; `stages` replaces it
        manifest.pop(REBUILT, None)  # a damaged manifest's records, rebuilt from the outputs
        stages = manifest.get("stages") or {}
        manifest["stages"] = {k: v for k, v in stages.items() if isinstance(v, dict)}
        manifest["shards"] = {"failed": [], "changed": [], "duplicate_keys": {}}
        self.state = RunState(manifest["stages"], save=self.save_manifest)
        self.paths = {shard_name(p): p for p in shard_paths}  # every input shard
        self.shard_keys: dict[str, str] = {}  # round-0 key of every input shard
        self.usable: list[str] = list(self.paths)  # admitted and unchanged (names)
        self.checkpoints: dict[str, str] = {}  # the latest of models A and B
        self.stage = "the embed pass (round 0)"  # what runs now, for error messages
        logger.debug(f"versions: {manifest['versions']}")
        self.save_manifest()
        # Rebuilt by every run: reused stages contribute their recorded summaries.
        self.metrics: dict[str, Any] = {"rounds": {}}
        self.rounds = self.metrics["rounds"]
        self.metrics["outputs"] = {
            "embeddings": layout.embeddings_dir(0),
            "quarantine": layout.quarantine_dir,
            "labels": layout.labels_dir,
            "manifest": layout.manifest,
        }

    def usable_paths(self) -> list[str]:
        return [self.paths[name] for name in self.usable]

    def save_manifest(self) -> None:
        write_json_atomic(self.manifest, self.layout.manifest)

    def record(self, round_index: int, key: str, value) -> None:
        self.rounds.setdefault(str(round_index), {})[key] = value
        self.write_metrics()

    def write_metrics(self) -> None:
        write_json_atomic(self.metrics, self.layout.metrics)

    def note_shards(self, kind: str, value) -> None:
        """Record failed / changed shards or duplicate keys in the manifest and metrics."""
        shards = self.manifest["shards"]
        if isinstance(shards[kind], list):
            shards[kind].extend(value)
        else:
            shards[kind] = value
        self.metrics["shards"] = shards
        self.save_manifest()
        self.write_metrics()

    def leave_out(self, changed: dict[str, str]) -> None:
        """Drop shards that changed or disappeared since the embed pass (reported)."""
        if not changed:
            return
        self.note_shards("changed", [{"shard": s, "error": e} for s, e in changed.items()])
        logger.warning(
            f"{len(changed)} shard(s) changed or disappeared after the embed pass and are left "
            "out of the rest of this run (rerun to embed them again):\n"
            + "\n".join(f"  {error}" for error in changed.values())
        )
        self.usable = [name for name in self.usable if name not in changed]

    def check_still_there(self) -> None:
        """Leave out the usable shards missing or resized since the round-0 embed pass."""
        from pipeline.io.admitted import changed_shards, read_embeddings_footer

        recorded = {}
        for name in self.usable:
            footer = read_embeddings_footer(self.layout.embeddings(0, name))
            recorded[name] = (self.paths[name], footer.shard_bytes if footer else None)
        self.leave_out(changed_shards(recorded))
