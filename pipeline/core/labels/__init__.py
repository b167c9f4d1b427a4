"""The label methods and their registry (docs/methods.md §4, "Adding a method").

`LABEL_METHODS` maps a method name (the job's `labels.method`) to its `LabelMethod`: how it
partitions the corpus, which index it searches, how it labels a shard, which table columns it
fills and how a trainer consumes its labels. The label stage and the trainer only ever go
through this dict, so a new method is one module plus one entry here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.core.labels import assign, bicro, cosine, rcr, sps
from pipeline.core.labels.base import (
    INDEX_ROLES,
    IndexRole,
    LabelMethod,
    ShardInputs,
    ShardLabels,
)
from pipeline.core.partition.decisions import NOISY
from pipeline.core.search.neighbours import NeighbourSearch

__all__ = [
    "INDEX_ROLES",
    "LABEL_METHODS",
    "SCORE_COLUMNS",
    "SCORE_DESCRIPTIONS",
    "IndexRole",
    "LabelMethod",
    "ShardInputs",
    "ShardLabels",
    "get_method",
    "label_shard",
]

LABEL_METHODS: dict[str, LabelMethod] = {
    "bicro": LabelMethod(
        name="bicro",
        decide=bicro.decide,
        index_role=bicro.index_role,
        label_shard=bicro.label_shard,
        score_columns=("bicro",),
        score_descriptions=("BiCro soft label before the BiCro* cut, when computed",),
        training_target="bicro",
        quality_scores=bicro.quality_scores,
        weight_cut=bicro.weight_cut,
        centred=bicro.centred,
        evidence="nearest clean anchor (by image; by text)",
    ),
    "rcr": LabelMethod(
        name="rcr",
        decide=rcr.decide,
        index_role=rcr.index_role,
        label_shard=rcr.label_shard,
        score_columns=("rcr",),
        score_descriptions=("RCR rank-consistency weight w (before masking by C)",),
        training_target="weights",
        direction_posteriors=True,
        quality_scores=rcr.quality_scores,
        # w compares what a pair's image retrieves with what its caption retrieves.
        evidence="captions its image retrieves (nearest 3 by cosine)",
        evidence_from="retrieval",
    ),
    "sps": LabelMethod(
        name="sps",
        decide=sps.decide,
        index_role=sps.index_role,
        label_shard=sps.label_shard,
        score_columns=("sps",),
        score_descriptions=("SPS label of the original pair, when computed",),
        training_target="sps",
        uses_trainee_view=True,
        proxy_table=True,
        mixture="gmm",  # the SPS paper and code partition with a GMM (docs/methods.md §7.1)
        evidence="nearest reliable pair (by image; by text)",
    ),
    "cosine": LabelMethod(
        name="cosine",
        decide=cosine.decide,
        index_role=cosine.index_role,
        label_shard=cosine.label_shard,
        score_columns=(),
        training_target="weights",
    ),
    "assign": LabelMethod(
        name="assign",
        decide=assign.decide,
        index_role=assign.index_role,
        label_shard=assign.label_shard,
        score_columns=("assign",),
        score_descriptions=(
            "Assign score a in [0, 1] (labels.assign.score: share of the pair's transported "
            "mass kept on its own partner, or relative), when computed (labels.v3)",
        ),
        # Pairs weigh their label; the rematches train as added rows (docs/methods.md §10.3).
        training_target="rematch",
        proxy_table=True,  # the rematch targets, in the SPS proxies-table layout
        evidence="best competitors of a noisy pair (the pair its image's mass goes to; the "
        "pair whose image sends its caption the most)",
    ),
}

# Every method's score columns, in registry order: the label table's nullable score columns
# (pipeline/io/labels.py) and the columns publish averages over the two views. The one list.
SCORE_COLUMNS = tuple(c for method in LABEL_METHODS.values() for c in method.score_columns)
# column -> its one-line description in the label-table schema
SCORE_DESCRIPTIONS = {
    column: text
    for method in LABEL_METHODS.values()
    for column, text in zip(method.score_columns, method.score_descriptions, strict=True)
}


def get_method(name: str) -> LabelMethod:
    """The registry entry of `name`, or a ValueError listing the known methods."""
    try:
        return LABEL_METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown label method {name!r}; choose one of {sorted(LABEL_METHODS)}"
        ) from None


def label_shard(
    method: LabelMethod, inputs: ShardInputs, neighbours: NeighbourSearch | None, params: Any
) -> ShardLabels:
    """`method`'s labels of one shard with the rules every method shares: rows whose loss is
    not finite (no posterior) are noisy with label 0; labels are clipped to [0, 1] float32."""
    labels = method.label_shard(inputs, neighbours, params)
    valid = inputs.masks.valid
    soft = np.where(valid, np.nan_to_num(labels.soft_label, nan=0.0), 0.0)
    labels.soft_label = np.clip(soft, 0.0, 1.0).astype(np.float32)
    labels.subset = np.where(valid, labels.subset, NOISY).astype(np.int8)
    return labels
