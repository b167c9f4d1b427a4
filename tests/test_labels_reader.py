"""Embed -> label on the demo corpus (local Ray): reconciliation, reader, inspect and report.

The tiny model is random (no warm-up), so labels are near chance here; label quality is tested
on synthetic embeddings in test_label_pass.py.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
from label_fixtures import table_quality
from report_browser import check_report_in_browser

import pipeline
from pipeline.clients.read import LabelTableError, read_labels
from pipeline.io.labels import LABELS_SCHEMA
from pipeline.io.layout import RunLayout
from pipeline.io.shards import iter_shard_records, shard_name
from pipeline.io.tables import sample_rows
from pipeline.reporting.inspect import QUANTILES, inspect_run
from pipeline.reporting.report import write_report
from pipeline.stages.labels import LabelSpec, run_label_pass

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def labelled_run(pipeline_run) -> dict:
    """The session's small real run (tests/export_fixtures.py: 4 shards of 150 pairs, BiCro,
    2 index shards, the ground truth for label quality)."""
    return pipeline_run


def test_labels_and_quarantine_cover_the_input_exactly_once(labelled_run):
    out = Path(labelled_run["job"].output)
    expected = set()
    for path in labelled_run["paths"]:
        for item in iter_shard_records(path):
            if item.key is not None:
                expected.add((shard_name(path), item.key))
    labels = read_labels(out).to_table(columns=["shard", "key"])
    quarantine = ds.dataset(out / "quarantine", format="parquet").to_table(columns=["shard", "key"])
    label_keys = list(zip(labels["shard"].to_pylist(), labels["key"].to_pylist(), strict=True))
    quarantine_keys = list(
        zip(quarantine["shard"].to_pylist(), quarantine["key"].to_pylist(), strict=True)
    )
    assert len(label_keys) == len(set(label_keys))
    assert len(quarantine_keys) == len(set(quarantine_keys)) and quarantine.num_rows > 0
    assert not set(label_keys) & set(quarantine_keys)
    assert set(label_keys) | set(quarantine_keys) == expected
    embeddings = ds.dataset(out / "rounds/0/embeddings", format="parquet").count_rows()
    assert labels.num_rows == embeddings == labelled_run["summary"]["samples"]


def test_reader_schema_and_public_export(labelled_run, tmp_path):
    out = labelled_run["job"].output
    dataset = pipeline.read_labels(out)
    assert dataset.schema.remove_metadata() == LABELS_SCHEMA.remove_metadata()
    assert len(dataset.files) == 4
    table = dataset.to_table()
    assert table.column("bicro").null_count == 0 and table.column("rcr").null_count == len(table)
    subsets = set(table.column("subset").to_pylist())
    assert subsets <= {"clean", "noisy"}
    named = np.array(table.column("image_anchor_key").to_pylist(), dtype=object)
    keys = set(table.column("key").to_pylist())
    assert all(k in keys for k in named[named != None])  # noqa: E711
    with pytest.raises(LabelTableError, match="not a labels.v1"):
        read_labels(Path(out) / "quarantine")
    with pytest.raises(LabelTableError, match="no label tables"):
        read_labels(tmp_path)


def test_round_directory_and_view(labelled_run):
    job = labelled_run["job"]
    spec = LabelSpec.from_job(job, round_index=0, view="a", shard_paths=labelled_run["paths"])
    spec = replace(spec.with_labels(method="cosine"), ground_truth=None)
    run_label_pass(spec)
    round_dir = RunLayout(job.output).round_dir(0)
    table = read_labels(round_dir, view="a").to_table()
    assert table.num_rows == labelled_run["summary"]["samples"]
    assert table.column("bicro").null_count == table.num_rows


def test_quality_table_and_log(labelled_run):
    quality = labelled_run["summary"]["quality"]
    for name in ("bicro", "cosine", "bmm_posterior", "gmm_posterior"):
        assert 0 <= quality[name]["auroc"] <= 1
        assert quality[name]["n_pairs"] == labelled_run["summary"]["samples"]
    # What the pass reports is the quality of the table it wrote, against the ground truth.
    job = labelled_run["job"]
    table = read_labels(RunLayout(job.output).round_dir(1), view="a").to_table()
    bicro = table_quality(table, job.eval.ground_truth, "soft_label", with_subset=True)
    assert quality["bicro"]["auroc"] == pytest.approx(bicro["auroc"], abs=1e-9)
    assert quality["bicro"]["precision"] == pytest.approx(bicro["precision"], abs=1e-9)
    cosine = table_quality(table, job.eval.ground_truth, "cosine")
    assert quality["cosine"]["auroc"] == pytest.approx(cosine["auroc"], abs=1e-9)
    # Each pass's quality table is for -v; its closing line carries the label AUROC.
    assert any(
        line.startswith("labels round 1 view a:") and "label AUROC" in line
        for line in labelled_run["log"]
    )
    assert labelled_run["summary"]["index"]["shards"] == 2


def test_inspect_and_report(labelled_run, tmp_path):
    out = labelled_run["job"].output
    text = inspect_run(out)
    assert re.search(r"clean\s+\d+", text) and "soft_label quantiles" in text
    # The quantiles `inspect` prints (streamed through a histogram) are the table's own, to
    # the printed precision: the smallest value with at least q of the rows at or below it.
    printed = re.search(r"soft_label quantiles: (.*)", text).group(1)
    shown = [float(part.split()[1]) for part in printed.split(", ")]
    soft = read_labels(out).to_table(columns=["soft_label"]).column("soft_label").to_numpy()
    exact = np.quantile(soft, QUANTILES, method="inverted_cdf")
    np.testing.assert_allclose(shown, exact, atol=1e-3)
    assert "bmm" in text and "quarantine:" in text and "label quality" in text
    index = Path(write_report(out))
    assert index == Path(out) / "report" / "index.html"
    page = index.read_text()
    assert (index.parent / "loss_mixture.png").stat().st_size > 1000
    assert (index.parent / "soft_labels.png").stat().st_size > 1000
    for gallery in ("Borderline pairs", "Called clean, lowest cosine", "Called noisy, highest"):
        assert gallery in page
    assert page.count('src="thumbs/') >= 3 * 12  # each pair, and its anchor where it has one
    assert "AUROC" in page and "<pre>" not in page  # a summary, not a text dump
    state = check_report_in_browser(index, tmp_path / "report.png")
    assert len(state["images"]) >= 38  # two figures and the thumbnails
    # A run larger than the report's row budget is sampled evenly, and the page says so.
    rows = read_labels(out).count_rows()
    page = Path(write_report(out, max_rows=rows // 3)).read_text()
    assert re.search(r"Figures and galleries: 1 pair in [34] ", page)
    assert "Borderline pairs" in page


def test_sample_rows_reads_every_kth_row_batch_by_batch(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in range(3):
        ids = np.arange(part * 1000, (part + 1) * 1000)
        pq.write_table(pa.table({"id": ids}), tmp_path / f"{part}.parquet", row_group_size=128)
    dataset = ds.dataset(str(tmp_path), format="parquet")
    sample, stride = sample_rows(dataset, ["id"], 700)
    assert stride == 5  # ceil(3000 / 700)
    assert sorted(sample.column("id").to_pylist()) == list(range(0, 3000, 5))
    whole, stride = sample_rows(dataset, ["id"], 3000)
    assert stride == 1 and whole.num_rows == 3000


def test_paths_and_urls_resolve_alike_on_a_local_disk_and_an_object_store(tmp_path):
    """io.paths names a file so any fsspec call finds it again; the reader, the loaders, the
    report and the run state all name label folders through it."""
    import fsspec

    from pipeline.io.layout import run_dir_of
    from pipeline.io.paths import arrow_filesystem, as_url, filesystem, folder_names, parquet_files

    for root in (str(tmp_path / "run"), "memory://ncl-paths/run"):
        fs, folder = filesystem(f"{root}/labels")
        fs.makedirs(folder, exist_ok=True)
        for name in ("00001.parquet", "00000.parquet", "_label_pass.parquet", ".hidden.parquet"):
            fs.pipe_file(f"{folder}/{name}", b"x")
        files = parquet_files(fs, folder)
        assert [p.rsplit("/", 1)[-1] for p in files] == ["00000.parquet", "00001.parquet"]
        url = as_url(fs, files[0])
        assert fsspec.core.url_to_fs(url)[1] == files[0] and url.startswith(root.split(":")[0])
        assert (arrow_filesystem(fs) is None) == (not root.startswith("memory://"))
        assert filesystem(run_dir_of(as_url(fs, folder)))[1] == filesystem(root)[1]
        assert len(folder_names(as_url(fs, folder))) == 4 and not folder_names(f"{root}/none")
    assert run_dir_of("s3://b/run/labels/gen-3") == "s3://b/run"
    assert run_dir_of("/r/rounds/2/labels_a") == "/r"
