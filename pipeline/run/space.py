"""How much space a run's output needs: the preflight warning and the full-disk message.

A rough estimate from the corpus size, per stage still to run, with per-pair figures taken
from docs/cc3m.md's disk budget (a 512-d model with fp16 vectors, its worst case here):
round 0's embeddings 2.3 KB per pair, a later round's two views 4.4 KB, a label pass 1.3 KB
(index codes and ids 1.06 KB, the label table 0.2 KB), the published table 0.3 KB. Checkpoints
do not depend on the corpus: a training stage counts the size of a checkpoint folder already
written when there is one, else nothing (said in the message); the round in training holds
`TRAINING_STATE_FACTOR` times that more until it ends.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection

from pipeline.io.layout import RunLayout
from pipeline.run.graph import stage_graph

__all__ = [
    "PER_PAIR_BYTES",
    "check_output_space",
    "count_pairs",
    "embedded_pairs",
    "estimate_output_bytes",
    "free_bytes",
    "remaining_space_note",
]

logger = logging.getLogger(__name__)

# Bytes per pair that a stage writes (docs/cc3m.md, "Embeddings", "Indexes", "Label tables").
PER_PAIR_BYTES = {"embed0": 2_300, "embed": 4_400, "labels": 1_300, "publish": 300}


def _size(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def count_pairs(shard_paths: list[str]) -> int | None:
    """Pairs in the input, from img2dataset's `<shard>_stats.json` (successes) or the sibling
    `<shard>.parquet` (rows), read without opening the tars; None when no shard has either.
    Shards without both count as the average of those with them."""
    import fsspec
    import pyarrow.parquet as pq

    counts = []
    for path in shard_paths:
        stem = path[: -len(".tar")] if path.endswith(".tar") else None
        if stem is None:
            continue
        try:
            fs, fs_path = fsspec.core.url_to_fs(f"{stem}_stats.json")
            with fs.open(fs_path, "r") as handle:
                counts.append(int(json.load(handle)["successes"]))
            continue
        except (OSError, ValueError, KeyError, TypeError):
            pass
        try:
            fs, fs_path = fsspec.core.url_to_fs(f"{stem}.parquet")
            with fs.open(fs_path, "rb") as handle:
                counts.append(pq.read_metadata(handle).num_rows)
        except (OSError, ValueError):
            continue
    if not counts:
        return None
    return round(sum(counts) / len(counts) * len(shard_paths))


def _folder_bytes(folder: str) -> int:
    import fsspec

    fs, path = fsspec.core.url_to_fs(folder)
    try:
        return int(fs.du(path)) if fs.exists(path) else 0
    except OSError:
        return 0


# A finished round keeps its models' weights; while it trains it also holds their resume
# state (the weights again and AdamW's two moments) and the warm-up's best epoch.
TRAINING_STATE_FACTOR = 4


def estimate_output_bytes(
    job, pairs: int, done: Collection[str] = (), checkpoint_bytes: int = 0
) -> int:
    """Bytes the stages of `job` not in `done` write for `pairs` pairs (module docstring);
    `checkpoint_bytes` per training stage (one finished round's checkpoint folder, both
    views), and the resume state of the one in training on top."""
    total, training = 0, False
    for node in stage_graph(job):
        if node.name in done:
            continue
        if node.kind == "embed":
            total += pairs * PER_PAIR_BYTES["embed0" if node.round_index == 0 else "embed"]
        elif node.kind in ("labels", "publish"):
            total += pairs * PER_PAIR_BYTES[node.kind]
        elif node.kind in ("warmup", "train"):
            total += checkpoint_bytes
            training = True
    return total + (TRAINING_STATE_FACTOR * checkpoint_bytes if training else 0)


def free_bytes(output: str) -> int | None:
    """Free bytes on the filesystem of a local output (its nearest existing folder); None for
    an fsspec URL (object storage has no such figure)."""
    if "://" in output and not output.startswith("file://"):
        return None
    path = os.path.abspath(output.removeprefix("file://"))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _basis(pairs: int, checkpoint_bytes: int) -> str:
    figures = ", ".join(f"{k} {_size(v)}" for k, v in PER_PAIR_BYTES.items())
    ckpt = (
        f"{_size(checkpoint_bytes)} per training round (measured)"
        if checkpoint_bytes
        else "checkpoints not counted"
    )
    return f"{pairs} pairs at {figures} per pair and stage; {ckpt}"


def _checkpoint_bytes(layout: RunLayout, rounds: int) -> int:
    """One round's checkpoint folder as this run wrote it (the latest there is), else 0."""
    for round_index in range(rounds, -1, -1):
        measured = _folder_bytes(f"{layout.round_dir(round_index)}/checkpoints")
        if measured:
            return measured
    return 0


def check_output_space(job, layout: RunLayout, shard_paths: list[str], records: dict) -> None:
    """Warn before any work when the output's filesystem has less free space than the stages
    still to run are estimated to write (`records`: the manifest's stage records)."""
    free = free_bytes(layout.output)
    pairs = count_pairs(shard_paths)
    if free is None or pairs is None:
        return
    done = [stage for stage, record in records.items() if record.get("status") == "done"]
    ckpt = _checkpoint_bytes(layout, job.train.rounds)
    need = estimate_output_bytes(job, pairs, done, ckpt)
    if free < need:
        logger.warning(
            f"the output's filesystem has {_size(free)} free and this run is estimated to write "
            f"{_size(need)} more to {layout.output} ({_basis(pairs, ckpt)}): it may stop with "
            "a full disk (a rerun then resumes it). Free space, or set output elsewhere."
        )


def remaining_space_note(job, layout: RunLayout, records: dict, pairs: int | None) -> str:
    """One sentence for a full disk: about how much the stages not yet done still need."""
    if pairs is None:
        return ""
    done = [stage for stage, record in records.items() if record.get("status") == "done"]
    ckpt = _checkpoint_bytes(layout, job.train.rounds)
    need = estimate_output_bytes(job, pairs, done, ckpt)
    return f"The stages still to run need about {_size(need)} more ({_basis(pairs, ckpt)})."


def embedded_pairs(metrics: dict, shard_paths: list[str]) -> int | None:
    """Pairs of the run: round 0's embedded count when known, else the input's count."""
    embed = ((metrics.get("rounds") or {}).get("0") or {}).get("embed") or {}
    if embed.get("embedded"):
        return int(embed["embedded"])
    return count_pairs(shard_paths)
