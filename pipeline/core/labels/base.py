"""What every label method is made of: the shapes its functions exchange (docs/methods.md §4).

Pure module. A method is a `LabelMethod` entry in `pipeline.core.labels.LABEL_METHODS`:
- `decide(count, select, threshold, params)`: the corpus-wide `PartitionDecisions` from summed
  `partition_counts` and order statistics (`pipeline.core.partition.decisions`);
- `index_role(params)`: which rows its neighbour searches run over (an `IndexRole`), or None;
- `label_shard(inputs, neighbours, params)`: the labels of one shard (`ShardLabels`);
- `score_columns`: the label-table columns it fills besides soft_label and subset (nullable
  float32, averaged over the two views on publish), each described by `score_descriptions`;
- `training_target`: how a trainer turns its rows into weights (`pipeline.core.coteach`);
- `quality_scores(inputs, labels, cosine)`: extra scores evaluated against ground truth;
- `centred(params)`: whether its embeddings (queries and index rows) are centred first.
`params` is the method's settings object (the job's `labels.<method>` section: any object with
the attributes the method reads), so the core never imports the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.partition.decisions import (
    CLEAN,
    PartitionDecisions,
    Select,
    ShardMasks,
    ShardScalars,
)
from pipeline.core.search.neighbours import NeighbourSearch

__all__ = ["INDEX_ROLES", "IndexRole", "LabelMethod", "ShardInputs", "ShardLabels"]


@dataclass(frozen=True)
class IndexRole:
    """The rows a method's index holds and the fields stored with them."""

    name: str  # "anchors" | "reliable" | "all": names the persisted index files
    rows: Callable[[ShardMasks], np.ndarray]  # (N,) bool rows of a shard to index
    fields: tuple[str, ...]  # stored per row besides u, v (see neighbours.ROW_FIELDS)


def _reliable_rows(masks: ShardMasks) -> np.ndarray:
    if masks.sps is None:
        return np.zeros_like(masks.valid)
    rows: np.ndarray = masks.sps == CLEAN
    return rows


INDEX_ROLES = {
    "anchors": IndexRole("anchors", lambda masks: masks.anchor, ("keys",)),
    "reliable": IndexRole("reliable", _reliable_rows, ("keys", "captions")),
    "all": IndexRole("all", lambda masks: np.ones_like(masks.valid), ("groups",)),
}


@dataclass
class ShardInputs:
    """One shard as a label method sees it."""

    scalars: ShardScalars  # ids, the mixture's loss, posteriors (the partitioning view)
    masks: ShardMasks  # the shard's partition under the global decisions
    u: np.ndarray  # (N, D) float32 L2-normalised image embeddings of the labelling model
    v: np.ndarray  # (N, D) float32 text embeddings of the labelling model
    loss_i2t: np.ndarray  # (N,) float32 the labelling model's InfoNCE image->text
    loss_t2i: np.ndarray  # (N,) float32
    seed: int = 0  # the shard's seed (in-batch anchors, P^ batches)
    logit_scale: float = 1 / 0.07  # the labelling model's 1/tau
    image_dedup: bool = False  # RCR: the index stores an image group per row
    query_batch: int = 1024  # queries per neighbour search

    @property
    def finite(self) -> np.ndarray:
        """(N,) bool rows whose embeddings are finite (only those are indexed or queried)."""
        finite: np.ndarray = np.isfinite(self.u).all(axis=1) & np.isfinite(self.v).all(axis=1)
        return finite


@dataclass
class ShardLabels:
    """A method's output for one shard, aligned with its rows."""

    soft_label: np.ndarray  # (N,) float32 in [0, 1]
    subset: np.ndarray  # (N,) int8 CLEAN / QUASI_CLEAN / NOISY
    scores: dict[str, np.ndarray] = field(default_factory=dict)  # score columns, (N,) float32
    image_anchor_key: np.ndarray | None = None  # (N,) object keys (BiCro anchors, SPS proxies)
    text_anchor_key: np.ndarray | None = None
    proxies: dict[str, np.ndarray] | None = None  # SPS proxy pairs (rows + columns)


def no_quality_scores(
    inputs: ShardInputs, labels: ShardLabels, cosine: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    return {}, {}


@dataclass(frozen=True)
class LabelMethod:
    """One registry entry (see the module docstring)."""

    name: str
    decide: Callable[
        [dict[str, int], Select, float, Any], tuple[PartitionDecisions, dict[str, Any]]
    ]
    index_role: Callable[[Any], IndexRole | None]
    label_shard: Callable[[ShardInputs, NeighbourSearch | None, Any], ShardLabels]
    score_columns: tuple[str, ...]  # float32 nullable label-table columns, averaged on publish
    training_target: str  # a key of pipeline.core.coteach.TRAINING_TARGETS
    direction_posteriors: bool = False  # needs a GMM per InfoNCE direction (RCR)
    uses_trainee_view: bool = False  # labels from the trainee's embeddings (SPS)
    proxy_table: bool = False  # writes a proxies table beside the labels (SPS)
    mixture: str | None = None  # partitions with this mixture ("gmm"), else the job's kind
    quality_scores: Callable[..., tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = (
        no_quality_scores
    )
    # Labels at or below this train with weight 0 (params -> cut; BiCro's fused label: theta).
    weight_cut: Callable[[Any], float] = lambda params: 0.0
    # params -> label from embeddings centred on each modality's corpus mean (its index rows
    # and its shards alike; pipeline.core.labels.centring).
    centred: Callable[[Any], bool] = lambda params: False
    # One line per score column: its description in the label-table schema (schemas/*.json).
    score_descriptions: tuple[str, ...] = ()
    # The report's evidence column: its heading ("": no column) and where its pairs come from:
    # "anchor_keys", the pairs the image/text anchor-key columns name; "retrieval", the captions
    # the pair's image retrieves in the labelled round's embeddings (pipeline.reporting.evidence).
    evidence: str = ""
    evidence_from: str = "anchor_keys"

    def __post_init__(self) -> None:
        if len(self.score_descriptions) != len(self.score_columns):
            raise ValueError(
                f"label method {self.name!r}: give one score_descriptions line per score column "
                f"{self.score_columns} (the label-table schema describes every column)"
            )
