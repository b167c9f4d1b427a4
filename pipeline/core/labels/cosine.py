"""The CLIP-score baseline: the pair's own clipped image-text cosine as its label
(docs/methods.md §8).

Pure module: numpy. The partition is the clean split of the configured mixture (reported in
`subset`); the label ignores it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.core.labels.arrays import rowdot as _rowdot
from pipeline.core.labels.base import IndexRole, ShardInputs, ShardLabels
from pipeline.core.partition.decisions import (
    CLEAN,
    NOISY,
    PartitionDecisions,
    Select,
    decide_clean_split,
)
from pipeline.core.search.neighbours import NeighbourSearch

__all__ = ["cosine_labels", "decide", "index_role", "label_shard"]


def cosine_labels(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """CLIP-score baseline: the clipped cosine max(cos(u_i, v_i), 0), the label and the weight
    a CLIP-score user trains with.

    Negative cosines tie at 0; the label table's `cosine` column keeps the raw cosine for
    ranking. ((1 + cos) / 2 would keep the ranking but weigh every pair 0.5-0.75: close to
    vanilla training, a straw man of the baseline.)

    Args:
        u, v: (N, D) float32 L2-normalised embeddings.

    Returns:
        (N,) float32 in [0, 1].
    """
    labels: np.ndarray = np.clip(_rowdot(u, v), 0.0, 1.0).astype(np.float32)
    return labels


def decide(
    count: dict[str, int], select: Select, threshold: float, params: Any
) -> tuple[PartitionDecisions, dict[str, Any]]:
    """The clean split only (it fills `subset`)."""
    threshold, guard_cut, _, report = decide_clean_split(count, select, threshold=threshold)
    return PartitionDecisions(threshold=threshold, guard_cut=guard_cut), {"clean_split": report}


def index_role(params: Any) -> IndexRole | None:
    return None


def label_shard(
    inputs: ShardInputs, neighbours: NeighbourSearch | None, params: Any
) -> ShardLabels:
    return ShardLabels(
        soft_label=cosine_labels(inputs.u, inputs.v),
        subset=np.where(inputs.masks.clean, CLEAN, NOISY).astype(np.int8),
    )
