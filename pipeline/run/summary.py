"""The run's console summaries: the embed pass, the warm-up, each co-teaching round, the
co-teaching table (logged by the stage kinds, `pipeline.run.kinds`)."""

from __future__ import annotations

import logging
from typing import Any

from pipeline.config import JobConfig
from pipeline.io.layout import RunLayout

__all__ = [
    "coteaching_table",
    "log_coteaching",
    "log_embed_summary",
    "log_round",
    "log_warmup",
]

logger = logging.getLogger(__name__)


def log_round(summary: dict) -> None:
    retrieval = summary.get("retrieval") or {}
    shown = ", ".join(f"{name} {r['rsum']:.1f}" for name, r in retrieval.items())
    views = []
    for view, info in summary["views"].items():
        if not info["history"]:
            continue
        last = info["history"][-1]
        proxies = f", {last['proxy_pairs']} proxy pairs" if last.get("proxy_pairs") else ""
        views.append(
            f"{view} InfoNCE over all pairs unweighted {last['loss']:.3f}, mean pair weight "
            f"{last.get('mean_weight', float('nan')):.2f}{proxies}"
        )
    logger.info(
        f"co-teaching round {summary['round']} (last epoch): {'; '.join(views)}"
        + (f"; held-out rSum {shown}" if shown else "")
    )


def log_coteaching(rows: list[dict], job: JobConfig) -> None:
    def cell(value) -> str:
        return "    -" if value is None else f"{value:5.3f}"

    def rsum(value) -> str:
        return "     -" if value is None else f"{value:6.1f}"

    lines = [
        "",
        f"co-teaching ({job.train.mode}, labels {job.labels.method}): label AUROC per view and "
        "held-out rSum per model generation",
        "  models               AUROC a  AUROC b    rSum A  rSum B  rSum A+B",
    ]
    for row in rows:
        name = "warmed up" if row["models"] == 0 else f"after round {row['models']}"
        lines.append(
            f"  {name:<20} {cell(row['auroc_a'])}    {cell(row['auroc_b'])}   "
            f"{rsum(row['rsum_A'])}  {rsum(row['rsum_B'])}  {rsum(row['rsum_A+B'])}"
        )
    if rows and rows[-1].get("auroc_combined") is not None:
        lines.append(
            f"  published labels (mean of a and b): AUROC {rows[-1]['auroc_combined']:.3f}"
        )
    logger.info("\n".join(lines))


def log_warmup(summary: dict) -> None:
    lines = ["", "warm-up"]
    for view, info in summary["views"].items():
        last = info["history"][-1] if info["history"] else {}
        reason = (info.get("warmup") or {}).get("reason", "")
        lines.append(
            f"  model {view}: {info['epochs']} epochs, {info['steps']} steps, last epoch's mean "
            f"InfoNCE {last.get('loss', float('nan')):.3f}; kept epoch {info['kept_epoch']} "
            f"({reason})"
        )
    retrieval = summary.get("retrieval")
    if retrieval:
        lines.append(
            "  retrieval on the test split (R@1/R@5/R@10 image->text | text->image, rSum):"
        )
        for name, r in retrieval.items():
            lines.append(
                f"    {name:>4}: {r['i2t_r1']:.1f}/{r['i2t_r5']:.1f}/{r['i2t_r10']:.1f} | "
                f"{r['t2i_r1']:.1f}/{r['t2i_r5']:.1f}/{r['t2i_r10']:.1f}, rSum {r['rsum']:.1f}"
            )
    logger.info("\n".join(lines))


def log_embed_summary(embed: dict, layout: RunLayout) -> None:
    reasons = ", ".join(f"{k}: {v}" for k, v in embed["quarantined_by_reason"].items()) or "none"
    rate = embed["pairs_per_second"]
    lines = [
        "",
        "summary",
        f"  shards:       {embed['shards']} ({embed['shards_skipped']} already complete)",
        f"  samples read: {embed['records_read']} (this run)",
        f"  embedded:     {embed['embedded']}",
        f"  quarantined:  {embed['quarantined']} ({reasons})",
    ]
    if embed["ignored_members"]:
        ignored = ", ".join(f".{k}: {v}" for k, v in embed["ignored_members"].items())
        lines.append(f"  ignored tar members (never decoded): {ignored}")
    if rate:
        lines.append(f"  throughput:   {rate:.0f} pairs/s over {embed['seconds']:.1f}s")
    for broken in embed["shards_truncated"]:
        lines.append(
            f"  TRUNCATED shard {broken['path']}: {broken['error']} (samples before the break kept)"
        )
    for failure in embed["shards_failed"]:
        lines.append(f"  FAILED shard {failure['path']}: {failure['error']} (rerun to retry)")
    lines.append(
        f"  outputs:      {layout.embeddings_dir(0)}/, {layout.quarantine_dir}/, {layout.metrics}"
    )
    logger.info("\n".join(lines))


def coteaching_table(job: JobConfig, rounds: dict, published: dict) -> list[dict]:
    """One row per model generation g (0 = warmed up, g = after co-teaching round g): its
    held-out retrieval and the quality of the labels it estimated (round g + 1's passes)."""
    method = job.labels.method
    rows = []
    for generation in range(job.train.rounds + 1):
        trained = rounds.get(str(generation), {})
        labelled = rounds.get(str(generation + 1), {})
        row: dict[str, Any] = {"models": generation, "labels_round": generation + 1}
        for view in ("a", "b"):
            quality = ((labelled.get(f"labels_{view}") or {}).get("quality") or {}).get(method)
            row[f"auroc_{view}"] = quality and quality.get("auroc")
            row[f"spearman_{view}"] = quality and quality.get("spearman")
        retrieval = trained.get("retrieval") or {}
        for name in ("A", "B", "A+B"):
            row[f"rsum_{name}"] = (retrieval.get(name) or {}).get("rsum")
        rows.append(row)
    combined = (published.get("quality") or {}).get("combined")
    if rows and combined:
        rows[-1]["auroc_combined"] = combined.get("auroc")
        rows[-1]["spearman_combined"] = combined.get("spearman")
    return rows
