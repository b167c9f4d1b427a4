"""The training specs `run_job` builds: the warm-up and each co-teaching round (which labels
each view trains on, per train.mode), and the models each round embeds with."""

from __future__ import annotations

import numpy as np

from pipeline.config import JobConfig
from pipeline.io.layout import FILTER_SUMMARY, RunLayout
from pipeline.io.shards import DecodeOptions, expand_shard_patterns, shard_name
from pipeline.io.tables import read_json, write_json_atomic
from pipeline.models import ModelSpec

__all__ = ["coteach_spec", "decode_options", "round_models", "shard_sizes", "warmup_spec"]

FILTER_COSINES = ("cosine_a", "cosine_b")  # the warmed scorer: both views' cosines


def decode_options(job: JobConfig) -> DecodeOptions:
    return DecodeOptions(
        image_key=job.input.image_key,
        caption_key=job.input.caption_key,
        max_image_pixels=job.input.max_image_pixels,
    )


def shard_sizes(layout: RunLayout, round_index: int, shard_paths: list[str]) -> dict[str, int]:
    """Usable samples per shard, from the embed pass's Parquet footers (no data read)."""
    from pipeline.io.admitted import read_embeddings_footer

    sizes = {}
    for path in shard_paths:
        footer = read_embeddings_footer(layout.embeddings(round_index, shard_name(path)))
        if footer is not None:
            sizes[shard_name(path)] = footer.rows
    return sizes


def round_models(job: JobConfig, checkpoints: dict[str, str]) -> dict[str, ModelSpec]:
    """Embed views a and b: the latest checkpoints of A and B, else the job's model (seeds
    job.seed and job.seed + 1, so random-init views differ)."""
    return {
        view: ModelSpec(
            job.model.name,
            checkpoints.get(view.upper(), job.model.pretrained),
            job.model.precision,
            seed=job.seed + offset,
            cache_dir=job.model.cache_dir,
        )
        for offset, view in enumerate(("a", "b"))
    }


def _train_settings(job: JobConfig, layout: RunLayout, shard_paths: list[str]) -> dict:
    """TrainSpec fields shared by the warm-up and the co-teaching rounds."""
    from pipeline.runtime.ray import cluster_resources

    _, gpus = cluster_resources()

    def held_out(patterns) -> tuple[str, ...]:
        return tuple(expand_shard_patterns(patterns)) if patterns is not None else ()

    return {
        "output": layout.output,
        "shards": tuple(shard_paths),
        "val_shards": held_out(job.eval.val_shards),
        "test_shards": held_out(job.eval.test_shards),
        "train": job.train,
        "precision": job.model.precision,
        "use_gpu": gpus > 0,
        "decode": decode_options(job),
    }


def warmup_spec(job: JobConfig, layout: RunLayout, shard_paths: list[str]):
    """Round 0 training: warm up views A and B (seeds differ) from the job's model."""
    from pipeline.stages.train import TrainSpec, ViewSpec

    initial = round_models(job, {})
    views = tuple(
        ViewSpec(name=name, init=initial[name.lower()], seed=job.seed + offset)
        for offset, name in enumerate(("A", "B"))
    )
    return TrainSpec(
        **_train_settings(job, layout, shard_paths),
        round_index=0,
        views=views,
        shard_sizes=shard_sizes(layout, 0, shard_paths),
        round_kind="warmup",
        max_epochs=job.train.warmup_epochs,
    )


def coteach_spec(
    job: JobConfig,
    layout: RunLayout,
    shard_paths: list[str],
    round_index: int,
    checkpoints: dict[str, str],
):
    """Round r >= 1 training: A on the labels B estimated (labels_b), B on labels_a.

    train.mode vanilla trains both on every pair (weight 1), oracle on the ground-truth clean
    pairs only: the same trainer, data path and schedule, for an honest comparison.
    """
    from pipeline.core.labels import get_method
    from pipeline.stages.baselines.oracle import write_oracle_labels
    from pipeline.stages.train import TrainSpec, ViewSpec

    train = job.train
    sizes = shard_sizes(layout, round_index, shard_paths)
    oracle_dir = f"{layout.round_dir(round_index)}/labels_oracle"
    if train.mode == "oracle":
        embeddings = {shard: layout.embeddings(round_index, shard) for shard in sizes}
        sizes = write_oracle_labels(job.eval.ground_truth, embeddings, oracle_dir)
    elif train.mode == "cosine_filter":
        oracle_dir, sizes = _cosine_filter(job, layout, sizes, round_index)
    method = get_method(job.labels.method)
    models = round_models(job, checkpoints)
    views = []
    for offset, (name, peer) in enumerate((("A", "b"), ("B", "a"))):
        labels_dir, proxies_dir, target, cut = None, None, "weights", 0.0
        if train.mode == "coteach":
            cut = method.weight_cut(getattr(job.labels, method.name, None))
            labels_dir, target = layout.labels_round_dir(round_index, peer), method.training_target
            if method.proxy_table:
                proxies_dir = layout.sps_proxies_dir(round_index, peer)
        elif train.mode in ("oracle", "cosine_filter"):
            labels_dir = oracle_dir
        views.append(
            ViewSpec(
                name=name,
                init=models[name.lower()],
                # A new data order every round (the epoch counter restarts in each run).
                seed=job.seed + offset + 1000 * round_index,
                labels_dir=labels_dir,
                target=target,
                weight_cut=cut,
                proxies_dir=proxies_dir,
            )
        )
    epochs = train.epochs_per_round
    return TrainSpec(
        **_train_settings(job, layout, shard_paths),
        round_index=round_index,
        views=tuple(views),
        shard_sizes=sizes,
        round_kind="labels",
        max_epochs=epochs,
        coteach_epochs=((round_index - 1) * epochs, train.rounds * epochs),
    )


def _cosine_filter(job: JobConfig, layout: RunLayout, sizes: dict[str, int], round_index: int):
    """train.mode cosine_filter: the pairs kept by the scorer's cosines (`job.filter_scorer()`:
    the initial model's round-0 embeddings, or the warmed models' round-1 embeddings), computed
    by round 1 and reused by every later round. Returns (folder, kept per shard)."""
    import pyarrow.parquet as pq

    from pipeline.core.mixture.fit import MixtureFit
    from pipeline.io.tables import file_exists
    from pipeline.stages.baselines.cosine_filter import write_cosine_filter

    fraction = job.train.filter_fraction
    if fraction is None:  # the clean share the mixtures found under the warmed models
        weights = []
        for view in ("a", "b"):
            fit = MixtureFit.from_dict(read_json(layout.mixture(1, view))["fits"][job.mixture.kind])
            weights.append(1.0 if fit.no_spread else fit.weights[fit.clean_component])
        fraction = float(np.mean(weights))
    folder = f"{layout.round_dir(1)}/labels_cosine_filter"
    # Round 1's training writes it (and its clear() deletes it first); later rounds read it.
    if round_index > 1 and file_exists(f"{folder}/{FILTER_SUMMARY}"):
        return folder, {s: pq.read_metadata(f"{folder}/{s}.parquet").num_rows for s in sizes}
    scorer = job.filter_scorer()
    # Round 0 embeds one view (the initial model, 'a'); round 1 the two warmed models.
    scored_round, columns = (0, ("cosine_a",)) if scorer == "initial" else (1, FILTER_COSINES)
    embeddings = {shard: layout.embeddings(scored_round, shard) for shard in sizes}
    kept = write_cosine_filter(embeddings, folder, fraction, columns)
    summary = {"fraction": fraction, "scorer": scorer, "kept": kept}
    write_json_atomic(summary, f"{folder}/{FILTER_SUMMARY}")
    return folder, kept
