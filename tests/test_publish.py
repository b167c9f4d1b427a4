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
from pipeline.io.tables import write_table_atomic
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
    """A labels.v2 view table (written before `assign` existed) publishes as labels.v3 with
    `assign` null, the v2 score columns still averaged."""
    _, _, published = _publish(tmp_path, schema_b=LABELS_V2_SCHEMA)
    assert published.column("assign").null_count == N
    assert published.column("sps").null_count == 0
    assert published.schema.metadata[b"ncl.schema"] == b"labels.v3"


@pytest.mark.parametrize("version", READABLE_SCHEMA_NAMES)
def test_reader_accepts_every_version_with_later_columns_null(tmp_path, version):
    from pipeline.io.labels import labels_json_schema

    names = [c["name"] for c in labels_json_schema(version)["columns"]]
    schema = pa.schema([LABELS_SCHEMA.field(n) for n in names], {"ncl.schema": version})
    table = _view_table(schema, 3, "a")
    write_table_atomic(table, str(tmp_path / "labels" / "00000.parquet"), table.schema)
    read = read_labels(tmp_path).to_table()
    assert read.schema.names == LABELS_SCHEMA.names
    for name in LABELS_SCHEMA.names[len(names) :]:
        assert read.column(name).null_count == N, (version, name)
    np.testing.assert_array_equal(read.column("soft_label"), table.column("soft_label"))
