"""Oracle label tables: the clean-only upper bound of the demo and benchmarks (train.mode=oracle).

Contract: `write_oracle_labels(ground_truth, embeddings, out_dir)` writes `out_dir/<shard>.parquet`
(`ORACLE_SCHEMA`: `key, soft_label=1`) with the ground-truth clean pairs among each embedded
shard's samples, and returns the rows per shard (the trainer's samples).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.io.tables import write_table_atomic

__all__ = ["ORACLE_SCHEMA", "write_oracle_labels"]

ORACLE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("soft_label", pa.float32(), nullable=False),
    ],
    metadata={"ncl.schema": "oracle_labels.v0"},
)


def write_oracle_labels(
    ground_truth: str, embeddings: dict[str, str], out_dir: str
) -> dict[str, int]:
    """Oracle label tables: the ground-truth clean pairs among each shard's embedded samples.

    Args:
        ground_truth: ground_truth.parquet (key, kind, ...).
        embeddings: {shard name: its embeddings table} (the keys that can be trained on).
        out_dir: where `<shard>.parquet` (key, soft_label = 1) go.

    Returns:
        {shard: clean pairs written}: the trainer's samples per shard.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    truth = pq.read_table(ground_truth, columns=["key", "kind"])
    clean = truth.filter(pc.equal(truth.column("kind"), "clean")).column("key")
    sizes = {}
    for shard, path in embeddings.items():
        keys = pq.read_table(path, columns=["key"]).column("key")
        kept = keys.filter(pc.is_in(keys, value_set=clean))
        table = pa.table(
            [kept, pa.array(np.ones(len(kept), np.float32), pa.float32())], schema=ORACLE_SCHEMA
        )
        write_table_atomic(table, f"{out_dir}/{shard}.parquet", ORACLE_SCHEMA)
        sizes[shard] = len(kept)
    return sizes
