"""The report's story of a run, from `metrics.json`: the summary at the top of the page, the
table and figure of label quality and retrieval per co-teaching round, the mixture fits and the
share of pairs per subset of every label pass (`pipeline.reporting.report` lays them out)."""

from __future__ import annotations

import html
from typing import Any

from pipeline.io.labels import SUBSET_VALUES

__all__ = ["rounds_figure", "story_html", "summary_html"]


def _fmt(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _share(subsets: dict | None) -> str:
    if not subsets:
        return "–"
    total = sum(subsets.values()) or 1
    return " / ".join(f"{100 * subsets.get(name, 0) / total:.0f}%" for name in SUBSET_VALUES)


def _fit_text(fit: dict | None) -> str:
    """A label pass's mixture fit summary as `ncl-pipeline inspect` prints it
    (`MixtureFit.describe`: component means in loss units)."""
    from pipeline.core.mixture.fit import MixtureFit

    return MixtureFit.from_dict(fit).describe() if fit else "–"


def summary_html(metrics: dict | None, meta: dict[str, str], manifest: dict | None) -> str:
    """The first block: what ran and what came out, as a short definition list."""
    metrics, manifest = metrics or {}, manifest or {}
    job = manifest.get("job") or {}
    published = metrics.get("labels") or {}
    embed = ((metrics.get("rounds") or {}).get("0") or {}).get("embed") or {}
    rows: list[tuple[str, str]] = []
    if job:
        train = job.get("train") or {}
        rows.append(
            (
                "job",
                f"{job.get('name')}: model {job.get('model', {}).get('name')}, "
                f"{train.get('rounds')} co-teaching rounds, train.mode {train.get('mode')}",
            )
        )
    rows.append(
        (
            "labels",
            f"method {meta.get('ncl.method', '?')}, round {meta.get('ncl.round', '?')}, "
            f"view {meta.get('ncl.view', '?')}",
        )
    )
    if embed:
        rows.append(
            (
                "pairs",
                f"{embed.get('embedded', 0):,} labelled, {embed.get('quarantined', 0):,} "
                "quarantined (unusable samples, each with its reason)",
            )
        )
    if published.get("subsets"):
        counts = ", ".join(f"{k} {v:,}" for k, v in published["subsets"].items())
        rows.append(
            ("subsets", f"{counts} (clean / quasi-clean / noisy: {_share(published['subsets'])})")
        )
    combined = ((published.get("quality") or {}).get("combined")) or {}
    if combined.get("auroc") is not None:
        rows.append(
            (
                "label quality",
                f"AUROC {combined['auroc']:.3f} (clean vs mismatched pairs, ground truth), "
                f"Spearman {_fmt(combined.get('spearman'))}",
            )
        )
    table = metrics.get("coteaching") or []
    rows.extend(_label_free_rows(table[-1] if table else {}))
    if table and table[-1].get("rsum_A+B") is not None:
        first, last = table[0], table[-1]
        rows.append(
            (
                "retrieval",
                f"held-out rSum of the final models A+B {last['rsum_A+B']:.1f} "
                f"(warmed up: {_fmt(first.get('rsum_A+B'), 1)})",
            )
        )
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in rows)
    return f"<dl class=summary>{items}</dl>"


def _label_free_rows(last_row: dict) -> list[tuple[str, str]]:
    """The summary rows a run without ground truth has: the views' agreement, the change since
    the round before, the kept share and the validation rSum of the last round."""
    rows: list[tuple[str, str]] = []
    if last_row.get("views_spearman") is not None:
        kept = last_row.get("kept_fraction")
        change = last_row.get("changed_subset_share")
        text = (
            f"views a and b: Spearman {_fmt(last_row['views_spearman'])}, same subset "
            f"{_fmt(last_row.get('views_subset_agreement'))}"
        )
        if change is not None:
            text += f"; {100 * change:.1f}% changed subset since the round before"
        if kept is not None:
            text += f"; the export keeps {100 * kept:.1f}% at its defaults"
        rows.append(("agreement", text))
    vals = [last_row.get(f"val_rsum_{v}") for v in ("A", "B")]
    if any(v is not None for v in vals):
        rows.append(
            ("validation", f"rSum of the last models A / B {_fmt(vals[0], 1)} / {_fmt(vals[1], 1)}")
        )
    return rows


def story_html(metrics: dict | None) -> str:
    """Per round: label AUROC of each view, held-out rSum, subsets and mixture fits."""
    if not metrics or not metrics.get("coteaching"):
        return ""
    rounds = metrics.get("rounds") or {}
    body = []
    for row in metrics["coteaching"]:
        labelled = rounds.get(str(row["labels_round"])) or {}
        passes = {v: labelled.get(f"labels_{v}") or {} for v in ("a", "b")}
        kind = passes["a"].get("mixture_kind") or "gmm"
        models = "warmed up" if row["models"] == 0 else f"after round {row['models']}"
        cells = [
            models,
            str(row["labels_round"]),
            " / ".join(_fmt(row.get(f"val_rsum_{n}"), 1) for n in ("A", "B")),
            _fmt(row.get("kept_fraction")),
            f"{_fmt(row.get('views_spearman'))} / {_fmt(row.get('views_subset_agreement'))}",
            f"{_fmt(row.get('change_spearman'))} / {_fmt(row.get('changed_subset_share'))}",
            f"{_fmt(row.get('auroc_a'))} / {_fmt(row.get('auroc_b'))}",
            " / ".join(_fmt(row.get(f"rsum_{n}"), 1) for n in ("A", "B", "A+B")),
            _share(passes["a"].get("subsets")),
            _fit_text((passes["a"].get("mixture") or {}).get(kind)),
            _fit_text((passes["b"].get("mixture") or {}).get(kind)),
        ]
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    published = (((metrics.get("labels") or {}).get("quality") or {}).get("combined")) or {}
    note = (
        f"<p>The published labels (the mean of the last round's views a and b): AUROC "
        f"<b>{published['auroc']:.3f}</b>.</p>"
        if published.get("auroc") is not None
        else ""
    )
    return (
        "<h2>The run, round by round</h2>"
        "<p>Each generation of models labels the corpus (round r's label pass uses the models "
        "after round r&minus;1); each model then trains on the labels its peer estimated. "
        "Without ground truth: validation rSum (eval.val_shards) of the kept epoch, the share "
        "the export keeps at its defaults, the two views' agreement (Spearman of their labels, "
        "share in the same subset) and the change from the round before (Spearman, share that "
        "changed subset): labels that agree and settle are labels the run is sure of. With a "
        "ground truth and a test split: label AUROC (clean vs mismatched) and test rSum "
        "(R@1+5+10 both ways) of model A, B and their average. &ndash;: not measured.</p>"
        '<img src="rounds.png" alt="labels and retrieval per round">'
        "<table class=q><tr><th>models</th><th>labels of round</th><th>val rSum A / B</th>"
        "<th>kept</th><th>views: Spearman / same subset</th>"
        "<th>vs round before: Spearman / changed</th><th>label AUROC a / b</th>"
        "<th>test rSum A / B / A+B</th><th>subsets (view a) clean / quasi / noisy</th>"
        "<th>mixture fit a (loss means)</th><th>mixture fit b</th></tr>"
        + "".join(body)
        + "</table>"
        + note
    )


def _series(rows: list[dict], column: str) -> list[float]:
    return [float("nan") if row.get(column) is None else row[column] for row in rows]


def _has(rows: list[dict], *columns: str) -> bool:
    return any(row.get(c) is not None for row in rows for c in columns)


def rounds_figure(plt, metrics: dict | None) -> Any | None:
    """Per model generation, the panels the run has data for: the labels' agreement and
    stability (every run), retrieval rSum on the validation and test splits (when set), and
    label AUROC (with ground truth). None: nothing to plot."""
    rows = (metrics or {}).get("coteaching") or []
    panels = []
    if _has(rows, "views_spearman", "kept_fraction"):
        panels.append("labels")
    if _has(rows, "rsum_A+B", "val_rsum_A", "val_rsum_B"):
        panels.append("retrieval")
    if _has(rows, "auroc_a", "auroc_b"):
        panels.append("auroc")
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.4), squeeze=False)
    x = [row["models"] for row in rows]
    names = ["warmed up" if g == 0 else f"round {g}" for g in x]
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "labels":
            for column, style, label in (
                ("views_spearman", "-o", "views a, b: Spearman"),
                ("views_subset_agreement", "--s", "views a, b: same subset"),
                ("change_spearman", "-^", "vs the round before: Spearman"),
                ("kept_fraction", ":D", "kept (export defaults)"),
                ("noise_a", "-.x", "mixture noise rate (a)"),
            ):
                ax.plot(x, _series(rows, column), style, label=label)
            ax.set_ylim(0, 1.02)
            ax.set_title("labels (no ground truth needed)")
        elif panel == "retrieval":
            for column, style, label in (
                ("val_rsum_A", ":o", "validation A"),
                ("val_rsum_B", ":s", "validation B"),
                ("rsum_A", "-o", "test A"),
                ("rsum_B", "--s", "test B"),
                ("rsum_A+B", "-^", "test A+B"),
            ):
                if _has(rows, column):
                    ax.plot(x, _series(rows, column), style, label=label)
            ax.set_title("retrieval rSum")
        else:
            for view, style in (("a", "-o"), ("b", "--s")):
                ax.plot(x, _series(rows, f"auroc_{view}"), style, label=f"labels of view {view}")
            combined = rows[-1].get("auroc_combined")
            if combined is not None:
                ax.plot([x[-1]], [combined], "k*", ms=12, label="published (a+b)")
            ax.set_title("label AUROC (clean vs mismatched, ground truth)")
        ax.set_xticks(x, names)
        ax.set_xlabel("models")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
