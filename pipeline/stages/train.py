"""Training stage: two models (views A and B) on Ray Train, data streamed by Ray Data.

Contract:
- `run_training(spec, ...)` runs one `TorchTrainer` (DDP over `spec.train.workers`, one GPU per
  worker when the cluster has GPUs) that trains BOTH views in lockstep, each with its own seed, data
  order, optimizer and (optionally) its own label table; one trainer per round instead of one
  per view halves Ray Train's start-up cost.
- Data: every epoch, each view's shards are read through Ray Data with the embed pass's decode
  (`pipeline.io.shards.decode_record`) and the model's eval transform; a label table
  (`<labels_dir>/<shard>.parquet`, columns key + `label_column`) is joined by key while a shard
  is read, so tars are never re-sharded. The order is a pure function of (seed, view, epoch):
  shard order and within-shard order are permuted with seeded generators and Ray Data keeps that
  order, so a resumed run sees exactly the batches the killed one would have.
- Checkpoints: `rounds/<r>/checkpoints/<VIEW>/resume.pt` (model, optimizer, step, epoch, RNG,
  warm-up state), written atomically every `checkpoint_every_steps` and at each epoch end; a
  restarted run resumes from it and skips the batches already consumed. `model.pt` is written
  at the end (the best warm-up epoch by held-out rSum when there is a test split, else the last);
  `train_summary.json` goes last and marks the round's training complete.
- Warm-up (`mode="warmup"`): loss on all pairs, or (`select`) on the ⌊ε·b⌋ lowest-loss pairs of
  each batch once the model has left the chance plateau; length adapts (pipeline.core.schedule).
- Co-teaching (`mode="labels"`): each view joins its own label table (the PEER's labels) and
  turns rows into training targets with `pipeline.core.coteach.training_targets` for the
  epoch's phase (`coteach_phase` over all rounds' epochs, `coteach_epochs`): a per-pair weight
  for weighted InfoNCE (or BiCro's soft margin), SPS's reliable flag (L_cro + L_met on those
  rows) and SPS's proxy caption in place of a noisy pair's caption. Mixed subsets share one
  batch and one optimizer step (the references step once per subset loader); weight-0 pairs
  stay in the batch as negatives. The LR follows one warm-up + cosine over all rounds.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.config import TrainConfig
from pipeline.core.coteach import Phase, coteach_phase, training_targets
from pipeline.core.losses import infonce_per_sample, triplet_per_sample
from pipeline.core.schedule import WarmupState, cosine_lr, update_warmup
from pipeline.core.train_losses import (
    select_small_loss,
    soft_margin,
    soft_margin_triplet,
    sps_consistency_losses,
    weighted_infonce,
)
from pipeline.io.checkpoints import load_torch, save_torch_atomic
from pipeline.io.layout import RunLayout
from pipeline.io.shards import (
    DecodeOptions,
    Rejection,
    decode_record,
    iter_shard_records,
    shard_name,
)
from pipeline.io.tables import read_json, write_json_atomic
from pipeline.models import ModelSpec, load_clip, load_transforms

__all__ = ["TrainSpec", "ViewSpec", "run_training", "read_training_batches", "epoch_shard_order"]

logger = logging.getLogger(__name__)

LOG_EVERY_STEPS = 20
TARGET_STATS = ("pairs", "weight", "reliable", "proxy")  # per-epoch sums, in the history


@dataclass(frozen=True)
class ViewSpec:
    """One of the two co-taught models."""

    name: str  # "A" or "B"
    init: ModelSpec  # weights to start from (tag, checkpoint path, or random init by seed)
    seed: int  # data order (and random init) seed
    labels_dir: str | None = None  # label table to join by key; None = every pair weight 1
    label_column: str = "soft_label"
    target: str = "weights"  # how label rows become training targets (core.coteach)
    weight_cut: float = 0.0  # labels at or below it train with weight 0 (the method's cut)
    proxies_dir: str | None = None  # SPS proxy pairs (key -> proxy caption, y_p)


@dataclass(frozen=True)
class TrainSpec:
    """One training run (the warm-up, or one co-teaching round) of the two views.

    The optimisation, warm-up and co-teaching settings are the job's validated `train` section
    itself (defaults and checks live in `pipeline.config` only); the rest says what to train
    on and where this run sits among the rounds.
    """

    output: str
    round_index: int
    views: tuple[ViewSpec, ...]
    shards: tuple[str, ...]
    shard_sizes: dict[str, int]  # usable samples per shard (from the embed pass): steps/epoch
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: str = "fp32"  # the job's model.precision
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    val_shards: tuple[str, ...] = ()  # select the warm-up length and kept epoch (not reported)
    test_shards: tuple[str, ...] = ()  # the reported retrieval of the final models only
    mode: str = "warmup"  # "warmup" | "labels" (co-teaching on joined label tables)
    max_epochs: int = 1  # train.warmup_epochs or train.epochs_per_round
    use_gpu: bool = False
    # (co-teaching epochs before this round, all co-teaching epochs): the subset schedule and
    # one LR curve over every round; (0, 0) = this run alone.
    coteach_epochs: tuple[int, int] = (0, 0)
    fail_after_steps: int | None = None  # fault injection for the resume test only


# ------------------------------------------------------------------------------------------
# Data: deterministic per-epoch order, label join by key at read time


def epoch_shard_order(shards: tuple[str, ...], seed: int, epoch: int) -> list[str]:
    """The view's shard order for an epoch: a seeded permutation."""
    order = np.random.default_rng([seed, epoch, 7]).permutation(len(shards))
    return [shards[i] for i in order]


@dataclass
class _ShardLabels:
    """One shard's label rows, by key (what the trainer joins at read time)."""

    row: dict[str, int]  # key -> row
    label: np.ndarray  # (N,) float32
    subset: np.ndarray  # (N,) int8 codes (CLEAN when the table has no subset column)
    proxy_caption: list[str | None] | None = None  # SPS: the caption paired with the image
    proxy_label: np.ndarray | None = None  # (N,) float32 y_p (NaN: no proxy)


def _read_shard_labels(view: ViewSpec, shard: str) -> _ShardLabels | None:
    if view.labels_dir is None:
        return None
    import pyarrow.parquet as pq

    from pipeline.io.labels import SUBSET_VALUES

    path = f"{view.labels_dir}/{shard}.parquet"
    names = pq.read_schema(path).names
    columns = ["key", view.label_column] + (["subset"] if "subset" in names else [])
    table = pq.read_table(path, columns=columns)
    keys = table.column("key").to_pylist()
    labels = _ShardLabels(
        row={key: i for i, key in enumerate(keys)},
        label=table.column(view.label_column).to_numpy(zero_copy_only=False).astype(np.float32),
        subset=np.zeros(len(keys), dtype=np.int8),
    )
    if "subset" in names:
        codes = {name: code for code, name in enumerate(SUBSET_VALUES)}
        labels.subset = np.array(
            [codes[s] for s in table.column("subset").to_pylist()], dtype=np.int8
        )
    if view.proxies_dir is not None:
        proxies = pq.read_table(
            f"{view.proxies_dir}/{shard}.parquet", columns=["key", "image_proxy_caption", "y_p_img"]
        )
        labels.proxy_caption = [None] * len(keys)
        labels.proxy_label = np.full(len(keys), np.nan, dtype=np.float32)
        for key, caption, y_p in zip(
            proxies.column("key").to_pylist(),
            proxies.column("image_proxy_caption").to_pylist(),
            proxies.column("y_p_img").to_pylist(),
            strict=True,
        ):
            row = labels.row.get(key)
            if row is not None and caption is not None:
                labels.proxy_caption[row] = caption
                labels.proxy_label[row] = y_p
    return labels


def _targets(
    view: ViewSpec, phase: Phase, labels: _ShardLabels, keys: list[str]
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """(weights, reliable flags, proxy captions or None) of the shard's samples, in order."""
    rows = np.array([labels.row[k] for k in keys], dtype=np.int64)
    proxy = labels.proxy_label[rows] if labels.proxy_label is not None else None
    targets = training_targets(
        view.target,
        phase,
        labels.subset[rows],
        labels.label[rows],
        proxy,
        weight_cut=view.weight_cut,
    )
    captions: list[str | None] = [None] * len(keys)
    for i in np.flatnonzero(targets.use_proxy):
        captions[i] = labels.proxy_caption[rows[i]]
    return targets.weight, targets.reliable, captions


def read_training_batches(
    batch: dict[str, np.ndarray],
    *,
    model: ModelSpec,
    decode: DecodeOptions,
    view: ViewSpec,
    epoch: int,
    phase: Phase,
    rows_per_batch: int = 256,
) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data UDF: shard paths in, decoded + preprocessed + labelled rows out (streamed).

    Quarantined samples were recorded by the embed pass and are skipped here; a decodable
    sample whose key is missing from the label table is skipped (it has no label to train on:
    the oracle's table lists the clean pairs only).
    """
    preprocess, tokenizer = load_transforms(model)
    for path in batch["path"]:
        path = str(path)
        shard = shard_name(path)
        labels = _read_shard_labels(view, shard)
        samples = []
        for record in iter_shard_records(path):
            if isinstance(record, Rejection):
                continue
            sample = decode_record(record, decode)
            if isinstance(sample, Rejection):
                continue
            if labels is not None and sample.key not in labels.row:
                continue
            samples.append(sample)
        if labels is None:
            weights = np.ones(len(samples), dtype=np.float32)
            reliable = np.zeros(len(samples), dtype=bool)
            proxy_captions: list[str | None] = [None] * len(samples)
        else:
            weights, reliable, proxy_captions = _targets(
                view, phase, labels, [s.key for s in samples]
            )
        order = np.random.default_rng([view.seed, epoch, zlib.crc32(shard.encode())]).permutation(
            len(samples)
        )
        for start in range(0, len(order), rows_per_batch):
            chunk = order[start : start + rows_per_batch]
            captions = [proxy_captions[i] or samples[i].caption for i in chunk]
            yield {
                "pixels": torch.stack([preprocess(samples[i].image) for i in chunk]).numpy(),
                "tokens": tokenizer(captions).numpy(),
                "weight": weights[chunk],
                "reliable": reliable[chunk].astype(np.float32),
                "proxy": np.array([proxy_captions[i] is not None for i in chunk], np.float32),
            }


def epoch_phase(spec: TrainSpec, view: ViewSpec, epoch: int) -> Phase:
    """The co-teaching subsets of this run's `epoch` (every subset outside co-teaching)."""
    before, total = spec.coteach_epochs
    if spec.mode != "labels" or total == 0:
        return Phase(noisy=True, quasi_clean=True)
    return coteach_phase(
        before + epoch,
        total,
        bicro_noisy_start=spec.train.bicro.noisy_start,
        sps_quasi_start=spec.train.sps.quasi_start,
        sps_noisy_start=spec.train.sps.noisy_start,
        target=view.target,
    )


def _epoch_batches(spec: TrainSpec, view: ViewSpec, epoch: int, rank: int, world: int):
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the seeded order must survive the pipeline
    ctx.enable_progress_bars = False
    shards = epoch_shard_order(spec.shards, view.seed, epoch)[rank::world]
    dataset = ray.data.from_items([{"path": p} for p in shards], override_num_blocks=len(shards))
    dataset = dataset.map_batches(
        read_training_batches,
        batch_size=1,
        fn_kwargs={
            "model": view.init,
            "decode": spec.decode,
            "view": view,
            "epoch": epoch,
            "phase": epoch_phase(spec, view, epoch),
        },
    )
    return dataset.iter_torch_batches(
        batch_size=spec.train.batch_size,
        drop_last=True,
        prefetch_batches=2,
        dtypes={
            "pixels": torch.float32,
            "tokens": torch.int64,
            "weight": torch.float32,
            "reliable": torch.float32,
            "proxy": torch.float32,
        },
    )


def steps_per_epoch(spec: TrainSpec, world: int) -> int:
    """Full batches every rank can make (ranks must take the same number of DDP steps)."""
    per_rank = [0] * world
    for index, path in enumerate(spec.shards):
        per_rank[index % world] += spec.shard_sizes.get(shard_name(path), 0)
    return max(min(per_rank) // spec.train.batch_size, 0)


# ------------------------------------------------------------------------------------------
# The loop that runs on each Ray Train worker


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # CLIP practice: no weight decay on gains, biases and the temperature.
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "logit_scale" in name else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _label_loss(spec: TrainSpec, image_emb, text_emb, logit_scale, weight, reliable):
    """Co-teaching objective on the peer's labels (docs/methods.md §10.5)."""
    if spec.train.label_loss == "soft_margin_triplet":
        # Averaged rather than summed as in the references, so one LR fits both losses.
        margins = soft_margin(weight)
        loss = soft_margin_triplet(image_emb, text_emb, margins, reduction="none").mean()
    else:
        loss = weighted_infonce(image_emb, text_emb, logit_scale, weight)
    rows = reliable > 0.5
    if int(rows.sum()) >= 2 and (spec.train.sps.lambda_cro > 0 or spec.train.sps.lambda_met > 0):
        l_cro, l_met = sps_consistency_losses(image_emb[rows], text_emb[rows])
        loss = loss + spec.train.sps.lambda_cro * l_cro + spec.train.sps.lambda_met * l_met
    return loss


def _step_loss(spec: TrainSpec, image_emb, text_emb, logit_scale, batch, selecting: bool):
    """The training objective of one batch (returns the loss and the plain InfoNCE for logs)."""
    if spec.mode == "labels":
        loss = _label_loss(
            spec, image_emb, text_emb, logit_scale, batch["weight"], batch["reliable"]
        )
        loss_i2t, loss_t2i = infonce_per_sample(
            image_emb.detach(), text_emb.detach(), logit_scale.detach()
        )
        return loss, (0.5 * (loss_i2t + loss_t2i)).mean()
    # The temperature is shared by every pair: trained on the easiest 30% alone it grows until
    # the other pairs' losses blow up (measured: InfoNCE 3.7 -> 7.2 in one epoch).
    scale = logit_scale.detach() if selecting else logit_scale
    loss_i2t, loss_t2i = infonce_per_sample(image_emb, text_emb, scale)
    plain = 0.5 * (loss_i2t + loss_t2i)  # (B,)
    per_sample = (
        triplet_per_sample(image_emb, text_emb) if spec.train.warmup.loss == "triplet" else plain
    )
    if selecting:
        keep = select_small_loss(per_sample.detach(), spec.train.warmup.select_ratio)
        return per_sample[keep].mean(), plain.mean()
    return per_sample.mean(), plain.mean()


class _ViewTrainer:
    """One view's model, optimizer and bookkeeping on a worker."""

    def __init__(
        self,
        spec: TrainSpec,
        view: ViewSpec,
        device: torch.device,
        total_steps: int,
        step_offset: int = 0,
    ):
        import ray.train.torch

        self.spec, self.view = spec, view
        self.layout = RunLayout(spec.output)
        self.loaded = load_clip(view.init, device)
        self.loaded.model.train()
        self.model = ray.train.torch.prepare_model(self.loaded.model, move_to_device=False)
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.loaded.model, spec.train.weight_decay),
            lr=spec.train.lr,
            betas=(0.9, 0.98),
            eps=1e-6,
        )
        self.total_steps, self.step_offset = total_steps, step_offset
        self.step, self.epoch, self.step_in_epoch = 0, 0, 0
        self.warmup = WarmupState()
        self.history: list[dict] = []
        self.epoch_loss_sum, self.epoch_batches = 0.0, 0
        self.epoch_targets = dict.fromkeys(TARGET_STATS, 0.0)
        self.stopped = False
        self.scaler = torch.amp.GradScaler(
            enabled=spec.precision == "fp16" and device.type == "cuda"
        )
        self.resume()

    # -- checkpoints
    def state(self) -> dict:
        return {
            "model": self.loaded.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "epoch_loss_sum": self.epoch_loss_sum,
            "epoch_batches": self.epoch_batches,
            "epoch_targets": json.dumps(self.epoch_targets),
            "rng": torch.get_rng_state(),
            "warmup": json.dumps(self.warmup.to_dict()),
            "history": json.dumps(self.history),
            "stopped": self.stopped,
        }

    def save(self) -> None:
        save_torch_atomic(
            self.state(), self.layout.resume_state(self.spec.round_index, self.view.name)
        )

    def resume(self) -> None:
        state = load_torch(self.layout.resume_state(self.spec.round_index, self.view.name))
        if state is None:
            return
        self.loaded.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.epoch_loss_sum = float(state["epoch_loss_sum"])
        self.epoch_batches = int(state["epoch_batches"])
        self.epoch_targets = json.loads(state.get("epoch_targets", "{}")) or self.epoch_targets
        torch.set_rng_state(state["rng"])
        self.warmup = WarmupState(**json.loads(state["warmup"]))
        self.history = json.loads(state["history"])
        self.stopped = bool(state["stopped"])

    # -- one optimizer step
    def train_step(self, batch: dict, device: torch.device) -> float:
        spec = self.spec
        selecting = (
            spec.mode == "warmup"
            and (spec.train.warmup.mode == "select")
            and self.warmup.left_plateau
            and not (spec.train.warmup.first_epoch_all and self.epoch == 0)
        )
        for group in self.optimizer.param_groups:
            group["lr"] = cosine_lr(
                self.step + self.step_offset,
                self.total_steps,
                spec.train.lr_warmup_steps,
                spec.train.lr,
            )
        pixels = batch["pixels"].to(device, non_blocking=True)  # (B, 3, H, W)
        tokens = batch["tokens"].to(device, non_blocking=True)  # (B, L)
        targets = {
            "weight": batch["weight"].to(device, non_blocking=True),  # (B,)
            "reliable": batch["reliable"].to(device, non_blocking=True),  # (B,)
        }
        dtype = self.loaded.autocast_dtype
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
            image_emb, text_emb, logit_scale = self.model(pixels, tokens)
        loss, plain = _step_loss(
            spec, image_emb.float(), text_emb.float(), logit_scale.float(), targets, selecting
        )
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if spec.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.loaded.model.parameters(), spec.train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        with torch.no_grad():  # CLIP clamps the temperature at 100
            self.loaded.model.logit_scale.clamp_(0, math.log(100))
        self.step += 1
        self.step_in_epoch += 1
        self.epoch_loss_sum += float(plain.detach())
        self.epoch_batches += 1
        # What the labels made of the epoch's pairs (weights, SPS reliable rows, proxy pairs).
        for name in ("weight", "reliable", "proxy"):
            self.epoch_targets[name] += float(batch[name].sum())
        self.epoch_targets["pairs"] += float(batch["weight"].numel())
        return float(loss.detach())


def _train_loop(config: dict) -> None:
    """Runs on every Ray Train worker."""
    import ray.train
    import ray.train.torch

    spec: TrainSpec = config["spec"]
    if spec.train.torch_threads:
        torch.set_num_threads(spec.train.torch_threads)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    steps = steps_per_epoch(spec, world)
    if steps == 0:
        raise ValueError(
            f"round {spec.round_index}: fewer usable samples than one batch of "
            f"{spec.train.batch_size} per worker; lower train.batch_size or train.workers"
        )
    before, total = spec.coteach_epochs
    if total:  # one LR curve over all co-teaching rounds
        schedule = {"total_steps": steps * total, "step_offset": steps * before}
    else:
        schedule = {"total_steps": steps * spec.max_epochs}
    trainers = [_ViewTrainer(spec, view, device, **schedule) for view in spec.views]
    val_set = _eval_set(spec, spec.val_shards, trainers[0]) if rank == 0 else None
    injected = 0
    while not all(t.stopped for t in trainers):
        epoch = min(t.epoch for t in trainers if not t.stopped)
        active = [t for t in trainers if not t.stopped and t.epoch == epoch]
        skip = active[0].step_in_epoch  # batches consumed before a restart (same for all views)
        iterators = [_epoch_batches(spec, t.view, epoch, rank, world) for t in active]
        started, seen = time.perf_counter(), 0
        for index, batches in enumerate(zip(*iterators, strict=False)):
            if index >= steps:
                break
            if index < skip:
                continue
            losses = [t.train_step(b, device) for t, b in zip(active, batches, strict=True)]
            seen += spec.train.batch_size * world
            injected += 1
            if rank == 0 and (index + 1) % LOG_EVERY_STEPS == 0:
                rate = seen / (time.perf_counter() - started)
                names = " ".join(
                    f"{t.view.name}={x:.3f}" for t, x in zip(active, losses, strict=True)
                )
                logger.info(
                    f"  round {spec.round_index} epoch {epoch} step {index + 1}/{steps}: loss "
                    f"{names}, {rate:.0f} samples/s per view"
                )
            if (
                rank == 0
                and spec.train.checkpoint_every_steps
                and (index + 1) % spec.train.checkpoint_every_steps == 0
            ):
                for t in active:
                    t.save()
            if spec.fail_after_steps is not None and injected >= spec.fail_after_steps:
                raise RuntimeError(f"injected failure after {injected} steps (test only)")
        seconds = time.perf_counter() - started
        results = {}
        if val_set is not None:
            from pipeline.evaluation import evaluate_models

            results = evaluate_models({t.view.name: t.loaded for t in active}, val_set)
        for t in active:
            epoch_loss = t.epoch_loss_sum / max(t.epoch_batches, 1)
            rsum = results.get(t.view.name, {}).get("rsum")
            record = {
                "epoch": epoch,
                "loss": epoch_loss,
                "val_rsum": rsum,
                "seconds": seconds,
                "samples_per_s": seen / max(seconds, 1e-9),
                "pairs": int(t.epoch_targets["pairs"]),
                "mean_weight": t.epoch_targets["weight"] / max(t.epoch_targets["pairs"], 1.0),
                "reliable_pairs": int(t.epoch_targets["reliable"]),
                "proxy_pairs": int(t.epoch_targets["proxy"]),
            }
            t.history.append(record)
            if spec.mode == "warmup":
                t.warmup = update_warmup(
                    t.warmup,
                    epoch_loss=epoch_loss,
                    batch_size=spec.train.batch_size,
                    rsum=rsum,
                    max_epochs=spec.max_epochs,
                    plateau_fraction=spec.train.warmup.plateau_fraction,
                    patience=spec.train.warmup.patience,
                )
                if rank == 0 and rsum is not None and t.warmup.best_epoch == t.warmup.epochs_done:
                    save_torch_atomic(
                        t.loaded.model.state_dict(),
                        t.layout.best_model(spec.round_index, t.view.name),
                    )
                t.stopped = t.warmup.stopped
            else:
                t.stopped = epoch + 1 >= spec.max_epochs
            t.epoch, t.step_in_epoch = epoch + 1, 0
            t.epoch_loss_sum, t.epoch_batches = 0.0, 0
            t.epoch_targets = dict.fromkeys(TARGET_STATS, 0.0)
            if rank == 0:
                t.save()
                shown = f", validation rSum {rsum:.1f}" if rsum is not None else ""
                logger.info(
                    f"  round {spec.round_index} {t.view.name} epoch {epoch}: loss "
                    f"{epoch_loss:.3f}{shown}, {record['samples_per_s']:.0f} samples/s"
                    + (f"; stop: {t.warmup.reason}" if t.stopped and spec.mode == "warmup" else "")
                )
        ray.train.report({"epoch": epoch})
    if rank == 0:
        _finish(spec, trainers)


def _eval_set(spec: TrainSpec, shards: tuple[str, ...], trainer: _ViewTrainer):
    """A held-out split decoded once with the models' preprocessing (None without shards)."""
    if not shards:
        return None
    from pipeline.evaluation import load_eval_set

    loaded = trainer.loaded
    return load_eval_set(shards, loaded.preprocess, loaded.tokenizer, spec.decode)


def _finish(spec: TrainSpec, trainers: list[_ViewTrainer]) -> None:
    """Keep each view's final weights, evaluate them (A, B, A+B) and write the summary last."""
    layout = RunLayout(spec.output)
    summary = {"round": spec.round_index, "mode": spec.mode, "views": {}, "retrieval": None}
    for t in trainers:
        best = (
            load_torch(layout.best_model(spec.round_index, t.view.name))
            if (spec.mode == "warmup" and t.warmup.best_epoch is not None)
            else None
        )
        if best is not None:
            t.loaded.model.load_state_dict(best)
        final = t.loaded.model.state_dict()
        save_torch_atomic(final, layout.model_checkpoint(spec.round_index, t.view.name))
        summary["views"][t.view.name] = {
            "epochs": t.epoch,
            "steps": t.step,
            "history": t.history,
            "warmup": t.warmup.to_dict() if spec.mode == "warmup" else None,
            "kept_epoch": t.warmup.best_epoch if best is not None else t.epoch,
            "checkpoint": layout.model_checkpoint(spec.round_index, t.view.name),
        }
    test_set = _eval_set(spec, spec.test_shards, trainers[0])
    if test_set is not None:
        from pipeline.evaluation import evaluate_models

        summary["retrieval"] = evaluate_models({t.view.name: t.loaded for t in trainers}, test_set)
        summary["retrieval_test_pairs"] = test_set.n_texts
    write_json_atomic(summary, layout.train_summary(spec.round_index))


# ------------------------------------------------------------------------------------------
# Driver side


def _torch_config():
    """Ray Train's torch backend, without a process group when there is a single worker.

    A process group is only needed to synchronise several workers, and torch's TCPStore binds
    all interfaces (`::`) whatever MASTER_ADDR says: a local, single-worker run must not open a
    port beyond loopback (`tests/test_embed_pass.py` checks what Ray processes listen on).
    """
    from ray.train.torch.config import TorchConfig, _TorchBackend

    class _Backend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            if len(worker_group) > 1:
                super().on_start(worker_group, backend_config)

    class _Config(TorchConfig):
        @property
        def backend_cls(self):
            return _Backend

    return _Config()


def run_training(spec: TrainSpec) -> dict:
    """Train the views of `spec` on Ray Train (skipped when the round's training is complete).

    Returns:
        The round's train summary (per view: epochs, steps, loss/rSum history, kept epoch).
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    layout = RunLayout(spec.output)
    done = read_json(layout.train_summary(spec.round_index))
    if done is not None:
        logger.info(f"train: round {spec.round_index} already complete, skipped")
        return done
    if steps_per_epoch(spec, spec.train.workers) == 0:
        from pipeline.config import JobConfigError

        usable = sum(spec.shard_sizes.values())
        raise JobConfigError(
            f"train.batch_size={spec.train.batch_size} x train.workers={spec.train.workers} is "
            f"more than the {usable} usable samples can fill once; lower train.batch_size"
        )
    storage = f"{layout.round_dir(spec.round_index)}/ray_train"
    if "://" not in storage:
        import os

        storage = os.path.abspath(storage)
    logger.info(
        f"train: round {spec.round_index} ({spec.mode}), views "
        f"{', '.join(v.name for v in spec.views)}, {spec.train.workers} worker(s), "
        f"{'GPU' if spec.use_gpu else 'CPU'}, up to {spec.max_epochs} epochs"
    )
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"spec": spec},
        torch_config=_torch_config(),
        scaling_config=ScalingConfig(num_workers=spec.train.workers, use_gpu=spec.use_gpu),
        run_config=RunConfig(
            storage_path=storage, name="train", failure_config=FailureConfig(max_failures=0)
        ),
    )
    trainer.fit()
    summary = read_json(layout.train_summary(spec.round_index))
    if summary is None:
        raise RuntimeError(f"training of round {spec.round_index} ended without its summary")
    return summary
