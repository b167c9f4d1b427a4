"""Publish: the two views' label tables of a shard combined into labels/ (one shard, no Ray).

The score columns come from the label-method registry; every one of them must be published as
the mean of the two views, whatever method added it (a new method's column published from one
view only would pass every other test).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.clients.read import read_labels
from pipeline.core.labels import LABEL_METHODS, SCORE_COLUMNS
from pipeline.io.labels import (
    LABELS_SCHEMA,
    LABELS_SCHEMA_NAME,
    LABELS_V2_SCHEMA,
    READABLE_SCHEMA_NAMES,
    SUBSET_VALUES,
    labels_file_metadata,
)
from pipeline.io.tables import read_table, write_table_atomic
from pipeline.stages.publish import AVERAGED, combine_shard

N = 6


def _view_table(schema: pa.Schema, seed: int, view: str) -> pa.Table:
    """One view's table of shard 00000: every float column random, distinct per view."""
    rng = np.random.default_rng(seed)
    keys = [f"k{i}" for i in range(N)]
    columns = {
        "key": pa.array(keys),
        "shard": pa.array(["00000"] * N),
        "subset": pa.DictionaryArray.from_arrays(
            pa.array(rng.integers(0, 3, N), pa.int8()), pa.array(SUBSET_VALUES)
        ),
        "round": pa.array(np.ones(N, np.int16)),
        "uid": pa.array([f"{i:032x}" for i in range(N)]),
    }
    for field in schema:
        if field.name not in columns and field.type == pa.float32():
            columns[field.name] = pa.array(rng.random(N, dtype=np.float32))
    metadata = labels_file_metadata(
        pipeline_version="test",
        job_hash="test",
        model_id=view,
        mixture={},
        extra={"ncl.view": view},
    )
    metadata["ncl.schema"] = schema.metadata[b"ncl.schema"].decode()
    schema = schema.with_metadata(metadata)
    arrays = [columns.get(f.name, pa.nulls(N, f.type)) for f in schema]
    return pa.table(arrays, schema=schema)


def _publish(tmp_path, schema_b: pa.Schema = LABELS_SCHEMA) -> tuple[pa.Table, pa.Table, pa.Table]:
    tables = {"a": _view_table(LABELS_SCHEMA, 1, "a"), "b": _view_table(schema_b, 2, "b")}
    sources = {}
    for view, table in tables.items():
        folder = tmp_path / "rounds" / "1" / f"labels_{view}"
        write_table_atomic(table, str(folder / "00000.parquet"), table.schema)
        sources[view] = str(folder)
    combine_shard("00000", sources, str(tmp_path / "labels"), None)
    return tables["a"], tables["b"], pq.read_table(tmp_path / "labels" / "00000.parquet")


def test_every_registered_score_column_is_in_the_schema_and_averaged_on_publish(tmp_path):
    view_a, view_b, published = _publish(tmp_path)
    assert published.schema.remove_metadata() == LABELS_SCHEMA.remove_metadata()
    assert published.schema.metadata[b"ncl.schema"] == LABELS_SCHEMA_NAME.encode()
    for method in LABEL_METHODS.values():
        for column in method.score_columns:
            field = LABELS_SCHEMA.field(column)
            assert field.type == pa.float32() and field.nullable, (method.name, column)
            assert column in AVERAGED, (method.name, column)
            expected = 0.5 * (
                view_a.column(column).to_numpy().astype(np.float64)
                + view_b.column(column).to_numpy().astype(np.float64)
            )
            np.testing.assert_allclose(
                published.column(column).to_numpy(), expected, rtol=1e-6, err_msg=column
            )
    assert "assign" in SCORE_COLUMNS


def test_a_view_table_without_a_later_score_column_publishes_it_null(tmp_path):
    """A labels.v2 view table (written before `assign` existed) publishes as labels.v4 with
    `assign` null, the v2 score columns still averaged."""
    _, _, published = _publish(tmp_path, schema_b=LABELS_V2_SCHEMA)
    assert published.column("assign").null_count == N
    assert published.column("sps").null_count == 0
    assert published.schema.metadata[b"ncl.schema"] == b"labels.v4"


@pytest.mark.parametrize("version", READABLE_SCHEMA_NAMES)
def test_reader_accepts_every_version_with_later_columns_null(tmp_path, version):
    """Also the labelling view: labels.v1-v3 wrote it as `ncl.trainee_view`, v4 as
    `ncl.labelling_view`; `label_table_metadata` returns it under the v4 key for both."""
    from pipeline.clients.read import label_table_metadata
    from pipeline.io.labels import LABELLING_VIEW_KEY, labels_json_schema

    names = [c["name"] for c in labels_json_schema(version)["columns"]]
    view_key = LABELLING_VIEW_KEY if version == LABELS_SCHEMA_NAME else "ncl.trainee_view"
    schema = pa.schema([LABELS_SCHEMA.field(n) for n in names], {"ncl.schema": version})
    table = _view_table(schema, 3, "a")
    table = table.replace_schema_metadata({**table.schema.metadata, view_key: "b"})
    write_table_atomic(table, str(tmp_path / "labels" / "00000.parquet"), table.schema)
    dataset = read_labels(tmp_path)
    read = dataset.to_table()
    assert read.schema.names == LABELS_SCHEMA.names
    for name in LABELS_SCHEMA.names[len(names) :]:
        assert read.column(name).null_count == N, (version, name)
    np.testing.assert_array_equal(read.column("soft_label"), table.column("soft_label"))
    assert label_table_metadata(dataset)[LABELLING_VIEW_KEY] == "b"


# ------------------------------------------------------------------ generations of labels/

SHARDS = ("00000", "00001", "00002", "00003")


def _views_tagged(root, tag: int) -> dict[str, str]:
    """Both views' tables of every shard, every row's `round` = `tag`: which publish a row
    came from."""
    sources = {}
    for view, seed in (("a", 1), ("b", 2)):
        folder = root / f"views-{tag}" / f"labels_{view}"
        for shard in SHARDS:
            table = _view_table(LABELS_SCHEMA, seed + tag, view)
            table = table.set_column(
                table.schema.get_field_index("round"),
                table.schema.field("round"),
                pa.array(np.full(N, tag, np.int16)),
            )
            write_table_atomic(table, str(folder / f"{shard}.parquet"), table.schema)
        sources[view] = str(folder)
    return sources


def _publish_tagged(root, tag: int) -> dict:
    from pipeline.stages.publish import publish_labels

    return publish_labels(
        _views_tagged(root, tag), SHARDS, str(root / "run" / "labels"), round_index=1, job_hash="t"
    )


@pytest.mark.ray
def test_a_reader_during_publishes_sees_one_generation(local_ray, tmp_path):
    import threading

    _publish_tagged(tmp_path, 1)
    reads: list[tuple[set, int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                table = read_labels(tmp_path / "run").to_table(columns=["key", "round"])
            except BaseException as error:  # noqa: BLE001 - reported by the test below
                errors.append(error)
                return
            reads.append((set(table.column("round").to_pylist()), table.num_rows))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        for tag in (2, 3, 2, 3):
            _publish_tagged(tmp_path, tag)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors, errors
    assert len(reads) > 20
    mixed = [tags for tags, _ in reads if len(tags) != 1]
    assert not mixed, f"{len(mixed)} of {len(reads)} reads mixed generations: {mixed[:3]}"
    assert {rows for _, rows in reads} == {N * len(SHARDS)}
    assert len({min(tags) for tags, _ in reads}) >= 2  # the reader saw the switches
    labels = tmp_path / "run" / "labels"
    # The current generation and the one before it; older ones are gone.
    assert (labels / "_CURRENT").read_text().strip() == "gen-5"
    assert sorted(p.name for p in labels.iterdir() if p.is_dir()) == ["gen-4", "gen-5"]


def test_a_file_read_while_a_writer_renames_new_versions_over_it_is_one_version(tmp_path):
    # The audit page rewrites answers.parquet on every answer while `audit --summary` reads it.
    import threading

    path = str(tmp_path / "answers.parquet")
    schema = pa.schema([("item", pa.int64()), ("answer", pa.string())])

    def version(n: int) -> pa.Table:
        return pa.table({"item": list(range(n)), "answer": ["x" * (i % 7) for i in range(n)]})

    write_table_atomic(version(1), path, schema)
    stop = threading.Event()

    def writer() -> None:
        n = 1
        while not stop.is_set():
            n = n % 300 + 1
            write_table_atomic(version(n), path, schema)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        reads = [read_table(path) for _ in range(500)]
    finally:
        stop.set()
        thread.join(timeout=30)
    assert all(table.column("item").to_pylist() == list(range(table.num_rows)) for table in reads)
    assert len({table.num_rows for table in reads}) > 10  # the reader saw the writer's versions


@pytest.mark.ray
def test_a_flat_labels_folder_reads_until_the_next_generations_replace_it(local_ray, tmp_path):
    labels = tmp_path / "run" / "labels"
    flat = _view_table(LABELS_SCHEMA, 7, "a")
    write_table_atomic(flat, str(labels / "00000.parquet"), flat.schema)
    assert read_labels(tmp_path / "run").count_rows() == N  # an older run's flat layout

    summary = _publish_tagged(tmp_path, 1)
    assert summary["generation"] == "gen-1"
    assert set(read_labels(tmp_path / "run").to_table().column("round").to_pylist()) == {1}
    assert (labels / "00000.parquet").exists()  # the previous labels: kept for one publish
    _publish_tagged(tmp_path, 2)
    assert set(read_labels(tmp_path / "run").to_table().column("round").to_pylist()) == {2}
    assert not list(labels.glob("*.parquet"))
    assert sorted(p.name for p in labels.iterdir()) == ["_CURRENT", "gen-1", "gen-2"]


@pytest.mark.parametrize("version", READABLE_SCHEMA_NAMES)
def test_one_opener_reads_every_version_with_its_uids(tmp_path, version):
    """io.labels.open_label_table (the export's reader): the rows a filter keeps, columns a
    later version added null, and a labels.v1 table's missing uid as uid_of(key)."""
    import pyarrow.compute as pc

    from pipeline.io.labels import labels_json_schema, open_label_table, uid_of

    names = [c["name"] for c in labels_json_schema(version)["columns"]]
    schema = pa.schema([LABELS_SCHEMA.field(n) for n in names], {"ncl.schema": version})
    table = _view_table(schema, 5, "a")
    path = str(tmp_path / "00000.parquet")
    write_table_atomic(table, path, table.schema)
    columns = ["key", "soft_label", "assign", "uid"]
    read = open_label_table(path, columns, pc.field("soft_label") >= 0.5)
    labels = table.column("soft_label").to_pylist()
    kept = [i for i in range(N) if labels[i] >= 0.5]
    assert 0 < len(kept) < N and read.column_names == columns
    assert read.column("key").to_pylist() == [f"k{i}" for i in kept]
    expected = [uid_of(f"k{i}") if "uid" not in names else f"{i:032x}" for i in kept]
    assert read.column("uid").to_pylist() == expected
    assert read.column("assign").null_count == (len(kept) if "assign" not in names else 0)
