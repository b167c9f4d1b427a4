"""Label quality against a corpus's ground truth (demo and benchmark corpora only).

`quality_arrays` joins one shard's scores with `ground_truth.parquet` by key and keeps a few
float32 values per pair; `quality_from_parts` evaluates the parts of every shard with
`pipeline.core.metrics.label_quality`. This is the one place per-pair values reach a driver,
and it is off for real corpora (no `eval.ground_truth`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.io.tables import read_table

__all__ = ["KIND_CODES", "quality_arrays", "quality_from_parts"]

KIND_CODES = ("clean", "partial", "mismatched")  # ground-truth kinds, sent as int8 codes


def quality_arrays(
    ground_truth: str, keys: list[str], scores: dict[str, np.ndarray], subsets: dict
) -> dict[str, Any]:
    """Ground truth joined by key, with the scores to evaluate (float32) for the driver.

    Args:
        ground_truth: ground_truth.parquet (key, kind, degree).
        keys: (N,) the shard's keys, aligned with every array of `scores` and `subsets`.
        scores: {name: (N,) float score}; subsets: {name: (N,) bool clean subset}.

    Returns:
        Compact per-pair arrays (kind as int8 codes of KIND_CODES) for `quality_from_parts`.
    """
    import pyarrow.compute as pc

    truth = read_table(ground_truth, ["key", "kind", "degree"])
    truth = truth.filter(pc.is_in(truth.column("key"), value_set=pa.array(keys, pa.string())))
    position = {key: i for i, key in enumerate(keys)}
    rows = np.array([position[k] for k in truth.column("key").to_pylist()], dtype=np.int64)
    kinds = truth.column("kind").to_pylist()
    return {
        "kind": np.array([KIND_CODES.index(k) for k in kinds], dtype=np.int8),
        "degree": truth.column("degree").to_numpy().astype(np.float32),
        "scores": {name: values[rows].astype(np.float32) for name, values in scores.items()},
        "subsets": {name: values[rows] for name, values in subsets.items()},
    }


def quality_from_parts(parts: list[dict]) -> dict[str, Any] | None:
    """Label quality per score over every shard's `quality_arrays` (None without parts)."""
    from pipeline.core.metrics import label_quality

    if not parts:
        return None
    kinds = np.array(KIND_CODES)[np.concatenate([p["kind"] for p in parts])]
    degree = np.concatenate([p["degree"] for p in parts])
    out = {}
    for name in parts[0]["scores"]:
        scores = np.concatenate([p["scores"][name] for p in parts])
        subset = None
        if name in parts[0]["subsets"]:
            subset = np.concatenate([p["subsets"][name] for p in parts])
        out[name] = label_quality(scores, kinds, degree, subset)
    return out
