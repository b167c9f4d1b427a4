"""The job file's sections, one pydantic model each; `pipeline.config` assembles them.

Every field carries a description: docs/config.md is generated from them (tests/test_docs.py).
A field is marked `RESOURCES_ONLY` when it changes how fast or where a run works, what it caches
or logs, or when it gives up, never what a stage computes; `IDENTITY` when it says where the run
reads or writes (what is read is hashed by content instead). Every other field changes results
and belongs in a stage key (tests/test_config_results.py); `pipeline.config.result_fields`
lists them.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import JsonDict

from pipeline.core.labels import LABEL_METHODS

# Markers in json_schema_extra, so the JSON schema and docs/config.md show them too.
# RESOURCES_ONLY: a rerun that changes only these reuses everything.
RESOURCES_ONLY: JsonDict = {"resources_only": True}
# IDENTITY: paths and names; shards are keyed by name and size, not path.
IDENTITY: JsonDict = {"identity": True}


class _Section(BaseModel):
    # Frozen so a stage cannot mutate the job it was given; forbid so typos fail loudly.
    model_config = ConfigDict(frozen=True, extra="forbid")


class SourceConfig(_Section):
    name: str = Field(
        description="Source name, an identifier (letter, then letters, digits, '_'), unique: "
        "qualifies its shard names (<name>-00000) and keys (<name>/000000001)."
    )
    shards: str | list[str] = Field(
        description="This source's tar shards, in any form input.shards accepts.",
        json_schema_extra=IDENTITY,
    )


class InputConfig(_Section):
    shards: str | list[str] | None = Field(
        None,
        description="Tar shards: brace pattern, glob, list, local path or fsspec URL "
        "(one unnamed source; or use input.sources).",
        json_schema_extra=IDENTITY,
    )
    sources: list[SourceConfig] | None = Field(
        None,
        description="Several downloads in one run, instead of input.shards: a list of "
        "{name, shards}; keys and shard names are qualified by the source's name.",
    )
    image_key: Literal["auto", "jpg", "jpeg", "png", "webp"] = Field(
        "auto", description="Image member extension; auto picks the first of jpg/jpeg/png/webp."
    )
    caption_key: Literal["txt"] = Field("txt", description="Caption member extension (UTF-8).")
    max_image_pixels: int = Field(
        50_000_000, gt=0, description="Decompression-bomb guard: larger images are quarantined."
    )
    allow_pipe: bool = Field(
        False,
        description="Allow 'pipe:' shard URLs (runs shell commands).",
        json_schema_extra=RESOURCES_ONLY,
    )
    max_failed_shards: int | float = Field(
        0.05,
        ge=0,
        description=(
            "Shards that may fail to read before the run stops after the embed pass: a count "
            "(int), or a fraction of the shards (float < 1, rounded up). Failed shards are "
            "quarantined, left out of the run and retried by the next run."
        ),
        json_schema_extra=RESOURCES_ONLY,
    )

    @field_validator("max_failed_shards")
    @classmethod
    def _count_or_fraction(cls, value: int | float) -> int | float:
        if isinstance(value, float) and value >= 1:
            raise ValueError(
                f"{value} is neither a count (write an integer, e.g. {int(value)}) nor a "
                "fraction below 1 (e.g. 0.05)"
            )
        return value

    @model_validator(mode="after")
    def _shards_or_sources(self) -> InputConfig:
        if (self.shards is None) == (self.sources is None):
            raise ValueError(
                "input needs exactly one of input.shards (one download) and input.sources "
                "(several, each {name, shards})"
            )
        if self.sources is not None and not self.sources:
            raise ValueError("input.sources is empty: list at least one {name, shards}")
        return self

    def shard_specs(self) -> list[tuple[str | None, str | list[str]]]:
        """(source name, shard spec) per source; (None, input.shards) for one unnamed source."""
        if self.sources is None:
            assert self.shards is not None  # _shards_or_sources
            return [(None, self.shards)]
        return [(source.name, source.shards) for source in self.sources]

    def failed_shards_allowed(self, shards: int) -> int:
        """How many of `shards` may fail before the run stops."""
        if isinstance(self.max_failed_shards, float):
            return math.ceil(self.max_failed_shards * shards)
        return self.max_failed_shards


class ModelConfig(_Section):
    name: str = Field(description="open_clip model name, e.g. ViT-B-32, or a packaged config.")
    pretrained: str | None = Field(
        None, description="open_clip pretrained tag, local checkpoint path, or null (random init)."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast precision; losses are always computed in fp32."
    )
    cache_dir: str | None = Field(
        None,
        description="Where open_clip and Hugging Face download and look up pretrained weights "
        "(a folder every node can write; null: their defaults, ~/.cache/huggingface/hub and "
        "~/.cache/clip).",
        json_schema_extra=RESOURCES_ONLY,
    )


class FromEmbeddingsConfig(_Section):
    """Round 0 from a clip-retrieval inference folder instead of the model (docs/cc3m.md,
    "Starting from embeddings you already have")."""

    path: str = Field(
        description="clip-retrieval inference output (img_emb/, text_emb/, metadata/): local "
        "folder or fsspec URL; its embeddings replace the model in round 0's embed pass.",
        json_schema_extra=IDENTITY,
    )
    model: str = Field(
        description="open_clip model that made them (clip-retrieval's open_clip:<model>/<tag> "
        "gives <model>); must be model.name."
    )
    pretrained: str | None = Field(
        description="Its pretrained tag or checkpoint (the <tag>; openai for clip-retrieval's "
        "OpenAI names such as ViT-B/32); must be model.pretrained."
    )
    key_column: str = Field(
        "auto",
        description="Metadata column holding the img2dataset key; auto: key, else image_path.",
    )
    source: str | None = Field(
        None,
        description="Under input.sources: the source whose download was embedded (its keys "
        "without the '<source>/' prefix are looked up); other sources' pairs use the model.",
    )


class EmbedConfig(_Section):
    batch_size: int = Field(
        256, ge=2, description="Fixed loss batch b (docs/methods.md §1.1): negatives per sample."
    )
    loss_permutations: int = Field(
        1,
        ge=1,
        le=64,
        description="Per-sample losses averaged over this many seeded batch permutations "
        "(docs/methods.md §1.1): less noisy losses for the mixtures; the model runs once.",
    )
    gpus_per_worker: float = Field(
        1.0,
        ge=0,
        description="GPUs per embed worker when the cluster has GPUs (ignored on CPU).",
        json_schema_extra=RESOURCES_ONLY,
    )
    cpus_per_worker: float = Field(
        1.0,
        gt=0,
        description="CPUs reserved per embed worker (decode threads share them). Without GPUs "
        "each worker loads the models: raise it to bound memory on a node of many cores.",
        json_schema_extra=RESOURCES_ONLY,
    )
    decode_threads: int = Field(
        4,
        ge=1,
        description="Threads per embed worker decoding images while the model runs; on a "
        "CPU worker at most one per CPU it holds (the model's threads share them).",
        json_schema_extra=RESOURCES_ONLY,
    )
    decode: Literal["cpu", "device", "auto"] = Field(
        "auto",
        description="Where JPEGs are decoded and resized: cpu (PIL in the decode threads), "
        "device (torchvision, batched, on the worker's device: nvJPEG on a GPU); auto = device "
        "when the cluster gives each embed worker a GPU, else cpu (resolved when the run "
        "starts, and recorded). Pixels differ by <= 2 uint8 levels (docs/benchmarks.md). A "
        "model whose transform squashes (SigLIP, DFN) keeps it on CPU: device is refused.",
    )
    forward_batch_size: int = Field(
        256,
        ge=1,
        description="Pairs per model forward in the embed pass, and per chunk decoded while the "
        "previous one runs (the loss batch is embed.batch_size); on a GPU 1024 or more.",
        json_schema_extra=RESOURCES_ONLY,
    )
    concurrency: int | Literal["auto"] = Field(
        "auto",
        description="Embed workers at a time; auto = number of GPUs, or without GPUs one per "
        "embed.cpus_per_worker CPUs (one per CPU by default: faster than fewer, wider ones).",
        json_schema_extra=RESOURCES_ONLY,
    )
    from_embeddings: FromEmbeddingsConfig | None = Field(
        None,
        description="Start from existing clip-retrieval embeddings of these shards "
        "(docs/cc3m.md): round 0 reads them by key; pairs they lack are embedded by the model.",
    )

    @field_validator("concurrency")
    @classmethod
    def _positive_concurrency(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return value


class MixtureConfig(_Section):
    kind: Literal["bmm", "gmm"] = Field("bmm", description="Mixture fitted on per-sample losses.")
    bins: int = Field(
        4096, ge=16, description="Loss histogram bins: the fit costs O(bins) whatever the corpus."
    )
    threshold: float = Field(
        0.5, gt=0, lt=1, description="delta: clean iff the clean posterior exceeds it (BiCro/NCR)."
    )


class BicroLabelsConfig(_Section):
    anchor_fraction: float = Field(
        0.1, gt=0, le=1, description="rho: lowest-loss fraction of the clean set used as anchors."
    )
    clean_floor: float = Field(
        0.5, ge=0, le=1, description="Lowest label of a clean non-anchor (0.5 code, 1 paper)."
    )
    theta: float = Field(
        0.5, ge=0, lt=1, description="BiCro* cut: soft_label <= theta becomes 0 (0 = plain BiCro)."
    )
    ratio: Literal["similarity", "distance"] = Field(
        "similarity", description="Consistency of cosine similarities (code) or distances (paper)."
    )
    centre: bool = Field(
        False,
        description="Subtract each modality's corpus mean embedding (over the pass's pairs) and "
        "re-normalise before the anchor search and the fold.",
    )
    anchors: Literal["global", "in_batch"] = Field(
        "global", description="Anchors from the whole clean set (FAISS) or per batch (reference)."
    )
    anchor_k: int = Field(
        1,
        ge=1,
        le=64,
        description="global anchors: consistency averaged over the k nearest anchors by image "
        "and by text (1: BiCro's single nearest anchor).",
    )
    label: Literal["step", "fused"] = Field(
        "step",
        description="step: BiCro's label (clean floor + consistency, theta cut); fused: "
        "p + (1 - p) * consistency, published uncut (theta cuts training weights only).",
    )
    batch_size: int = Field(
        128, ge=2, description="in_batch anchors: batch size within each shard (reference: 128)."
    )


class RcrLabelsConfig(_Section):
    k: int = Field(10, ge=1, description="K of NDCG@K (RCR grid {5, 10}).")
    delta: float = Field(
        0.5, gt=0, lt=1, description="Both directions' GMM posteriors must exceed it to be in C."
    )
    include_self: bool = Field(
        True, description="Rank the pair's own text/image too (literal reading of the paper)."
    )


class SpsLabelsConfig(_Section):
    eps1: float = Field(0.99, gt=0, lt=1, description="Reliable iff clean posterior > eps1.")
    eps2: float = Field(0.5, gt=0, lt=1, description="Noisy iff clean posterior <= eps2.")
    gamma: float = Field(1.0, gt=0, description="Proxy label scale: y_p = gamma * P^ * S.")
    beta: float = Field(0.5, ge=0, le=1, description="Proxy labels below beta become 0.")
    batch_size: int = Field(
        128, ge=2, description="Batch of proxy pairs for the match probability P^ (code: 128)."
    )
    reliable_fallback: float = Field(
        0.0,
        ge=0,
        le=1,
        description="When no posterior exceeds eps1: this top fraction by posterior is reliable "
        "instead (0 = off: no reliable set, no proxies, as the paper).",
    )
    proxy: Literal["nearest", "prototype"] = Field(
        "nearest",
        description="nearest: the nearest reliable pair, y_p = gamma P^ S (the paper's); "
        "prototype: the consensus of the proxy_k nearest (IN2R-style).",
    )
    proxy_k: int = Field(
        8, ge=1, le=64, description="prototype proxies: reliable neighbours per noisy pair."
    )

    @model_validator(mode="after")
    def _eps1_above_eps2(self) -> SpsLabelsConfig:
        if not self.eps1 > self.eps2:
            raise ValueError(
                f"SPS needs eps1 > eps2, got eps1={self.eps1} and eps2={self.eps2}: raise "
                f"labels.sps.eps1 above {self.eps2} or lower labels.sps.eps2 below {self.eps1}"
            )
        return self


class AssignLabelsConfig(_Section):
    k: int = Field(
        16,
        ge=1,
        description="Competitors per side: captions near the image, images near the caption.",
    )
    epsilon: float = Field(
        1.0, gt=0, description="Sinkhorn entropy in logit units (1 = the model's own temperature)."
    )
    iterations: int = Field(
        50, ge=1, le=10_000, description="Sinkhorn iterations, fixed (no tolerance: deterministic)."
    )
    score: Literal["share", "relative"] = Field(
        "relative",
        description="a = pi_ii over the largest entry of its row and column (1 when its partner "
        "wins both ways) or |P| pi_ii (share of the pair's mass kept on its partner; poorly "
        "calibrated: small for every pair when the model's logits are flat).",
    )
    label: Literal["min", "fused"] = Field(
        "min",
        description="soft_label = min(p, a), which can demote a swap the loss calls clean, or "
        "p + (1 - p) a, which only promotes.",
    )
    mass: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Transported mass m of the partial OT; null = the mixture's clean weight.",
    )


class LabelsConfig(_Section):
    # The choices are the registry's (pipeline.core.labels.LABEL_METHODS).
    method: Literal[tuple(LABEL_METHODS)] = Field(  # type: ignore[valid-type]
        "rcr", description="Soft-label method written as soft_label (RCR: best measured, README)."
    )
    loss: Literal["infonce_sum", "triplet"] = Field(
        "infonce_sum",
        description="Loss the mixture is fitted on: InfoNCE i2t + t2i (CLIP) or BiCro's triplet.",
    )
    posterior: Literal["summed_loss", "both_directions"] = Field(
        "summed_loss",
        description="Clean posterior that partitions (clean/noisy, SPS subsets, BiCro anchors, "
        "clean_prob): the mixture on the summed loss, or both_directions = the smaller of the "
        "GMM posteriors fitted on i2t and on t2i alone (clean only if clean both ways, as RCR's "
        "set C).",
    )
    loss_negatives: Literal["batch", "competitors"] = Field(
        "batch",
        description="Negatives of the InfoNCE the mixture sees: the embed pass's in-batch ones, or "
        "each pair's loss_competitors nearest captions and images in the corpus (methods §1.7).",
    )
    loss_competitors: int = Field(
        16, ge=1, description="Competitors per direction with loss_negatives: competitors."
    )
    bicro: BicroLabelsConfig = BicroLabelsConfig()
    rcr: RcrLabelsConfig = RcrLabelsConfig()
    sps: SpsLabelsConfig = SpsLabelsConfig()
    assign: AssignLabelsConfig = AssignLabelsConfig()

    @model_validator(mode="after")
    def _competitors_need_infonce(self) -> LabelsConfig:
        if self.loss_negatives == "competitors" and self.loss != "infonce_sum":
            raise ValueError("labels.loss_negatives: competitors needs labels.loss: infonce_sum")
        return self


class IndexConfig(_Section):
    factory: str = Field(
        "Flat",
        description="FAISS index_factory string, e.g. 'IVF65536,PQ64'; 'auto' picks by the "
        "pass's size: Flat up to 50k pairs, IVF<4 sqrt N>,SQ8 up to 4M, IVF..,PQ<dim/8> beyond "
        "(neighbours rescored exactly from the stored embeddings).",
    )
    shards: int = Field(1, ge=1, description="Index shards held by separate actors.")
    nprobe: int = Field(32, ge=1, description="IVF lists probed per query (ignored by Flat).")
    search_threads: int = Field(
        2,
        ge=1,
        description="Searches one index actor serves at once, one thread each; the label tasks "
        "that sent them hold their CPUs while they wait.",
        json_schema_extra=RESOURCES_ONLY,
    )
    gpus_per_actor: float = Field(
        0.0,
        ge=0,
        description="GPUs each index actor requests from Ray; > 0 builds and searches on exactly "
        "the GPUs Ray grants it (faiss-gpu, GPU-capable factories only), 0 = CPU.",
        json_schema_extra=RESOURCES_ONLY,
    )


class WarmupConfig(_Section):
    mode: Literal["all", "select"] = Field(
        "all", description="all: train on every pair (SPS, NCR); select: BiCro's small-loss pairs."
    )
    select_ratio: float = Field(
        0.3, gt=0, le=1, description="select: fraction epsilon of each batch kept (BiCro: 0.3)."
    )
    first_epoch_all: bool = Field(True, description="select: train the first epoch on all pairs.")
    loss: Literal["infonce", "triplet"] = Field(
        "infonce", description="Symmetric InfoNCE (CLIP), or BiCro's hinge triplet for parity."
    )
    plateau_fraction: float = Field(
        0.9,
        gt=0,
        lt=1,
        description="Left the chance plateau once the loss < fraction * ln(b); selection waits.",
    )
    patience: int = Field(
        2, ge=1, description="Stop warm-up after this many epochs without held-out rSum gain."
    )


class BicroTrainConfig(_Section):
    noisy_start: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Fraction of the co-teaching epochs trained on the clean subset only before "
        "the noisy subset joins (BiCro: half).",
    )


class SpsTrainConfig(_Section):
    quasi_start: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Fraction of the co-teaching epochs before the quasi-clean subset joins "
        "(SPS code: epoch 10 of 40).",
    )
    noisy_start: float = Field(
        0.375,
        ge=0,
        le=1,
        description="Fraction of the co-teaching epochs before noisy pairs join as proxy pairs "
        "(SPS code: epoch 15 of 40).",
    )
    lambda_cro: float = Field(
        25.0, ge=0, description="Weight of L_cro (cross-modal consistency) on reliable pairs."
    )
    lambda_met: float = Field(
        25.0, ge=0, description="Weight of L_met (intra-modal metric agreement) on reliable pairs."
    )


class TrainConfig(_Section):
    mode: Literal["coteach", "vanilla", "cosine_filter", "oracle"] = Field(
        "coteach",
        description="coteach: each model trains on the labels the other estimated; vanilla: "
        "every pair weight 1 (baseline); cosine_filter: the highest-cosine pairs under the "
        "warmed models only (CLIP-score filtering, the baseline users would pick); oracle: "
        "ground-truth clean pairs only (needs eval.ground_truth; demo and benchmarks).",
    )
    filter_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="cosine_filter: share of pairs kept; null = the clean weight of the "
        "mixture fitted on the warmed models' losses.",
    )
    filter_scorer: Literal["initial", "warmed", "labels"] | None = Field(
        None,
        description="cosine_filter: what scores the pairs. initial: the model the job "
        "starts from, once, before any training on the corpus (DataComp's CLIP-score filter); "
        "warmed: the two warmed-up models' cosine (the small-loss criterion with 0/1 weights); "
        "labels: round 1's soft labels (labels.method on the warmed models, the mean of the "
        "two views), used the way a CLIP score is. null = initial when model.pretrained is "
        "set, else warmed.",
    )
    label_loss: Literal["weighted_infonce", "soft_margin_triplet"] = Field(
        "weighted_infonce",
        description="How co-teaching consumes soft labels: per-pair weights in InfoNCE (CLIP), "
        "or BiCro's soft-margin hardest-negative triplet (bicro/cosine only, for parity).",
    )
    bicro: BicroTrainConfig = BicroTrainConfig()
    sps: SpsTrainConfig = SpsTrainConfig()
    rounds: int = Field(2, ge=0, description="Co-teaching rounds after warm-up.")
    warmup_epochs: int = Field(
        1, ge=0, description="Maximum warm-up epochs (the length adapts below it); 0 = none."
    )
    epochs_per_round: int = Field(1, ge=1, description="Fine-tuning epochs per round.")
    lr: float = Field(5.0e-7, gt=0, description="Peak learning rate (AdamW).")
    batch_size: int = Field(256, ge=2, description="Training batch size per step and worker.")
    weight_decay: float = Field(0.2, ge=0, description="AdamW weight decay (CLIP fine-tuning).")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up steps before cosine.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip; 0 = off.")
    workers: int = Field(
        1,
        ge=1,
        description="Training workers, one GPU each on GPUs: 1 runs in one Ray task, more as "
        "Ray Train DDP workers.",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="CPU training: torch threads per worker (null = Ray's default, 1).",
        json_schema_extra=RESOURCES_ONLY,
    )
    pixel_cache_gb: float = Field(
        20.0,
        ge=0,
        description="Each node keeps the training shards it read, decoded at the model's "
        "resolution (uint8), in pixel_cache_dir, up to this many GB (entries unused for 6 h "
        "make room, least recently used first), so later epochs, views and rounds read them "
        "instead of the tars and JPEGs; 0 = off. Same batches either way.",
        json_schema_extra=RESOURCES_ONLY,
    )
    pixel_cache_dir: str | None = Field(
        None,
        description="A node-local folder for pixel_cache_gb (null: <temp dir>/ncl-pixel-cache "
        "on each node, e.g. /tmp; point it at a local NVMe disk).",
        json_schema_extra=RESOURCES_ONLY,
    )
    checkpoint_every_steps: int = Field(
        200,
        ge=0,
        description="Resume checkpoints every N steps (and at epoch ends); 0 = epochs.",
        json_schema_extra=RESOURCES_ONLY,
    )
    checkpoint_every_s: float = Field(
        0.0,
        ge=0,
        description="Resume checkpoints once this many seconds passed since the last (and at "
        "epoch ends), beside checkpoint_every_steps; 0 = off. Time suits GPUs, whose steps are "
        "short: a cadence in steps writes GBs every minute or two there.",
        json_schema_extra=RESOURCES_ONLY,
    )
    max_failures: int = Field(
        3,
        ge=0,
        description="Times a round's training restarts after a failure (a lost node, a killed "
        "worker: Ray retries one worker's task, Ray Train restarts several); each restart "
        "resumes from the last resume checkpoint.",
        json_schema_extra=RESOURCES_ONLY,
    )
    report_to: Literal["none", "tensorboard", "wandb"] = Field(
        "none",
        description="Also send the numbers the console shows (per-epoch losses, pair weights, "
        "validation rSum, label AUROC per round) to TensorBoard (<output>/tensorboard) or "
        "Weights & Biases.",
        json_schema_extra=RESOURCES_ONLY,
    )
    warmup: WarmupConfig = WarmupConfig()


class EvalConfig(_Section):
    ground_truth: str | None = Field(
        None, description="ground_truth.parquet for label quality (demo/benchmarks)."
    )
    val_shards: str | list[str] | None = Field(
        None,
        description="Clean validation shards: pick the warm-up length and kept epoch (never "
        "reported). null = no selection: the warm-up runs train.warmup_epochs, keeps the last.",
    )
    test_shards: str | list[str] | None = Field(
        None,
        description="Clean held-out shards for the reported retrieval recall (never used "
        "to select anything).",
    )


class RayConfig(_Section):
    address: str | None = Field(
        None,
        description="null = local Ray on 127.0.0.1; 'auto' or ray://host:10001 = cluster.",
        json_schema_extra=RESOURCES_ONLY,
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="CPUs for the embedded local Ray (null = all of this machine).",
        json_schema_extra=RESOURCES_ONLY,
    )
    object_store_memory: int | None = Field(
        None,
        ge=75 * 1024**2,  # Ray's own minimum (75 MiB)
        description="Bytes of the embedded local Ray's object store (null = Ray's default, "
        "30% of memory); when full, objects spill to disk.",
        json_schema_extra=RESOURCES_ONLY,
    )
    preflight: bool = Field(
        True,
        description="Before any work, refuse a job whose stages no node can host (it would wait "
        "forever); false on an autoscaling cluster whose nodes come up later.",
        json_schema_extra=RESOURCES_ONLY,
    )
