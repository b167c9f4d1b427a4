"""Use the label tables in other training pipelines: a webdataset predicate and a weighted loss.

Contract:
- `LabelSelect(run, min_label, subsets)` is a picklable predicate for webdataset's
  `.select(...)`, applied to raw samples before decoding: it keeps a sample whose key has a row
  in its shard's label table with `soft_label >= min_label` (and `subset` in `subsets` when
  given). The table is found from the sample's `__url__` (`shard_name`, e.g. `.../00042.tar` ->
  `labels/00042.parquet`) and loaded lazily, once per shard and process (a small LRU, since
  webdataset reads one shard at a time per worker). Samples without a label row (quarantined,
  or from a shard the run did not label) are dropped. `label(sample)` gives the soft label.
  A run over several sources (`input.sources`) names its tables `<source>-<shard>` and keys
  `<source>/<key>`: `LabelSelect(run, source="cc12m")` reads that source's original tars.
- `label_weighted_clip_loss(image_features, text_features, logit_scale, soft_labels)`: CLIP's
  symmetric InfoNCE with each pair's positive terms weighted by its soft label (the loss the
  pipeline's co-teaching trainer uses, `pipeline.core.losses.training.weighted_infonce`), callable
  from an open_clip training loop in place of `ClipLoss` (same first three arguments).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

__all__ = ["LabelSelect", "label_weighted_clip_loss"]


class LabelSelect:
    """webdataset `.select()` predicate: keep samples whose soft label passes a threshold."""

    def __init__(
        self,
        run: str | os.PathLike,
        min_label: float = 0.5,
        subsets: tuple[str, ...] | list[str] | None = None,
        cache_shards: int = 4,
        source: str | None = None,
    ) -> None:
        """
        Args:
            run: run directory (its `labels/`) or a folder of label tables; a local path or an
                fsspec URL.
            min_label: keep `soft_label >= min_label`.
            subsets: also require `subset` in these (None: any subset).
            cache_shards: shards whose {key: label} stay in memory.
            source: the `input.sources` name of the tars this predicate reads (None: a run
                over `input.shards`).
        """
        from pipeline.clients.read import labels_folder_url

        # Fails early, naming the path, when there are no tables.
        self.folder = labels_folder_url(run)
        self.min_label = float(min_label)
        self.subsets = tuple(subsets) if subsets else None
        self.cache_shards = cache_shards
        self.source = source
        self._cache: OrderedDict[str, dict[str, float]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get an empty cache: each loads the shards it reads.
        return {**self.__dict__, "_cache": OrderedDict()}

    def _labels(self, shard: str) -> dict[str, float]:
        if shard in self._cache:
            self._cache.move_to_end(shard)
            return self._cache[shard]
        labels = _read_shard_labels(f"{self.folder}/{shard}.parquet", self.subsets)
        self._cache[shard] = labels
        while len(self._cache) > self.cache_shards:
            self._cache.popitem(last=False)
        return labels

    def label(self, sample: dict[str, Any]) -> float | None:
        """The sample's soft label (None: no row for its key, or not in `subsets`).

        Args:
            sample: a webdataset sample dict with `__key__` and `__url__`.
        """
        from pipeline.io.shards import qualify_key, shard_name, source_location

        url = str(sample["__url__"])
        if self.source is not None:
            url = source_location(self.source, url)
        return self._labels(shard_name(url)).get(qualify_key(self.source, sample["__key__"]))

    def __call__(self, sample: dict[str, Any]) -> bool:
        label = self.label(sample)
        return label is not None and label >= self.min_label


def _read_shard_labels(path: str, subsets: tuple[str, ...] | None) -> dict[str, float]:
    """{key: soft_label} of one label table ({} when the shard has none)."""
    import fsspec
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return {}
    table = pq.read_table(fs_path, columns=["key", "soft_label", "subset"], filesystem=fs)
    if subsets is not None:
        wanted = pa.array(subsets, pa.string())
        table = table.filter(pc.is_in(table.column("subset").cast(pa.string()), value_set=wanted))
    keys = table.column("key").to_pylist()
    return dict(zip(keys, table.column("soft_label").to_pylist(), strict=True))


def label_weighted_clip_loss(image_features, text_features, logit_scale, soft_labels):
    """Label-weighted symmetric InfoNCE for an open_clip training loop.

    (1/B) Σ_i y_i · ½(ℓ^{i2t}_i + ℓ^{t2i}_i): a pair's label scales only its own positive terms;
    every pair stays a negative for the others, and the mean divides by B (a batch of low
    labels takes a smaller step). All labels 1 give open_clip's `ClipLoss` value.

    Args:
        image_features: (B, D) L2-normalised image embeddings (`model(...)["image_features"]`).
        text_features: (B, D) L2-normalised text embeddings; row i is paired with image i.
        logit_scale: 1/τ, a float or a 0-d tensor (`model.logit_scale.exp()`, which then gets a
            gradient).
        soft_labels: (B,) soft labels in [0, 1] (tensor or sequence; treated as constants),
            e.g. the exported json's `ncl_soft_label` or `LabelSelect.label`.

    Returns:
        () float32 tensor with autograd intact.
    """
    import torch

    from pipeline.core.losses.training import weighted_infonce

    weights = torch.as_tensor(soft_labels, dtype=torch.float32, device=image_features.device)
    return weighted_infonce(image_features, text_features, logit_scale, weights.reshape(-1))
