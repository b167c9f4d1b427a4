"""The specs the stages of `run_job` build from the job (`pipeline.run.kinds`): each embed pass
(the models of its round), the warm-up and each co-teaching round (which labels each view
trains on, per train.mode), and the baselines' label tables (oracle, cosine filter)."""

from __future__ import annotations

import os

import numpy as np

from pipeline.config import JobConfig, JobConfigError
from pipeline.io.layout import RunLayout
from pipeline.io.shards import DecodeOptions, expand_shard_patterns, shard_name
from pipeline.io.tables import read_json
from pipeline.models import ModelSpec

__all__ = [
    "baseline_labels",
    "coteach_spec",
    "decode_options",
    "embed_spec",
    "embeddings_source",
    "fitted_clean_share",
    "model_specs",
    "round_models",
    "shard_sizes",
    "warmup_spec",
    "with_absolute_paths",
    "write_baseline",
]

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


def _absolute(path: str | None) -> str | None:
    if path is None or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def with_absolute_paths(job: JobConfig) -> JobConfig:
    """Local paths resolved against the driver's directory: Ray Train runs its workers in a
    directory of its own, so a relative output (checkpoint, weights cache) would be looked for
    elsewhere."""
    pretrained = job.model.pretrained
    if pretrained and os.path.isfile(os.path.expanduser(pretrained)):  # not a pretrained tag
        pretrained = _absolute(pretrained)
    model = {"pretrained": pretrained, "cache_dir": _absolute(job.model.cache_dir)}
    return job.model_copy(
        update={
            "output": _absolute(job.output),
            "model": job.model.model_copy(update=model),
            "eval": job.eval.model_copy(update={"ground_truth": _absolute(job.eval.ground_truth)}),
        }
    )


def with_decode_for(job: JobConfig, cluster_gpus: float) -> JobConfig:
    """`embed.decode: auto` resolved for a cluster with `cluster_gpus` (cpu or device), so
    that the embed pass's key names the decode that runs."""
    from pipeline.stages.embed import decode_on

    embed = job.embed.model_copy(update={"decode": decode_on(job.embed, cluster_gpus)})
    return job.model_copy(update={"embed": embed})


def check_decode(job: JobConfig) -> None:
    """Refuse an explicit `embed.decode: device` for a model whose image transform the device
    decode cannot reproduce (`auto` falls back to the model's own transform instead).

    Raises:
        JobConfigError: naming the model and its transform.
    """
    from pipeline.models.encode import pixel_spec
    from pipeline.models.loading import load_image_transform

    if job.embed.decode != "device":
        return
    for spec in model_specs(job).values():
        try:
            pixel_spec(load_image_transform(spec))
        except ValueError as exc:
            raise JobConfigError(
                f"embed.decode: device is not possible for {spec.name}: {exc}, or auto"
            ) from None


def model_specs(job: JobConfig) -> dict[str, ModelSpec]:
    """The model views of round 0: view 'a' is the job's model seeded with the job's seed."""
    return {"a": round_models(job, {})["a"]}


def embeddings_source(job: JobConfig):
    """The job's embed.from_embeddings folder, checked (layout, row counts, dimension against
    the model's config when it has one); None without one."""
    given = job.embed.from_embeddings
    if given is None:
        return None
    from pipeline.io.clip_retrieval import check_dim, open_embeddings_folder
    from pipeline.models.spec import config_embed_dim

    folder = open_embeddings_folder(given.path, given.key_column)
    check_dim(folder, config_embed_dim(job.model.name), job.model.name)
    return folder


def embed_spec(
    job: JobConfig,
    layout: RunLayout,
    round_index: int,
    checkpoints: dict[str, str],
    shard_keys: dict[str, str],
):
    """Round r's embed pass: round 0 with the job's model (view a), round r >= 1 with the
    latest checkpoints of A and B; `shard_keys` are the keys its tables are written under."""
    from pipeline.stages.embed import EmbedSpec

    views = model_specs(job) if round_index == 0 else round_models(job, checkpoints)
    return EmbedSpec(
        output=layout.output,
        round_index=round_index,
        views=views,
        seed=job.seed,
        embed=job.embed,
        decode=decode_options(job),
        write_quarantine=round_index == 0,  # the input does not change between rounds
        shard_keys=shard_keys,
        source=None,
        source_name=getattr(job.embed.from_embeddings, "source", None),
    )


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
    baseline: tuple[str, dict[str, int]] | None = None,
):
    """Round r >= 1 training: A on the labels B estimated (labels_b), B on labels_a.

    train.mode vanilla trains both on every pair (weight 1); oracle and cosine_filter on their
    `baseline` tables (folder, rows per shard: `baseline_labels`), made by their own stages:
    the same trainer, data path and schedule, for an honest comparison.
    """
    from pipeline.core.labels import get_method
    from pipeline.stages.train import TrainSpec, ViewSpec

    train = job.train
    sizes = shard_sizes(layout, round_index, shard_paths)
    if baseline is not None:
        sizes = {shard: baseline[1][shard] for shard in sizes if shard in baseline[1]}
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
        elif baseline is not None:
            labels_dir = baseline[0]
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


def baseline_labels(summary: dict) -> tuple[str, dict[str, int]]:
    """(folder, rows per shard) of an oracle or cosine-filter stage's summary."""
    return summary["folder"], summary["kept"]


def write_baseline(
    job: JobConfig, layout: RunLayout, kind: str, round_index: int, paths: list[str], folder: str
) -> dict:
    """The tables of an `oracle` stage (the ground truth's clean pairs among round r's embedded
    pairs) or a `filter` stage (the top fraction by `job.filter_scorer()`: the initial model's
    round-0 cosine, the warmed models' round-1 cosines, or round 1's soft labels) in `folder`;
    returns their summary (`kept`: rows per shard)."""
    from pipeline.stages.baselines.cosine_filter import write_cosine_filter, write_score_filter
    from pipeline.stages.baselines.oracle import write_oracle_labels

    embedded = shard_sizes(layout, round_index, paths)
    if kind == "oracle":
        truth = job.eval.ground_truth
        if truth is None:  # the config refuses train.mode oracle without it
            raise ValueError("train.mode oracle needs eval.ground_truth")
        embeddings = {s: layout.embeddings(round_index, s) for s in embedded}
        return {"kept": write_oracle_labels(truth, embeddings, folder)}
    fraction = job.train.filter_fraction
    if fraction is None:  # the clean share the mixtures found under the warmed models
        fraction = fitted_clean_share(job, layout)
    scorer = job.filter_scorer()
    if scorer == "labels":  # the two views' soft labels of round 1, averaged
        sources = {
            s: tuple((f"{layout.labels_round_dir(1, v)}/{s}.parquet", "soft_label") for v in "ab")
            for s in embedded
        }
        kept = write_score_filter(sources, folder, fraction)
        return {"fraction": fraction, "scorer": scorer, "kept": kept}
    # Round 0 embeds one view (the initial model, 'a'); round 1 the two warmed models.
    scored_round, columns = (0, ("cosine_a",)) if scorer == "initial" else (1, FILTER_COSINES)
    embeddings = {s: layout.embeddings(scored_round, s) for s in embedded}
    kept = write_cosine_filter(embeddings, folder, fraction, columns)
    return {"fraction": fraction, "scorer": scorer, "kept": kept}


def fitted_clean_share(job: JobConfig, layout: RunLayout) -> float:
    """The clean weight of round 1's mixtures (`mixture.kind`), the mean of views a and b."""
    from pipeline.core.mixture.fit import MixtureFit

    weights = []
    for view in ("a", "b"):
        record = read_json(layout.mixture(1, view))
        if record is None:
            raise FileNotFoundError(f"{layout.mixture(1, view)}: round 1's mixture is missing")
        weights.append(MixtureFit.from_dict(record["fits"][job.mixture.kind]).clean_share())
    return float(np.mean(weights))
