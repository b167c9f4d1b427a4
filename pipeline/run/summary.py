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


def _cell(value, width: int = 5, digits: int = 3) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def log_coteaching(rows: list[dict], job: JobConfig) -> None:
    """The closing table: what every run can say of its rounds (validation rSum when
    eval.val_shards is set, kept share, the two views' agreement, the change from the round
    before, the mixtures' noise rate), then the ground-truth figures where there are any."""
    header = (
        ("val rSum A", 10, 1, "val_rsum_A"),
        ("B", 6, 1, "val_rsum_B"),
        ("kept", 6, 3, "kept_fraction"),
        ("clean", 6, 3, "clean"),
        ("quasi", 6, 3, "quasi_clean"),
        ("noisy", 6, 3, "noisy"),
        ("views rho", 10, 3, "views_spearman"),
        ("same subset", 12, 3, "views_subset_agreement"),
        ("changed", 8, 3, "changed_subset_share"),
        ("rho prev", 9, 3, "change_spearman"),
        ("noise a", 8, 3, "noise_a"),
        ("b", 6, 3, "noise_b"),
    )
    lines = [
        "",
        f"co-teaching ({job.train.mode}, labels {job.labels.method}): per model generation, "
        "its validation rSum and the labels it estimated (kept: the export's defaults)",
        "  " + f"{'models':<16}" + "".join(f" {title:>{width}}" for title, width, _, _ in header),
    ]
    for row in rows:
        name = "warmed up" if row["models"] == 0 else f"after round {row['models']}"
        values = {**row, **(row.get("subset_shares") or {})}
        cells = "".join(" " + _cell(values.get(k), w, d) for _, w, d, k in header)
        lines.append(f"  {name:<16}{cells}")
    last = rows[-1] if rows else {}
    if last.get("label_quantiles"):
        q = last["label_quantiles"]
        lines.append(
            "  published labels: quantiles p10 / p25 / p50 / p75 / p90 "
            + " / ".join(_cell(q.get(k), 1, 2) for k in ("p10", "p25", "p50", "p75", "p90"))
            + "; share per tenth of [0, 1]: "
            + " ".join(f"{v:.2f}" for v in last.get("label_distribution") or [])
        )
    truth = [
        k
        for k in ("auroc_a", "auroc_b", "rsum_A", "rsum_B", "rsum_A+B")
        if any(r.get(k) is not None for r in rows)
    ]
    if not truth:
        lines.append(
            "  no ground truth and no test split: label AUROC and test rSum are not shown "
            "(eval.ground_truth, eval.test_shards); `ncl-pipeline audit` estimates precision "
            "from a sample you judge"
        )
        logger.info("\n".join(lines))
        return
    lines += [
        "  with the ground truth (label AUROC per view) and the test split (rSum):",
        "  models               AUROC a  AUROC b    rSum A  rSum B  rSum A+B",
    ]
    for row in rows:
        name = "warmed up" if row["models"] == 0 else f"after round {row['models']}"
        lines.append(
            f"  {name:<20} {_cell(row['auroc_a'])}    {_cell(row['auroc_b'])}   "
            f"{_cell(row['rsum_A'], 6, 1)}  {_cell(row['rsum_B'], 6, 1)}  "
            f"{_cell(row['rsum_A+B'], 6, 1)}"
        )
    if last.get("auroc_combined") is not None:
        lines.append(f"  published labels (mean of a and b): AUROC {last['auroc_combined']:.3f}")
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


def _val_rsum(train: dict, view: str) -> float | None:
    """The validation rSum of a view's kept epoch (None without eval.val_shards)."""
    info = (train.get("views") or {}).get(view) or {}
    history, kept = info.get("history") or [], info.get("kept_epoch")
    if not history:
        return None
    record = history[kept - 1] if kept and 0 < kept <= len(history) else history[-1]
    return record.get("val_rsum")


def _noise_rate(labels: dict) -> float | None:
    """1 - the clean weight of the view's configured mixture (None: no label pass)."""
    from pipeline.core.mixture.fit import MixtureFit

    fit = (labels.get("mixture") or {}).get(labels.get("mixture_kind") or "")
    return None if fit is None else 1.0 - MixtureFit.from_dict(fit).clean_share()


DIAGNOSTIC_COLUMNS = (
    "kept_fraction",
    "subset_shares",
    "views_spearman",
    "views_subset_agreement",
    "change_spearman",
    "changed_subset_share",
    "label_distribution",
    "label_quantiles",
)


def coteaching_table(job: JobConfig, rounds: dict, published: dict) -> list[dict]:
    """One row per model generation g (0 = warmed up, g = after co-teaching round g): its
    validation and held-out retrieval, the label-free diagnostics of the labels it estimated
    (round g + 1's passes, `pipeline.stages.publish.diagnostics`) and, with ground truth, their
    quality."""
    method = job.labels.method
    diagnostics = published.get("diagnostics") or {}
    rows = []
    for generation in range(job.train.rounds + 1):
        trained = rounds.get(str(generation), {})
        labelled = rounds.get(str(generation + 1), {})
        row: dict[str, Any] = {"models": generation, "labels_round": generation + 1}
        for view in ("A", "B"):
            row[f"val_rsum_{view}"] = _val_rsum(trained.get("train") or {}, view)
        for view in ("a", "b"):
            labels = labelled.get(f"labels_{view}") or {}
            quality = (labels.get("quality") or {}).get(method)
            row[f"auroc_{view}"] = quality and quality.get("auroc")
            row[f"spearman_{view}"] = quality and quality.get("spearman")
            row[f"noise_{view}"] = _noise_rate(labels)
        found = diagnostics.get(str(generation + 1)) or {}
        row.update({name: found.get(name) for name in DIAGNOSTIC_COLUMNS})
        retrieval = trained.get("retrieval") or {}
        for name in ("A", "B", "A+B"):
            row[f"rsum_{name}"] = (retrieval.get(name) or {}).get("rsum")
        rows.append(row)
    combined = (published.get("quality") or {}).get("combined")
    if rows and combined:
        rows[-1]["auroc_combined"] = combined.get("auroc")
        rows[-1]["spearman_combined"] = combined.get("spearman")
    return rows
