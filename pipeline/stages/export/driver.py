"""Export the cleaned corpus of a run for training: webdataset shards, a DataComp uid file, keys
(docs/architecture.md §4.10 has the formats and the resume rules).

Contract (`ncl-pipeline export RUN --out DIR`):
- Kept pairs: the rows of RUN's published label tables (any `READABLE_SCHEMA_NAMES` version)
  with `soft_label >= min_label` and `subset` in `subsets`.
- `export_run` plans the output deterministically, runs `pipeline.stages.export.tasks` (one task
  per input shard, one per output shard) for `wds`, or writes `uids.npy` / `keys.parquet`.
- DIR is refused when it holds anything but an unfinished export of the same plan
  (`ExportConflictError`) unless `overwrite`; the same plan resumes, so a killed export rerun
  leaves every kept key exactly once. `_export.json` (the summary) is written last.
"""

from __future__ import annotations

import logging
import os
import re
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.labels import SCORE_COLUMNS
from pipeline.core.selection import fused_rank, kept_count, rank_grid
from pipeline.errors import UserError
from pipeline.io.labels import (
    DEFAULT_MIN_LABEL,
    DEFAULT_SUBSETS,
    READABLE_SCHEMA_NAMES,
    SUBSET_VALUES,
    RankCut,
    open_label_table,
    read_kept,
)
from pipeline.io.layout import MANIFEST_NAME
from pipeline.io.tables import TEMP_SUFFIX, open_atomic, read_json, write_json_atomic

__all__ = [
    "FORMATS",
    "KEYS_SCHEMA",
    "UID_DTYPE",
    "ExportConflictError",
    "ExportSpec",
    "export_run",
    "format_summary",
    "output_ranges",
    "repeat_counts",
    "uid_array",
]

logger = logging.getLogger(__name__)

FORMATS = ("wds", "uid", "keys")
# What `--rank-by` may rank by for `--keep-fraction`: the label, the mixture's posterior, the
# CLIP score (DataComp's baseline), every method's score column, and `fusion`: the label and
# the CLIP score by their mean percentile rank (docs/methods.md §14).
FUSED_COLUMNS = ("soft_label", "cosine")
RANK_COLUMNS = ("soft_label", "clean_prob", "cosine", *SCORE_COLUMNS, "fusion")
UID_DTYPE = np.dtype("u8,u8")  # DataComp's subset-file dtype: (high, low) halves of a uid
PLAN_NAME = "_export_plan.json"
SUMMARY_NAME = "_export.json"
PARTS = "_parts"
# Part and join tasks: one CPU each, retried (their writes are atomic). `ncl-pipeline export`
# runs on a finished run without the job's preflight, so they declare no requests.
TASK_OPTIONS = {"num_cpus": 1, "max_retries": 2}
KEYS_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),
        pa.field("soft_label", pa.float32(), nullable=False),
        pa.field("subset", pa.string(), nullable=False),
        pa.field("round", pa.int16(), nullable=False),
        pa.field("uid", pa.string(), nullable=False),
    ],
    metadata={"ncl.schema": "export_keys.v1"},
)
# Files an export writes: what `overwrite` may remove.
_OURS = re.compile(
    r"^(\d+\.tar|\d+_stats\.json|sizes\.json|uids\.npy|keys\.parquet|_export(_plan)?\.json|"
    rf"_parts)({TEMP_SUFFIX})?$"
)


class ExportConflictError(UserError, ValueError):
    """DIR is not empty and does not hold an unfinished export of the same run and options."""


@dataclass(frozen=True)
class ExportSpec:
    """What to export and how (validated on construction)."""

    run: str  # run directory (its labels/) or a folder of label tables
    out: str  # export directory
    format: str = "wds"  # wds | uid | keys
    min_label: float = DEFAULT_MIN_LABEL  # keep soft_label >= min_label
    subsets: tuple[str, ...] = DEFAULT_SUBSETS  # keep these subsets
    samples_per_shard: int = 10_000  # wds: pairs per output shard (DataComp's resharder default)
    repeat_by_label: float | None = None  # uid: write each uid round(R * label) times
    seed: int = 0  # uid: seed of the stochastic rounding
    overwrite: bool = False  # clear a previous export in `out` first
    shards: tuple[str, ...] | None = None  # input tars when they moved (else ncl.shard_path)
    keep_fraction: float | None = None  # keep the top fraction of every labelled pair ...
    rank_by: str = "soft_label"  # ... ranked by this column (ties: the smaller key first)

    def __post_init__(self) -> None:
        if self.rank_by not in RANK_COLUMNS:
            raise ValueError(f"--rank-by {self.rank_by!r}: use one of {', '.join(RANK_COLUMNS)}")
        if self.keep_fraction is not None:
            if not 0 < self.keep_fraction <= 1:
                raise ValueError(f"--keep-fraction {self.keep_fraction} must be in (0, 1]")
            if self.min_label != DEFAULT_MIN_LABEL or set(self.subsets) != set(DEFAULT_SUBSETS):
                raise ValueError(
                    "--keep-fraction keeps the top fraction of every labelled pair by "
                    "--rank-by (DataComp's rule); leave out --min-label and --subset"
                )
            object.__setattr__(self, "subsets", tuple(SUBSET_VALUES))  # every pair competes
        elif self.rank_by != "soft_label":
            raise ValueError("--rank-by applies with --keep-fraction only")
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r}; use one of {', '.join(FORMATS)}")
        unknown = [s for s in self.subsets if s not in SUBSET_VALUES]
        if unknown or not self.subsets:
            raise ValueError(
                f"subsets={list(self.subsets)}: use a comma-separated list of "
                f"{', '.join(SUBSET_VALUES)}"
            )
        if self.samples_per_shard <= 0:
            raise ValueError(f"samples_per_shard={self.samples_per_shard} must be positive")
        if self.repeat_by_label is not None:
            if self.format != "uid":
                raise ValueError("--repeat-by-label applies to --format uid only")
            if not self.repeat_by_label > 0:
                raise ValueError(f"--repeat-by-label {self.repeat_by_label} must be positive")

    def options(self) -> dict[str, Any]:
        """What the output depends on (recorded in the plan; a rerun must match it)."""
        keep = asdict(self)
        for name in ("out", "overwrite", "shards", "run"):
            keep.pop(name)
        keep["subsets"] = sorted(self.subsets)
        return keep


# ------------------------------------------------------------------------------ pure helpers


def uid_array(uids: list[str] | np.ndarray) -> np.ndarray:
    """128-bit hex uids -> DataComp's `u8,u8` records (high, low), unsorted.

    Args:
        uids: (N,) strings of 32 hex digits.

    Returns:
        (N,) array of dtype `UID_DTYPE`.
    """
    n = len(uids)
    raw = np.frombuffer(bytes.fromhex("".join(uids)), dtype=">u8").reshape(n, 2)  # (N, 2)
    out = np.empty(n, dtype=UID_DTYPE)
    out["f0"], out["f1"] = raw[:, 0], raw[:, 1]
    return out


def repeat_counts(labels: np.ndarray, repeat: float, rng: np.random.Generator) -> np.ndarray:
    """Stochastic rounding of repeat·label: floor, plus one with probability of the fraction.

    Args:
        labels: (N,) float soft labels in [0, 1].
        repeat: R > 0.
        rng: the draws (one uniform per row, in row order).

    Returns:
        (N,) int64 counts whose expectation is R·label.
    """
    scaled = repeat * np.asarray(labels, dtype=np.float64)  # (N,)
    base = np.floor(scaled)
    return (base + (rng.random(scaled.shape[0]) < scaled - base)).astype(np.int64)


def output_ranges(
    parts: list[tuple[str, list[int]]], samples_per_shard: int
) -> list[tuple[int, list[tuple[str, int, int]]]]:
    """Split the concatenated parts into output shards of `samples_per_shard` samples.

    Args:
        parts: [(part name, byte offsets of its samples then its size)] in output order.
        samples_per_shard: samples per output shard (the last one holds the rest).

    Returns:
        Per output shard: (sample count, [(part name, first byte, end byte)]).
    """
    shards: list[tuple[int, list[tuple[str, int, int]]]] = []
    count, ranges = 0, []
    for name, offsets in parts:
        i, n = 0, len(offsets) - 1
        while i < n:
            take = min(samples_per_shard - count, n - i)
            ranges.append((name, offsets[i], offsets[i + take]))
            count, i = count + take, i + take
            if count == samples_per_shard:
                shards.append((count, ranges))
                count, ranges = 0, []
    if count:
        shards.append((count, ranges))
    return shards


def shard_names(n: int) -> list[str]:
    """Output shard names: 5 digits (img2dataset's default), more when needed."""
    width = max(5, len(str(max(n - 1, 0))))
    return [f"{i:0{width}d}" for i in range(n)]


# ------------------------------------------------------------------------------ driver


def _label_files(run: str) -> dict[str, str]:
    """{shard: label table path} of the published tables under `run` (read_labels' rules: the
    current generation of labels/, resolved once)."""
    from pipeline.clients.read import label_files

    return label_files(run)


def _file_info(path: str) -> dict[str, Any]:
    """Rows, schema version, job hash and source tar of one label table (footer only)."""
    from pipeline.io.labels import read_label_footer
    from pipeline.io.paths import filesystem

    fs, fs_path = filesystem(path)
    footer = read_label_footer(fs, fs_path)
    return {
        "rows": footer.rows,
        "schema": footer.schema_name,
        "job_hash": footer.metadata.get("ncl.job_hash"),
        "shard_path": footer.shard_path,
    }


def _tar_paths(spec: ExportSpec, infos: dict[str, dict]) -> dict[str, str]:
    from pipeline.io.shards import expand_shard_patterns, shard_name

    if spec.shards:
        given = {shard_name(p): p for p in expand_shard_patterns(list(spec.shards))}
    else:
        given = {s: i["shard_path"] for s, i in infos.items() if i["shard_path"]}
    missing = sorted(s for s in infos if s not in given)
    if missing:
        raise ExportConflictError(
            f"no input tar for shards {missing[:5]} (the label tables name none): pass --shards"
        )
    return {s: given[s] for s in infos}


def _prepare_out(spec: ExportSpec, plan: dict[str, Any]) -> bool:
    """Make `spec.out` ready; True when it already holds this plan's finished export."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(spec.out)
    entries = [os.path.basename(p.rstrip("/")) for p in fs.ls(root)] if fs.isdir(root) else []
    if entries:
        previous = read_json(f"{spec.out}/{PLAN_NAME}")
        if previous == plan and not spec.overwrite:
            return read_json(f"{spec.out}/{SUMMARY_NAME}") is not None
        if not spec.overwrite:
            raise ExportConflictError(
                f"{spec.out} is not empty and holds no unfinished export of this run with these "
                "options; pass --overwrite to replace a previous export, or another --out"
            )
        foreign = sorted(e for e in entries if not _OURS.match(e))
        if foreign:
            raise ExportConflictError(
                f"{spec.out} holds files an export did not write ({', '.join(foreign[:5])}); "
                "refusing to overwrite it: choose an empty --out"
            )
        for entry in entries:
            fs.rm(f"{root}/{entry}", recursive=True)
    fs.makedirs(root, exist_ok=True)
    write_json_atomic(plan, f"{spec.out}/{PLAN_NAME}")
    return False


def export_run(
    spec: ExportSpec, *, address: str | None = None, num_cpus: int | None = None
) -> dict[str, Any]:
    """Export the kept pairs of `spec.run` to `spec.out` (see the module contract).

    Args:
        spec: what and how.
        address: Ray cluster for `wds` (None: a local, loopback-only Ray, or the current one).
        num_cpus: CPUs of that local Ray.

    Returns:
        The summary written to `<out>/_export.json`: format, kept, labelled, share, per-subset
        counts, output files; `skipped` is True when the export was already complete.

    Raises:
        pipeline.clients.read.LabelTableError: no label tables under `spec.run`.
        ExportConflictError: `spec.out` holds something else (see the module contract).
    """
    files = _label_files(spec.run)
    infos = {shard: _file_info(path) for shard, path in files.items()}
    unknown = {i["schema"] for i in infos.values()} - set(READABLE_SCHEMA_NAMES)
    if unknown:
        from pipeline.clients.read import LabelTableError

        raise LabelTableError(f"{spec.run}: not label tables (ncl.schema={sorted(unknown)})")
    plan = {
        "format": spec.format,
        "options": spec.options(),
        "labels": {s: {k: i[k] for k in ("rows", "schema", "job_hash")} for s, i in infos.items()},
    }
    if _prepare_out(spec, plan):
        logger.info("export: %s already holds this export, nothing to do", spec.out)
        summary = read_json(f"{spec.out}/{SUMMARY_NAME}")
        assert summary is not None  # _prepare_out just read it
        return {**summary, "skipped": True}
    if any(i["schema"] == "labels.v1" for i in infos.values()):
        logger.warning("export: labels.v1 tables carry no uid; using sha256(key)'s first 128 bits")
    labelled = sum(i["rows"] for i in infos.values())
    cut = None if spec.keep_fraction is None else rank_cut(files, spec.rank_by, spec.keep_fraction)
    if spec.format == "wds":
        result = _export_wds(spec, files, _tar_paths(spec, infos), address, num_cpus, cut)
    elif spec.format == "uid":
        result = _export_uid(spec, files, cut)
    else:
        result = _export_keys(spec, files, cut)
    if cut is not None:
        result["cut"] = {"rank_by": cut.rank_by, "score": cut.score, "key": cut.key}
    summary = {
        "format": spec.format,
        "run": spec.run,
        "out": spec.out,
        "options": spec.options(),
        "labelled": labelled,
        "share": result["kept"] / labelled if labelled else 0.0,
        **result,
    }
    write_json_atomic(summary, f"{spec.out}/{SUMMARY_NAME}")
    if spec.format == "wds":
        import fsspec

        fs, root = fsspec.core.url_to_fs(spec.out)
        if fs.exists(f"{root}/{PARTS}"):
            fs.rm(f"{root}/{PARTS}", recursive=True)  # after the summary: a kill here is harmless
    return {**summary, "skipped": False}


def rank_cut(files: dict[str, str], rank_by: str, fraction: float) -> RankCut:
    """The last pair `--keep-fraction` keeps: the `kept_count`-th of all N labelled pairs
    ranked by `rank_by` (larger first; ties: smaller key first; a null or NaN score is never
    kept). Reads the ranked column(s) of every table once (4 bytes a pair and column on the
    driver), then the keys of the tables that hold a pair at the cut's score only."""
    shards = sorted(files)
    columns = FUSED_COLUMNS if rank_by == "fusion" else (rank_by,)
    tables = [open_label_table(files[s], list(columns)) for s in shards]
    read: dict[str, np.ndarray] = {
        c: np.concatenate([t.column(c).to_numpy(zero_copy_only=False) for t in tables]).astype(
            np.float32
        )
        if tables
        else np.empty(0, np.float32)
        for c in columns
    }
    if rank_by == "fusion":
        grids = tuple((c, rank_grid(v)) for c, v in read.items())
        every = fused_rank([(read[c], grid) for c, grid in grids]).astype(np.float64)
        every[every < 0] = np.nan
    else:
        grids, every = (), read[rank_by]
    valid = every[~np.isnan(every)]
    keep = min(kept_count(fraction, len(every)), len(valid))
    if keep == 0:
        return RankCut(rank_by, float("inf"), "", grids)  # nothing ranks above +inf
    score = float(np.partition(valid, len(valid) - keep)[len(valid) - keep])  # keep-th largest
    needed = keep - int((valid > score).sum())
    # The tied rows by position: table i holds rows offsets[i]..offsets[i+1].
    offsets = np.cumsum([0, *(t.num_rows for t in tables)])
    at = np.flatnonzero(every == score)
    owner = np.searchsorted(offsets, at, side="right") - 1
    tied = sorted(
        key
        for i in np.unique(owner)
        for key in open_label_table(files[shards[i]], ["key"])
        .column("key")
        .take(pa.array(at[owner == i] - offsets[i]))
        .to_pylist()
    )
    return RankCut(rank_by, score, tied[needed - 1], grids)


def _export_wds(
    spec: ExportSpec,
    files: dict[str, str],
    tars: dict[str, str],
    address: str | None,
    num_cpus: int | None,
    cut: RankCut | None,
) -> dict[str, Any]:
    import ray

    from pipeline.runtime.progress import Progress, as_completed
    from pipeline.runtime.ray import init_ray
    from pipeline.stages.export.tasks import assemble_output_shard, write_shard_part

    init_ray(address, num_cpus)
    part_task = ray.remote(write_shard_part).options(**TASK_OPTIONS)
    shards = sorted(files)
    refs = [
        part_task.remote(s, tars[s], files[s], spec.out, spec.min_label, tuple(spec.subsets), cut)
        for s in shards
    ]
    parts: list = [None] * len(refs)
    with Progress("export: read input shards", len(refs), "shards", log=logger) as progress:
        for index, part in as_completed(refs):
            parts[index] = part
            progress.advance()
    plan = output_ranges([(p["shard"], p["offsets"]) for p in parts], spec.samples_per_shard)
    names = shard_names(len(plan))
    join_task = ray.remote(assemble_output_shard).options(**TASK_OPTIONS)
    refs = [
        join_task.remote(name, ranges, n, spec.out)
        for name, (n, ranges) in zip(names, plan, strict=True)
    ]
    with Progress("export: write output shards", len(refs), "shards", log=logger) as progress:
        for _ in as_completed(refs):
            progress.advance()
    sizes = {f"{name}.tar": n for name, (n, _) in zip(names, plan, strict=True)}
    write_json_atomic(sizes, f"{spec.out}/sizes.json")
    return {
        "kept": sum(p["count"] for p in parts),
        "subsets": {s: sum(p["subsets"][s] for p in parts) for s in SUBSET_VALUES},
        "shards": len(names),
        "files": [f"{name}.tar" for name in names],
        "pattern": _brace_pattern(spec.out, names),
    }


def _brace_pattern(out: str, names: list[str]) -> str | None:
    if not names:
        return None
    if len(names) == 1:
        return f"{out}/{names[0]}.tar"
    return f"{out}/{{{names[0]}..{names[-1]}}}.tar"


def _kept_batches(spec: ExportSpec, files: dict[str, str], cut: RankCut | None):
    """(shard, kept table) per label table, in shard order, with uid filled for v1 tables."""
    columns = ["key", "shard", "soft_label", "subset", "round", "uid"]
    for shard in sorted(files):
        yield shard, read_kept(files[shard], columns, spec.min_label, tuple(spec.subsets), cut)


def _subset_counts(table: pa.Table) -> dict[str, int]:
    values = table.column("subset").cast(pa.string()).to_pylist()
    return {s: values.count(s) for s in SUBSET_VALUES}


def _export_uid(spec: ExportSpec, files: dict[str, str], cut: RankCut | None) -> dict[str, Any]:
    kept, entries = 0, 0
    subsets = dict.fromkeys(SUBSET_VALUES, 0)
    chunks = []
    for shard, table in _kept_batches(spec, files, cut):
        kept += table.num_rows
        for name, n in _subset_counts(table).items():
            subsets[name] += n
        uids = uid_array(table.column("uid").to_pylist())
        if spec.repeat_by_label is not None:
            # Seeded per shard, so the file does not depend on the order shards are read in.
            rng = np.random.default_rng([spec.seed, zlib.crc32(shard.encode())])
            labels = table.column("soft_label").to_numpy()
            uids = np.repeat(uids, repeat_counts(labels, spec.repeat_by_label, rng))
        entries += len(uids)
        chunks.append(uids)
    array = np.concatenate(chunks) if chunks else np.empty(0, UID_DTYPE)
    array = np.sort(array, order=["f0", "f1"])  # DataComp's resharder searches it
    with open_atomic(f"{spec.out}/uids.npy") as handle:
        np.save(handle, array)
    return {"kept": kept, "entries": entries, "subsets": subsets, "files": ["uids.npy"]}


def _export_keys(spec: ExportSpec, files: dict[str, str], cut: RankCut | None) -> dict[str, Any]:
    import pyarrow.parquet as pq

    kept = 0
    subsets = dict.fromkeys(SUBSET_VALUES, 0)
    with (
        open_atomic(f"{spec.out}/keys.parquet") as handle,
        pq.ParquetWriter(handle, KEYS_SCHEMA, compression="zstd") as writer,
    ):
        for _, table in _kept_batches(spec, files, cut):
            kept += table.num_rows
            for name, n in _subset_counts(table).items():
                subsets[name] += n
            table = table.set_column(3, "subset", table.column("subset").cast(pa.string()))
            writer.write_table(table.cast(KEYS_SCHEMA))
    return {"kept": kept, "subsets": subsets, "files": ["keys.parquet"]}


def open_clip_command(summary: dict[str, Any], model: str = "ViT-B-32") -> str:
    """The open_clip command line that trains on a `wds` export.

    It runs open_clip's own trainer through `pipeline.clients.open_clip`, which registers this
    package's model configs (e.g. ncl-tiny) and fixes open_clip_train's known incompatibility
    with current webdataset releases (see that module); the arguments are open_clip_train's.
    """
    workers = max(1, min(4, summary.get("shards") or 1))  # open_clip: shards >= workers
    return (
        f"python -m pipeline.clients.open_clip --train-data '{summary['pattern']}' "
        f"--dataset-type webdataset --model {model} --batch-size 256 --epochs 1 "
        f"--workers {workers}"
    )


def format_summary(summary: dict[str, Any], model: str | None = None) -> str:
    """Human-readable lines of an export summary (what the CLI prints)."""
    subsets = ", ".join(f"{k} {v}" for k, v in summary["subsets"].items() if v)
    lines = [
        f"kept {summary['kept']} of {summary['labelled']} labelled pairs "
        f"({100 * summary['share']:.1f}%): {subsets or 'none'}",
    ]
    if summary.get("skipped"):
        lines.append(f"{summary['out']} already held this export: nothing to do")
    if summary["format"] == "wds":
        lines.append(f"wrote {summary['shards']} shards: {summary['pattern']}")
        if summary["pattern"]:
            lines.append("train with open_clip:")
            lines.append("  " + open_clip_command(summary, model or "ViT-B-32"))
    elif summary["format"] == "uid":
        lines.append(
            f"wrote {summary['out']}/uids.npy: {summary['entries']} uids (sorted u8,u8), "
            "for DataComp's resharder --subset-file"
        )
    else:
        lines.append(f"wrote {summary['out']}/keys.parquet")
    return "\n".join(lines)


def run_model_name(run: str) -> str | None:
    """The run's model name from its manifest.json, when there is one."""
    manifest = read_json(f"{run.rstrip('/')}/{MANIFEST_NAME}") or {}
    return ((manifest.get("job") or {}).get("model") or {}).get("name")
