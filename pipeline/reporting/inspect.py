"""`ncl-pipeline inspect RUN`: a plain-text summary of a run's label tables and quarantine.

Contract: `inspect_run(path)` reads only the label tables (via `pipeline.clients.read.read_labels`:
the subset and soft_label columns plus the file metadata), the label pass summary beside them
when present, and `quarantine/`; it writes nothing and returns the text.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from pipeline.io.labels import SUBSET_VALUES
from pipeline.io.layout import LABEL_PASS_SUMMARY, run_dir_of

__all__ = ["inspect_run", "quarantine_lines"]

QUANTILES = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def _fit_line(name: str, fit: dict[str, Any]) -> str:
    """One fit as the report shows it (`MixtureFit.describe`), plus how EM ended."""
    from pipeline.core.mixture.fit import MixtureFit

    mixture = MixtureFit.from_dict(fit)
    if mixture.no_spread:
        return f"  {name:<8} {mixture.describe()}"
    flags = [flag for flag in ("converged", "collapsed") if getattr(mixture, flag)]
    text = f"  {name:<8} {mixture.describe()} | {mixture.iterations} it"
    return text + (f" ({', '.join(flags)})" if flags else "")


def quarantine_lines(run_dir: str) -> list[str]:
    """One line: the quarantine's rows, files and count per reason (`quarantine/*.parquet`)."""
    import pyarrow.dataset as ds

    from pipeline.io.paths import arrow_filesystem, filesystem, parquet_files

    fs, root = filesystem(run_dir)
    files = parquet_files(fs, f"{root.rstrip('/')}/quarantine")
    if not files:
        return ["quarantine: none recorded"]
    table = ds.dataset(files, format="parquet", filesystem=arrow_filesystem(fs)).to_table(
        columns=["reason"]
    )
    reasons = table.column("reason").to_pylist()
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    detail = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    return [f"quarantine: {len(reasons)} rows in {len(files)} files ({detail})"]


# Soft labels lie in [0, 1]: quantiles from a fixed histogram are exact to 1e-4, in O(1)
# memory whatever the number of rows.
_QUANTILE_BINS = 10_000


def _stream_subsets(dataset) -> tuple[int, dict[str, int], dict[str, float], np.ndarray]:
    """(rows, rows per subset, soft_label sum per subset, soft_label histogram), batch by
    batch: the driver never holds a whole column."""
    import pyarrow.compute as pc

    n, counts, sums = 0, dict[str, int](), dict[str, float]()
    histogram = np.zeros(_QUANTILE_BINS, dtype=np.int64)
    for batch in dataset.to_batches(columns=["subset", "soft_label"]):
        soft = batch.column("soft_label").to_numpy(zero_copy_only=False).astype(np.float64)
        subset = batch.column("subset")
        for name in SUBSET_VALUES:
            mask = pc.equal(subset, name).to_numpy(zero_copy_only=False)
            counts[name] = counts.get(name, 0) + int(mask.sum())
            sums[name] = sums.get(name, 0.0) + float(np.nansum(soft[mask]))
        finite = soft[np.isfinite(soft)]  # a null label (one view missing) has no quantile
        bins = np.clip((finite * _QUANTILE_BINS).astype(np.int64), 0, _QUANTILE_BINS - 1)
        histogram += np.bincount(bins, minlength=_QUANTILE_BINS)
        n += batch.num_rows
    return n, counts, sums, histogram


def _histogram_quantiles(histogram: np.ndarray, quantiles) -> list[float]:
    """Quantiles of values in [0, 1] from their histogram (bin centres; min and max at the
    first and last non-empty bins)."""
    cumulative = np.cumsum(histogram)
    total = cumulative[-1]
    if total == 0:
        return [float("nan")] * len(quantiles)
    out = []
    for q in quantiles:
        index = int(np.searchsorted(cumulative, max(1, int(np.ceil(q * total))), side="left"))
        out.append((min(index, histogram.size - 1) + 0.5) / histogram.size)
    return out


def inspect_run(path: str | os.PathLike, *, view: str | None = None) -> str:
    """Counts per subset, soft-label quantiles, mixture fits and the quarantine summary.

    Args:
        path: run directory (or a label folder / round directory, see `read_labels`).
        view: which `labels_<view>` of a round directory.

    Returns:
        The report as text (lines joined by newlines).

    Raises:
        pipeline.clients.read.LabelTableError: no label tables under `path`.
    """
    from pipeline.clients.read import label_table_metadata, labels_folder_url, read_labels
    from pipeline.io.tables import read_json

    dataset = read_labels(path, view=view)
    folder = labels_folder_url(path, view)
    meta = label_table_metadata(dataset)
    n, counts, sums, histogram = _stream_subsets(dataset)
    lines = [
        f"labels: {n} rows in {len(dataset.files)} files under {folder}",
        f"  schema {meta.get('ncl.schema')}, method {meta.get('ncl.method', '?')}, round "
        f"{meta.get('ncl.round', '?')}, view {meta.get('ncl.view', '?')}, loss "
        f"{meta.get('ncl.loss', '?')}, model {meta.get('ncl.model_id')}, "
        f"job {meta.get('ncl.job_hash')}",
    ]
    lines.append("subsets:")
    for name in SUBSET_VALUES:
        count = counts.get(name, 0)
        mean = f", mean soft_label {sums[name] / count:.3f}" if count else ""
        lines.append(f"  {name:<12} {count:>9} ({100.0 * count / max(n, 1):5.1f} %){mean}")
    if n:
        values = _histogram_quantiles(histogram, QUANTILES)
        lines.append(
            "soft_label quantiles: "
            + ", ".join(f"p{int(q * 100)} {v:.3f}" for q, v in zip(QUANTILES, values, strict=True))
        )
    mixture = json.loads(meta.get("ncl.mixture", "{}") or "{}")
    fits = mixture.get("fits", {})
    if fits:
        lines.append(
            f"mixture fits on {mixture.get('loss', '?')} (used: {mixture.get('kind', '?')}, "
            f"threshold {mixture.get('threshold', '?')}):"
        )
        lines += [_fit_line(name, fit) for name, fit in fits.items()]
    summary = read_json(f"{folder}/{LABEL_PASS_SUMMARY}")
    if summary:
        partition = summary.get("partition") or {}
        for name, flags in partition.items():
            lines.append(f"partition {name}: {json.dumps(flags, sort_keys=True)}")
        quality = summary.get("quality")
        if quality:
            lines.append(
                "label quality (AUROC clean vs mismatched / Spearman / precision / recall):"
            )
            for name, q in quality.items():
                cells = [q.get(key) for key in ("auroc", "spearman", "precision", "recall")]
                text = " / ".join("-" if c is None else f"{c:.3f}" for c in cells)
                lines.append(f"  {name:<18} {text}")
    run_dir = run_dir_of(folder)
    lines += quarantine_lines(run_dir)
    return "\n".join(lines)
