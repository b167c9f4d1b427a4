"""`ncl-pipeline report RUN`: `<run>/report/index.html` with PNG figures (matplotlib, Agg).

Contract: `write_report(run_dir)` reads the label tables (`pipeline.clients.read.read_labels`),
their metadata (mixture fits, source shard paths), the label pass summary and, when available, the
ground truth; it writes only under `<run>/report/`:
- `loss_mixture.png`: histogram of the normalised losses with the fitted BMM and GMM densities
  (each component and the sum) and the clean/noisy threshold of each (BiCro Fig. 4 style);
- `soft_labels.png`: soft_label and clean_prob histograms split by the true kind (clean /
  partial / mismatched) when ground truth exists, else by subset;
- `rounds.png` and the run's story (`pipeline.reporting.story`, from metrics.json): label AUROC
  and held-out rSum per round, mixture fits and the share of pairs per subset of every pass;
- `thumbs/*.png` + three galleries that help judge the labels: the borderline pairs around the
  clean/noisy cut, the pairs called clean with the lowest cosine, and those called noisy with
  the highest cosine; each with thumbnail (read from the source tar named in the table
  metadata), caption, label, subset, true kind (with ground truth) and the method's own
  evidence (`LabelMethod.evidence`: BiCro's anchors, SPS's reliable pairs, assign's best
  competitors, RCR's retrieved captions (`pipeline.reporting.evidence`); no column for cosine);
- `galleries.parquet`: the galleries' pairs and a seeded uniform sample (`gallery_schema`);
- `index.html` tying them together under a short summary and the quality table.
"""

from __future__ import annotations

import html
import io
import os
import re
from typing import Any

import numpy as np

from pipeline.io.labels import SUBSET_VALUES
from pipeline.io.layout import LABEL_PASS_SUMMARY, MANIFEST_NAME

__all__ = ["label_shard_paths", "write_report", "write_thumbnails"]

GALLERY_SIZE = 12  # pairs per gallery
# galleries.parquet also holds this many pairs drawn uniformly (seeded): a sample a person can
# hand-label to estimate the precision of the clean subset (docs/cc3m.md §4).
RANDOM_SAMPLE = 200
# Figures and galleries read at most this many rows (an even sample beyond it); the counts in
# the summary come from the label pass and stay exact.
REPORT_MAX_ROWS = 1_000_000
THUMB_SIZE = 112
SIDES = ("by image: ", "by text: ")  # the anchor-key columns' prefixes in the evidence column
RETRIEVED_PREFIX = "none recorded; its image retrieves "  # a row without recorded evidence
KIND_COLOURS = {"clean": "tab:green", "partial": "tab:orange", "mismatched": "tab:red"}
SUBSET_COLOURS = dict(zip(SUBSET_VALUES, ("tab:green", "tab:orange", "tab:red"), strict=True))


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("the report needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, fs, path: str) -> None:
    """Write `fig` as a PNG at `path`, then close it (pyplot keeps every open figure)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    with fs.open(path, "wb") as handle:
        handle.write(buffer.getvalue())
    _pyplot().close(fig)


def _threshold_x(fit, threshold: float) -> float | None:
    """Normalised loss where the clean posterior first drops to `threshold` (None: never)."""
    from pipeline.core.mixture.fit import clean_posterior

    grid = np.linspace(0.0, 1.0, 4097)
    prob = clean_posterior(fit, fit.lo + grid * (fit.hi - fit.lo))
    below = np.flatnonzero(prob <= threshold)
    return float(grid[below[0]]) if below.size else None


def _densities(fit, x: np.ndarray) -> list[np.ndarray]:
    from scipy.stats import beta, norm

    parts = []
    for k in range(2):
        if fit.kind == "bmm":
            pdf = beta.pdf(np.clip(x, 1e-4, 1 - 1e-4), fit.alphas[k], fit.betas[k])
        else:
            pdf = norm.pdf(x, fit.means[k], np.sqrt(fit.variances[k]))
        parts.append(fit.weights[k] * pdf)
    return parts


def _loss_figure(plt, loss: np.ndarray, mixture: dict[str, Any]):
    from pipeline.core.mixture.fit import MixtureFit, normalise_losses

    fits = {name: MixtureFit.from_dict(f) for name, f in mixture.get("fits", {}).items()}
    threshold = float(mixture.get("threshold", 0.5))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    reference = fits.get("bmm") or fits.get("gmm")
    if reference is None or reference.no_spread:
        ax.hist(loss[np.isfinite(loss)], bins=80, color="0.7")
        ax.set_xlabel(f"loss ({mixture.get('loss', '?')})")
        ax.set_title("loss histogram (no mixture fitted: no loss spread)")
        return fig
    x = normalise_losses(loss[np.isfinite(loss)], reference.lo, reference.hi)
    ax.hist(x, bins=80, range=(0, 1), density=True, color="0.8", label="losses")
    grid = np.linspace(0.0005, 0.9995, 600)
    styles = {"bmm": ("tab:blue", "-"), "gmm": ("tab:purple", "--")}
    for name, (colour, style) in styles.items():
        fit = fits.get(name)
        if fit is None or fit.no_spread:
            continue
        parts = _densities(fit, grid)
        ax.plot(grid, parts[0] + parts[1], color=colour, ls=style, lw=2, label=name.upper())
        for k, part in enumerate(parts):
            which = "clean" if k == fit.clean_component else "noisy"
            ax.plot(grid, part, color=colour, ls=style, lw=0.8, alpha=0.6)
            peak = int(np.argmax(part))
            ax.annotate(which, (grid[peak], part[peak]), color=colour, fontsize=7)
        cut = _threshold_x(fit, threshold)
        if cut is not None:
            ax.axvline(cut, color=colour, ls=":", lw=1.2, label=f"{name.upper()} p={threshold}")
    ax.set_xlim(0, 1)
    top = np.percentile(np.histogram(x, bins=80, range=(0, 1), density=True)[0], 99)
    ax.set_ylim(0, max(top * 1.4, 1.0))
    ax.set_xlabel(f"normalised loss ({mixture.get('loss', '?')}, min-max over the corpus)")
    ax.set_ylabel("density")
    used = mixture.get("kind", "?").upper()
    ax.set_title(f"per-sample loss with fitted mixtures (labels use {used})")
    ax.legend(fontsize=8)
    return fig


def _label_figure(plt, soft, prob, groups, colours, title):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    bins = np.linspace(0, 1, 41)
    for ax, values, name in ((axes[0], soft, "soft_label"), (axes[1], prob, "clean_prob")):
        for group, colour in colours.items():
            mask = groups == group
            if mask.any():
                ax.hist(
                    values[mask],
                    bins=bins,
                    histtype="step",
                    lw=1.6,
                    color=colour,
                    label=f"{group} ({int(mask.sum())})",
                )
        ax.set_xlabel(name)
        ax.set_ylabel("pairs")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


def _ground_truth_path(ground_truth, summary, run_dir) -> str | None:
    from pipeline.io.tables import file_exists, read_json

    candidates = [ground_truth, (summary or {}).get("ground_truth")]
    manifest = read_json(f"{run_dir}/{MANIFEST_NAME}") or {}
    candidates.append(((manifest.get("job") or {}).get("eval") or {}).get("ground_truth"))
    for path in candidates:
        if path and file_exists(path):
            return path
    return None


def _file_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:120]


def write_thumbnails(
    wanted: dict[str, list[str]],
    shard_paths: dict[str, str],
    fs,
    folder: str,
    subdir: str = "thumbs",
    size: int = THUMB_SIZE,
) -> dict[str, str]:
    """Write PNGs (longer side at most `size`) of `wanted` {shard: [keys]}, read from the
    source tars, to `folder/subdir/`; returns {key: path relative to `folder`}."""
    from pipeline.io.shards import RawRecord, decode_record, iter_shard_records

    out = {}
    for shard, keys in wanted.items():
        path = shard_paths.get(shard)
        if not path:
            continue
        remaining = set(keys)
        try:
            for record in iter_shard_records(path):
                if not remaining:
                    break
                if not isinstance(record, RawRecord) or record.key not in remaining:
                    continue
                remaining.discard(record.key)
                sample = decode_record(record)
                if not hasattr(sample, "image") or sample.image is None:
                    continue
                image = sample.image.copy()
                image.thumbnail((size, size))
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                name = f"{subdir}/{_file_key(record.key)}.png"
                with fs.open(f"{folder}/{name}", "wb") as handle:
                    handle.write(buffer.getvalue())
                out[record.key] = name
        except Exception:  # noqa: BLE001 - a missing or moved tar only costs its thumbnails
            continue
    return out


def _losses_and_mixture(
    table, meta: dict[str, str], max_rows: int
) -> tuple[np.ndarray, dict[str, Any]]:
    """The losses the mixture was fitted on (at most `max_rows`), and that mixture's record."""
    import json

    from pipeline.clients.read import label_table_metadata, read_labels
    from pipeline.io.tables import sample_rows

    mixture = json.loads(meta.get("ncl.mixture", "{}") or "{}")
    loss = table.column("loss").to_numpy().astype(np.float64)
    sources = json.loads(meta.get("ncl.sources", "[]") or "[]")
    if sources:
        # Published labels average two views; a mixture was fitted on one view's losses only.
        source = read_labels(sources[0])
        mixture = json.loads(label_table_metadata(source).get("ncl.mixture", "{}") or "{}")
        loss = sample_rows(source, ["loss"], max_rows)[0].column("loss").to_numpy()
        loss = loss.astype(np.float64)
    return loss, mixture


def _groups(table, keys: np.ndarray, truth_path: str | None):
    """(group per row, colours, figure title): the true kind when ground truth exists."""
    import pyarrow.parquet as pq

    if truth_path:
        truth = pq.read_table(truth_path, columns=["key", "kind"])
        kind_of = dict(
            zip(truth.column("key").to_pylist(), truth.column("kind").to_pylist(), strict=True)
        )
        groups = np.array([kind_of.get(k, "unknown") for k in keys], dtype=object)
        return groups, KIND_COLOURS, "by true kind (ground truth)"
    groups = np.array(table.column("subset").to_pylist(), dtype=object)
    return groups, SUBSET_COLOURS, "by subset (no ground truth)"


def label_shard_paths(dataset) -> dict[str, str]:
    """Shard name -> source tar path, from each label table's metadata."""
    from pipeline.io.labels import read_label_footer

    shard_paths = {}
    for path in dataset.files:
        shard = os.path.basename(path)[: -len(".parquet")]
        shard_paths[shard] = read_label_footer(dataset.filesystem, path).shard_path or ""
    return shard_paths


def _anchor_info(dataset, keys: set[str]) -> dict[str, tuple[str, str]]:
    """key -> (shard, caption) of the anchors shown."""
    import pyarrow.compute as pc

    if not keys:
        return {}
    found = dataset.to_table(
        columns=["key", "shard", "caption"], filter=pc.field("key").isin(sorted(keys))
    )
    return {
        key: (shard, caption or "")
        for key, shard, caption in zip(
            found.column("key").to_pylist(),
            found.column("shard").to_pylist(),
            found.column("caption").to_pylist(),
            strict=True,
        )
    }


def _image(thumbs: dict[str, str], key: str) -> str:
    if key in thumbs:
        return f'<img src="{html.escape(thumbs[key])}" alt="{html.escape(key)}">'
    return "<em>no thumbnail</em>"


def _retrieved(root: str, meta: dict, keys: list[str], rows: list[int], prefix: str) -> dict:
    """row -> [(prefix i., key)] of the 3 captions its image retrieves in the labelled round's
    embeddings (published labels, a+b: view a's neighbours)."""
    from pipeline.reporting.evidence import retrieved_captions

    if not rows:
        return {}
    view = (meta.get("ncl.view") or "a")[0]
    near = retrieved_captions(root, int(meta.get("ncl.round", 0)), view, [keys[r] for r in rows])
    return {
        r: [(f"{prefix}{i}. ", k) for i, k in enumerate(near.get(keys[r], []), 1)] for r in rows
    }


def _method_evidence(table, shown: list[int], meta: dict, root: str):
    """(heading, row -> [(prefix, key)] of its evidence pairs, whether they show images): the
    label method's own evidence (`LabelMethod.evidence`); ("", {}, False) when it has none.
    A row for which the method recorded no pair (assign and SPS record them for noisy pairs
    only) shows the captions its image retrieves instead, said so by its prefix."""
    from pipeline.core.labels import LABEL_METHODS

    entry = LABEL_METHODS.get(meta.get("ncl.method") or "")
    if entry is None or not entry.evidence:
        return "", {}, False
    keys = table.column("key").to_pylist()
    if entry.evidence_from == "retrieval":  # searched now, in the labelled round's embeddings
        return entry.evidence, _retrieved(root, meta, keys, shown, ""), False
    by_image = table.column("image_anchor_key").to_pylist()
    by_text = table.column("text_anchor_key").to_pylist()
    cited = {}
    for row in shown:
        pair = (by_image[row], by_text[row])
        one = pair[0] and pair[0] == pair[1]  # one pair is the evidence of both sides
        sides = [("", pair[0])] if one else list(zip(SIDES, pair, strict=True))
        cited[row] = [(prefix, key) for prefix, key in sides if key]
    bare = [row for row in shown if not cited[row]]
    cited.update(_retrieved(root, meta, keys, bare, RETRIEVED_PREFIX))
    return entry.evidence, cited, True


def _evidence_html(thumbs, info, own: str, cited: list[tuple[str, str]], images: bool) -> str:
    """The evidence pairs of one row (its anchors, reliable pairs, competitors, neighbours)."""
    shown = []
    for prefix, key in cited:
        if key == own:
            shown.append(f"{prefix}<b>its own caption</b>")
            continue
        picture = f"{_image(thumbs, key)}<br>" if images else ""
        caption = html.escape(info.get(key, ("", ""))[1])
        shown.append(f"{prefix}{picture}{caption}<br><code>{html.escape(key)}</code>")
    return "<br>".join(shown) or "<em>none</em>"


def _galleries_html(dataset, table, galleries, evidence, truth_groups, fs, out) -> str:
    """The galleries' HTML (thumbnails of the pairs and their evidence written on the way).

    `galleries`: (name, title, explanation, row indices); `evidence`: `_method_evidence`'s
    (heading, cited pairs per row, images); `truth_groups` may be None."""
    heading, cited, images = evidence
    keys = table.column("key").to_pylist()
    shards = table.column("shard").to_pylist()
    captions = table.column("caption").to_pylist()
    subsets = table.column("subset").to_pylist()
    soft = table.column("soft_label").to_numpy()
    prob = table.column("clean_prob").to_numpy()
    cosine = table.column("cosine").to_numpy()
    shown = [int(row) for *_, rows in galleries for row in rows]
    info = _anchor_info(dataset, {key for pairs in cited.values() for _, key in pairs})
    wanted: dict[str, list[str]] = {}
    for row in shown:
        wanted.setdefault(shards[row], []).append(keys[row])
    for key, (shard, _) in info.items():
        if images:
            wanted.setdefault(shard, []).append(key)
    thumbs = write_thumbnails(wanted, label_shard_paths(dataset), fs, out)

    sections = []
    for _, title, explanation, rows in galleries:
        cells = []
        for row in rows:
            row = int(row)
            key = keys[row]
            truth = (
                f"<br>true kind: <b>{html.escape(str(truth_groups[row]))}</b>"
                if truth_groups is not None
                else ""
            )
            cited_html = (
                f"<td>{_evidence_html(thumbs, info, key, cited.get(row, []), images)}</td>"
                if heading
                else ""
            )
            cells.append(
                "<tr>"
                f"<td>{_image(thumbs, key)}</td>"
                f"<td>{html.escape(captions[row] or '')}<br><code>{html.escape(key)}</code></td>"
                f"<td>label <b>{soft[row]:.3f}</b><br>p(clean) {prob[row]:.3f}<br>"
                f"cosine {cosine[row]:.3f}<br>subset <b>{html.escape(subsets[row])}</b>{truth}</td>"
                f"{cited_html}</tr>"
            )
        width = 4 if heading else 3
        body = "".join(cells) or f"<tr><td colspan={width}><em>no such pair</em></td></tr>"
        sections.append(
            f"<h3>{html.escape(title)} ({len(rows)})</h3><p>{html.escape(explanation)}</p>"
            "<table class=g><tr><th>image</th><th>caption</th><th>label</th>"
            + (f"<th>{html.escape(heading)}</th>" if heading else "")
            + f"</tr>{body}</table>"
        )
    return "".join(sections)


def _gallery_rows(table, soft, prob, threshold: float, size: int) -> list:
    """(name, title, explanation, rows) of the three galleries; ties broken by key."""
    keys = np.array(table.column("key").to_pylist(), dtype=object).astype(str)
    subsets = np.array(table.column("subset").to_pylist(), dtype=object)
    cosine = table.column("cosine").to_numpy().astype(np.float64)
    cosine = np.where(np.isfinite(cosine), cosine, 0.0)
    border = np.lexsort((keys, np.abs(prob - threshold)))[:size]
    clean = np.flatnonzero(subsets == "clean")
    noisy = np.flatnonzero(subsets == "noisy")
    clean_low = clean[np.lexsort((keys[clean], cosine[clean]))][:size]
    noisy_high = noisy[np.lexsort((keys[noisy], -cosine[noisy]))][:size]
    return [
        (
            "borderline",
            "Borderline pairs",
            f"The pairs whose clean probability is closest to the cut ({threshold:g}): where "
            "the mixture is least sure.",
            border,
        ),
        (
            "clean_lowest_cosine",
            "Called clean, lowest cosine",
            "Pairs in the clean subset whose image and caption embeddings agree least: the "
            "likeliest mismatches the labels let through.",
            clean_low,
        ),
        (
            "noisy_highest_cosine",
            "Called noisy, highest cosine",
            "Pairs in the noisy subset whose embeddings agree most: the likeliest good pairs "
            "the labels hold back.",
            noisy_high,
        ),
    ]


def _random_rows(n: int, size: int) -> np.ndarray:
    """`size` of `n` rows drawn uniformly without replacement (seeded: the same run, the same
    sample), in row order."""
    return np.sort(np.random.default_rng(0).choice(n, size=min(size, n), replace=False))


def gallery_schema():
    """The explicit schema of `report/galleries.parquet`: one row per pair shown."""
    import pyarrow as pa

    from pipeline.core.labels import SCORE_COLUMNS

    strings = ("gallery", "key", "shard", "caption")
    floats = ("soft_label", "clean_prob", "cosine", *SCORE_COLUMNS)
    return pa.schema(
        [
            *(pa.field(name, pa.string(), nullable=name == "caption") for name in strings),
            pa.field("rank", pa.int32(), nullable=False),  # position in its gallery
            pa.field("subset", pa.string(), nullable=False),
            *(pa.field(name, pa.float32()) for name in floats),
            pa.field("image_anchor_key", pa.string()),
            pa.field("text_anchor_key", pa.string()),
            pa.field("true_kind", pa.string()),  # with ground truth only
        ]
    )


def _write_galleries(table, galleries, truth_groups, path: str) -> None:
    """The galleries' pairs (and a uniform sample, gallery `random`) as a Parquet table."""
    import pyarrow as pa

    from pipeline.io.tables import write_table_atomic

    schema = gallery_schema()
    names = [name for name, *_, rows in galleries for _ in rows]
    rows = np.array([int(row) for *_, rows in galleries for row in rows], dtype=np.int64)
    ranks = [rank for *_, rows in galleries for rank in range(len(rows))]
    picked = table.take(pa.array(rows, pa.int64()))
    columns = {"gallery": names, "rank": ranks}
    for name in schema.names:
        if name in picked.column_names:
            columns[name] = picked.column(name).cast(schema.field(name).type)
    kinds = [str(truth_groups[r]) for r in rows] if truth_groups is not None else None
    columns["true_kind"] = pa.array(kinds if kinds is not None else [None] * len(rows), pa.string())
    out = pa.table({name: columns[name] for name in schema.names})
    write_table_atomic(out, path, schema)


def _quality_html(summary: dict | None) -> str:
    if not (summary and summary.get("quality")):
        return ""
    cells = []
    for name, q in summary["quality"].items():
        values = [q.get(k) for k in ("auroc", "spearman", "precision", "recall")]
        text = "".join(f"<td>{'-' if v is None else f'{v:.3f}'}</td>" for v in values)
        cells.append(f"<tr><td>{html.escape(name)}</td>{text}</tr>")
    return (
        "<h2>Label quality</h2><table class=q><tr><th>score</th><th>AUROC</th>"
        "<th>Spearman</th><th>precision</th><th>recall</th></tr>" + "".join(cells) + "</table>"
    )


def _page(folder: str, parts: dict[str, str]) -> str:
    """The index page; every part is HTML already escaped."""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ncl-pipeline report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1100px; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; }}
table.g td {{ vertical-align: top; font-size: 13px; max-width: 320px; }}
table.q td {{ text-align: right; }}
dl.summary {{ display: grid; grid-template-columns: max-content auto; gap: 4px 16px; }}
dl.summary dt {{ font-weight: bold; }} dl.summary dd {{ margin: 0; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>ncl-pipeline report</h1>
<p><code>{html.escape(folder)}</code></p>
{parts["summary"]}
{parts["story"]}
{parts["quality"]}
<h2>Loss distribution and mixtures</h2><img src="loss_mixture.png" alt="loss mixture">
<h2>Soft labels</h2><img src="soft_labels.png" alt="soft labels">
<h2>Judging the labels</h2>
{parts["galleries"]}
</body></html>
"""


def write_report(
    run_dir: str | os.PathLike,
    *,
    view: str | None = None,
    ground_truth: str | None = None,
    gallery_size: int = GALLERY_SIZE,
    max_rows: int = REPORT_MAX_ROWS,
) -> str:
    """Write `<run>/report/index.html` and its PNGs; returns the index path.

    Args:
        run_dir: run directory (or a label folder / round directory; the report then goes to
            the run directory that holds it).
        view: which `labels_<view>` of a round directory.
        ground_truth: ground_truth.parquet (default: the label pass's, else the job's).
        gallery_size: pairs per gallery.
        max_rows: rows read for the figures and galleries; a larger run is sampled evenly
            (every k-th row), so the driver's memory does not grow with the corpus.

    Raises:
        pipeline.clients.read.LabelTableError: no label tables under `run_dir`.
    """
    import fsspec

    from pipeline.clients.read import label_table_metadata, labels_folder_url, read_labels
    from pipeline.core.labels import SCORE_COLUMNS
    from pipeline.io.layout import run_dir_of
    from pipeline.io.tables import read_json, sample_rows
    from pipeline.reporting.story import rounds_figure, story_html, summary_html

    plt = _pyplot()
    dataset = read_labels(run_dir, view=view)
    folder = labels_folder_url(run_dir, view)
    root = run_dir_of(folder)
    fs, _ = fsspec.core.url_to_fs(root)
    out = f"{root}/report"
    fs.makedirs(f"{out}/thumbs", exist_ok=True)
    meta = label_table_metadata(dataset)
    summary = read_json(f"{folder}/{LABEL_PASS_SUMMARY}")
    columns = ["key", "shard", "caption", "soft_label", "clean_prob", "subset", "loss", "cosine"]
    columns += ["image_anchor_key", "text_anchor_key", *SCORE_COLUMNS]
    table, stride = sample_rows(dataset, columns, max_rows)
    soft = table.column("soft_label").to_numpy()
    prob = table.column("clean_prob").to_numpy()
    keys = np.array(table.column("key").to_pylist(), dtype=object)

    loss, mixture = _losses_and_mixture(table, meta, max_rows)
    fig = _loss_figure(plt, loss, mixture)
    _save(fig, fs, f"{out}/loss_mixture.png")

    truth_path = _ground_truth_path(ground_truth, summary, root)
    groups, colours, title = _groups(table, keys, truth_path)
    fig = _label_figure(plt, soft, prob, groups, colours, title)
    _save(fig, fs, f"{out}/soft_labels.png")

    metrics = read_json(f"{root}/metrics.json")
    fig = rounds_figure(plt, metrics)
    if fig is not None:
        _save(fig, fs, f"{out}/rounds.png")
    truth_groups = groups if truth_path else None
    galleries = _gallery_rows(table, soft, prob, float(mixture.get("threshold", 0.5)), gallery_size)
    sampled = [*galleries, ("random", "", "", _random_rows(table.num_rows, RANDOM_SAMPLE))]
    _write_galleries(table, sampled, truth_groups, f"{out}/galleries.parquet")
    shown = [int(row) for *_, rows in galleries for row in rows]
    evidence = _method_evidence(table, shown, meta, root)
    parts = {
        "summary": summary_html(metrics, meta, read_json(f"{root}/{MANIFEST_NAME}"))
        + (
            f"<p>Figures and galleries: 1 pair in {stride} ({table.num_rows:,} pairs).</p>"
            if stride > 1
            else ""
        ),
        "story": story_html(metrics),
        "quality": _quality_html(summary),
        "galleries": _galleries_html(dataset, table, galleries, evidence, truth_groups, fs, out),
    }
    index = f"{out}/index.html"
    with fs.open(index, "w") as handle:
        handle.write(_page(folder, parts))
    return index
