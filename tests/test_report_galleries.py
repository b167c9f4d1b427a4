"""The report's galleries without a model (labels made from the ground truth,
export_fixtures.truth_labelled_corpus): `report/galleries.parquet` and its uniform sample, the
precision recipe of docs/cc3m.md §4 on it, and the evidence column each label method earns."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from export_fixtures import truth_labelled_corpus
from test_report_evidence import write_embeddings

from pipeline.reporting.report import RANDOM_SAMPLE, gallery_schema, write_report


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> dict:
    return truth_labelled_corpus(tmp_path_factory.mktemp("galleries"))


def _page(run, **options) -> str:
    with open(write_report(run, **options)) as handle:
        return handle.read()


def _with_method(run, method: str | None, anchor_of=None) -> None:
    """Rewrite the label tables as `method` would have written them: its name in the metadata
    and, from `anchor_of(keys)`, the keys of the anchor-key columns."""
    for path in sorted((run / "labels").glob("*.parquet")):
        table = pq.read_table(path)
        meta = dict(table.schema.metadata)
        meta.pop(b"ncl.method", None)
        if method is not None:
            meta[b"ncl.method"], meta[b"ncl.round"], meta[b"ncl.view"] = method.encode(), b"1", b"a"
        if anchor_of is not None:
            anchors = pa.array(anchor_of(table.column("key").to_pylist()), pa.string())
            for name in ("image_anchor_key", "text_anchor_key"):
                table = table.set_column(table.schema.get_field_index(name), name, anchors)
        pq.write_table(table.replace_schema_metadata(meta), path)


def test_galleries_parquet_holds_the_shown_pairs_and_a_uniform_sample(labelled):
    run, corpus = labelled["run"], labelled["corpus"]
    write_report(run, ground_truth=str(corpus / "ground_truth.parquet"), gallery_size=5)
    table = pq.read_table(run / "report" / "galleries.parquet")
    assert table.schema.remove_metadata().equals(gallery_schema())
    sizes = dict(zip(*pc.value_counts(table.column("gallery")).flatten(), strict=True))
    counts = {name.as_py(): count.as_py() for name, count in sizes.items()}
    rows = labelled["labels"].num_rows
    assert counts == {
        "borderline": 5,
        "clean_lowest_cosine": 5,
        "noisy_highest_cosine": 5,
        "random": min(RANDOM_SAMPLE, rows),
    }
    sample = table.filter(pc.equal(table.column("gallery"), "random"))
    assert len(set(sample.column("key").to_pylist())) == sample.num_rows
    assert sample.column("rank").to_pylist() == list(range(sample.num_rows))
    # Each row is the label table's row of its key.
    labels = labelled["labels"]
    by_key = dict(zip(labels.column("key").to_pylist(), range(labels.num_rows), strict=True))
    for key, soft, subset in zip(
        sample.column("key").to_pylist(),
        sample.column("soft_label").to_pylist(),
        sample.column("subset").to_pylist(),
        strict=True,
    ):
        assert soft == labels.column("soft_label")[by_key[key]].as_py()
        assert subset == labels.column("subset")[by_key[key]].as_py()
    # docs/cc3m.md §4 recipe, with the true kind standing in for a person's judgement.
    clean = sample.filter(pc.equal(sample.column("subset"), "clean")).to_pylist()
    precision = sum(row["true_kind"] == "clean" for row in clean) / len(clean)
    assert precision == 1.0  # the fixture's clean subset is exactly the clean kind


def test_the_evidence_column_is_the_methods_own_or_absent(labelled):
    run = labelled["run"]
    try:
        _with_method(run, "cosine")  # no evidence pairs: no column
        page = _page(run, gallery_size=3)
        assert "anchor" not in page and "<th>label</th></tr>" in page
        # RCR: the captions the pair's image retrieves, searched in round 1's embeddings of view
        # a; here every caption's embedding is its image's, so each pair retrieves its own first.
        _with_method(run, "rcr")
        assert "<em>none</em>" in _page(run, gallery_size=3)  # no embeddings: nothing to show
        keys = labelled["labels"].column("key").to_pylist()
        vectors = np.random.default_rng(0).normal(size=(len(keys), 8))
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        write_embeddings(run, 1, [(keys, vectors, vectors)])
        page = _page(run, gallery_size=3)
        assert "<th>captions its image retrieves (nearest 3 by cosine)</th>" in page
        assert page.count("1. <b>its own caption</b>") == 9 and "<em>none</em>" not in page
        shutil.rmtree(run / "rounds")
        # BiCro names each pair's nearest clean anchor: the column says so and shows them.
        first = labelled["labels"].column("key")[0].as_py()
        _with_method(run, "bicro", lambda keys: [first] * len(keys))
        page = _page(run, gallery_size=3)
        assert "<th>nearest clean anchor (by image; by text)</th>" in page
        assert f"<code>{first}</code>" in page and "<em>none</em>" not in page
        # assign records competitors for noisy pairs only: a pair without them shows the
        # captions its image retrieves (its nearest competitors), said so.
        _with_method(run, "assign", lambda keys: [None] * len(keys))
        write_embeddings(run, 1, [(keys, vectors, vectors)])
        page = _page(run, gallery_size=3)
        assert "<th>best competitors of a noisy pair" in page and "<em>none</em>" not in page
        assert page.count("none recorded; its image retrieves 1. <b>its own caption</b>") == 9
    finally:
        _with_method(run, None, lambda keys: [None] * len(keys))
