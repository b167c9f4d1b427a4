"""Export stage (Ray part of `pipeline.stages.export.driver`): kept pairs of the input tars ->
webdataset shards (docs/architecture.md §4.10).

Contract:
- `write_shard_part(shard, ...)`: one task per input shard; streams the tar once with the safe
  reader and appends each kept sample's members, as raw tar blocks, to
  `<out>/_parts/<shard>.tarpart` (image and text bytes unchanged, the json extended);
  `<out>/_parts/<shard>.json`, written last, is the part's completion marker.
- `assemble_output_shard(name, ranges, ...)`: one task per output shard; concatenates its byte
  ranges of the parts plus the end-of-archive marker into `<out>/<name>.tar` (atomically), then
  `<name>_stats.json`.
- Both are idempotent: a rerun skips work whose output exists.
"""

from __future__ import annotations

import json
import logging
import tarfile
from typing import Any

from pipeline.errors import RunFailedError
from pipeline.io.labels import SUBSET_VALUES, RankCut, read_kept
from pipeline.io.shards import RawRecord, iter_shard_records, split_source
from pipeline.io.tables import file_exists, open_atomic, read_json, write_json_atomic

__all__ = [
    "BLOCK",
    "END_OF_ARCHIVE",
    "ExportError",
    "assemble_output_shard",
    "member_bytes",
    "write_shard_part",
]

logger = logging.getLogger(__name__)

BLOCK = tarfile.BLOCKSIZE  # 512
# Two zero blocks end a tar; pad to tarfile's record size like tarfile.TarFile.close does.
END_OF_ARCHIVE = b"\0" * tarfile.RECORDSIZE
LABEL_COLUMNS = ["key", "soft_label", "subset", "round", "uid"]


class ExportError(RunFailedError):
    """The input tars and the label tables disagree (a kept key is not in its tar): the
    export failed (exit 1), as a stage of a run does."""


def member_bytes(name: str, data: bytes) -> bytes:
    """One tar member as raw blocks: header (PAX for long names) + data + zero padding.

    Fixed metadata (mtime 0, mode 0444, uid/gid 0) so the same export gives identical bytes.
    """
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    header = info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")
    padding = (-len(data)) % BLOCK
    return header + data + b"\0" * padding


def _extended_json(record: RawRecord, label: dict[str, Any], qualified: bool) -> bytes:
    """The sample's json with the ncl_* fields (and a uid when it has none), as UTF-8;
    `qualified`: the tar is a source's (`input.sources`), whose keys are `<source>/<key>`."""
    meta: dict[str, Any] = {}
    if "json" in record.members:
        try:
            parsed = json.loads(record.members["json"])
        except ValueError:
            parsed = None
        # A json the embed pass could not parse would have quarantined the sample; guard anyway.
        meta = parsed if isinstance(parsed, dict) else {}
    if qualified or "key" not in meta:
        meta["key"] = record.key  # img2dataset's own key would name another source's pair
    meta.setdefault("uid", label["uid"])
    meta["ncl_soft_label"] = label["soft_label"]
    meta["ncl_subset"] = label["subset"]
    meta["ncl_round"] = label["round"]
    return json.dumps(meta, ensure_ascii=False).encode("utf-8")


def _read_kept(
    label_file: str, min_label: float, subsets: tuple[str, ...], cut: RankCut | None
) -> dict[str, dict]:
    """{key: {soft_label, subset, round, uid}} of the kept rows of one label table."""
    table = read_kept(label_file, LABEL_COLUMNS, min_label, subsets, cut)
    kept = {}
    columns = {name: table.column(name).to_pylist() for name in LABEL_COLUMNS}
    for key, label, subset, round_index, uid in zip(*columns.values(), strict=True):
        kept[key] = {"soft_label": label, "subset": subset, "round": round_index, "uid": uid}
    return kept


def write_shard_part(
    shard: str,
    tar_path: str,
    label_file: str,
    out: str,
    min_label: float,
    subsets: tuple[str, ...],
    cut: RankCut | None = None,
) -> dict[str, Any]:
    """Write `<out>/_parts/<shard>.tarpart` and its marker `<shard>.json` (skip if done).

    Args:
        shard: shard name (label file basename).
        tar_path: the input tar (local path or fsspec URL).
        label_file: the shard's published label table.
        out: export directory.
        min_label, subsets, cut: the keep rule (`read_kept`).

    Returns:
        The marker: {"shard", "count", "subsets": {name: n}, "offsets": [byte offset of each
        sample, then the part's size], "bytes"}.

    Raises:
        ExportError: a kept key was not found in the tar.
    """
    marker = f"{out}/_parts/{shard}.json"
    done = read_json(marker)
    if done is not None:
        return done
    kept = _read_kept(label_file, min_label, subsets, cut)
    offsets = [0]
    counts = dict.fromkeys(SUBSET_VALUES, 0)
    written: set[str] = set()
    qualified = split_source(tar_path)[0] is not None
    with open_atomic(f"{out}/_parts/{shard}.tarpart") as handle:
        for item in iter_shard_records(tar_path):
            if not isinstance(item, RawRecord) or item.key not in kept:
                continue
            label = kept[item.key]
            size = 0
            has_json = False
            for ext, data in item.members.items():
                if ext == "json":
                    data, has_json = _extended_json(item, label, qualified), True
                block = member_bytes(f"{item.key}.{ext}", data)
                handle.write(block)
                size += len(block)
            if not has_json:
                block = member_bytes(f"{item.key}.json", _extended_json(item, label, qualified))
                handle.write(block)
                size += len(block)
            offsets.append(offsets[-1] + size)
            counts[label["subset"]] += 1
            written.add(item.key)
    missing = len(kept) - len(written)
    if missing:
        example = next(k for k in kept if k not in written)
        raise ExportError(
            f"shard {shard}: {missing} kept keys (e.g. {example!r}) are not readable samples of "
            f"{tar_path}; the tar changed since the labels were made (rerun the pipeline)"
        )
    summary = {
        "shard": shard,
        "count": len(written),
        "subsets": counts,
        "offsets": offsets,
        "bytes": offsets[-1],
    }
    write_json_atomic(summary, marker)
    return summary


def assemble_output_shard(
    name: str, ranges: list[tuple[str, int, int]], count: int, out: str
) -> dict[str, Any]:
    """Concatenate byte ranges of parts into `<out>/<name>.tar` + `<name>_stats.json`.

    Args:
        name: output shard name, e.g. "00003".
        ranges: [(part shard, first byte, end byte)] in output order.
        count: samples in these ranges (recorded in the stats).
        out: export directory.

    Returns:
        {"name", "count", "bytes"}.
    """
    import fsspec

    tar = f"{out}/{name}.tar"
    stats = f"{out}/{name}_stats.json"
    if file_exists(tar) and file_exists(stats):
        return {"name": name, "count": count, "skipped": True}
    size = 0
    with open_atomic(tar) as handle:
        for part, start, end in ranges:
            with fsspec.open(f"{out}/_parts/{part}.tarpart", "rb") as source:
                source.seek(start)
                remaining = end - start
                while remaining:  # 8 MiB chunks: a part can be GBs
                    chunk = source.read(min(remaining, 8 << 20))
                    if not chunk:
                        raise ExportError(f"part {part} is shorter than its marker says")
                    handle.write(chunk)
                    remaining -= len(chunk)
            size += end - start
        handle.write(END_OF_ARCHIVE)
    write_json_atomic(
        {
            "count": count,
            "successes": count,
            "failed_to_download": 0,
            "failed_to_resize": 0,
            "status_dict": {"success": count},
        },
        stats,
    )
    return {"name": name, "count": count, "bytes": size + len(END_OF_ARCHIVE)}
