"""What runs on every Ray Train worker: the two views' optimisers, the epoch loop, the
warm-up selection on the validation split and the end-of-run evaluation on the test split."""

from __future__ import annotations

import json
import logging
import math
import pickle
import time
import traceback
from typing import Any

import torch

from pipeline.core.losses.per_sample import infonce_per_sample, triplet_per_sample
from pipeline.core.losses.training import (
    co_positive_mask,
    select_small_loss,
    soft_margin,
    soft_margin_triplet,
    sps_consistency_losses,
    weighted_infonce,
)
from pipeline.core.metrics import histogram_quantiles
from pipeline.core.schedule import WarmupState, cosine_lr, update_warmup
from pipeline.errors import root_cause
from pipeline.io.admitted import ShardChangedError
from pipeline.io.checkpoints import load_torch, save_torch_atomic
from pipeline.io.layout import RUN_STATE_FIELD, RunLayout
from pipeline.io.tables import read_json, remove_path, write_json_atomic
from pipeline.models import load_clip
from pipeline.runtime.devices import GpuUnusableError
from pipeline.stages.train.data import TARGET_STATS, steps_per_epoch
from pipeline.stages.train.prefetch import EpochData
from pipeline.stages.train.spec import TrainSpec, ViewSpec
from pipeline.stages.train.sync import all_have, from_rank0, is_distributed, sum_across

__all__ = [
    "NOT_RETRIED",
    "build_optimizer",
    "checkpoint_due",
    "epoch_line",
    "objective_name",
    "train_loop",
]

logger = logging.getLogger(__name__)

# Errors a restarted worker group would only hit again: the shard bytes differ from what the
# embed pass read, or the granted GPU is unusable.
NOT_RETRIED = (ShardChangedError, GpuUnusableError)

PROGRESS_REPORTS = 50  # counts sent to the driver's progress board per epoch
# Per-epoch sums pooled over the ranks: the targets' and the objective's (mean = sum / batches).
EPOCH_SUMS = (*TARGET_STATS, "objective")
WEIGHT_BINS = 100  # the epoch's pair-weight histogram over [0, 1]: quantiles to 0.01
WEIGHT_QUANTILES = (0.1, 0.5, 0.9)

# ------------------------------------------------------------------------------------------
# The loop that runs on each training worker


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # CLIP practice: no weight decay on gains, biases and the temperature.
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "logit_scale" in name else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, train, device: torch.device) -> torch.optim.AdamW:
    """The trainer's AdamW for `model` under `train` (a TrainConfig); benchmarks/train.py's plain
    loop builds the same, so the two compare data paths, not optimisers."""
    return torch.optim.AdamW(
        _param_groups(model, train.weight_decay),
        lr=train.lr,
        betas=(0.9, 0.98),
        eps=1e-6,
        # One kernel over all parameters instead of a loop of small ops per tensor, several
        # times faster on CPU (docs/development.md).
        fused=device.type in ("cpu", "cuda"),
    )


def _label_loss(
    spec: TrainSpec, image_emb, text_emb, logit_scale, weight, reliable, co_positives=None
):
    """Co-teaching objective on the peer's labels (docs/methods.md §10.5). Rows sharing an
    image or text source (SPS proxy pairs) are left out of each other's negatives."""
    if spec.train.label_loss == "soft_margin_triplet":
        # Averaged rather than summed as in the references, so one LR fits both losses.
        margins = soft_margin(weight)
        loss = soft_margin_triplet(
            image_emb, text_emb, margins, reduction="none", co_positives=co_positives
        ).mean()
    else:
        loss = weighted_infonce(image_emb, text_emb, logit_scale, weight, co_positives)
    rows = reliable > 0.5
    if int(rows.sum()) >= 2 and (spec.train.sps.lambda_cro > 0 or spec.train.sps.lambda_met > 0):
        l_cro, l_met = sps_consistency_losses(image_emb[rows], text_emb[rows])
        loss = loss + spec.train.sps.lambda_cro * l_cro + spec.train.sps.lambda_met * l_met
    return loss


def objective_name(spec: TrainSpec, selecting: bool) -> str:
    """What the optimiser minimises in a step of `spec` (the console and tracker name it)."""
    if spec.round_kind == "labels":
        name = {"weighted_infonce": "weighted InfoNCE"}.get(
            spec.train.label_loss, "soft-margin triplet"
        )
        sps = any(view.target == "sps" for view in spec.views)  # only SPS marks reliable rows
        if sps and (spec.train.sps.lambda_cro > 0 or spec.train.sps.lambda_met > 0):
            name += " + SPS consistency"
        return name
    name = "InfoNCE" if spec.train.warmup.loss == "infonce" else "triplet"
    return f"{name} of the small-loss selection" if selecting else name


def _step_loss(spec: TrainSpec, image_emb, text_emb, logit_scale, batch, selecting: bool):
    """The training objective of one batch: (loss, plain InfoNCE for logs, whether the loss
    trains the temperature)."""
    if spec.round_kind == "labels":
        loss = _label_loss(
            spec,
            image_emb,
            text_emb,
            logit_scale,
            batch["weight"],
            batch["reliable"],
            batch.get("co_positives"),
        )
        loss_i2t, loss_t2i = infonce_per_sample(
            image_emb.detach(), text_emb.detach(), logit_scale.detach()
        )
        trained = spec.train.label_loss == "weighted_infonce"
        return loss, (0.5 * (loss_i2t + loss_t2i)).mean(), trained
    # The temperature is shared by every pair: trained on the easiest 30% alone it grows until
    # the other pairs' losses blow up (docs/methods.md §10.2).
    scale = logit_scale.detach() if selecting else logit_scale
    loss_i2t, loss_t2i = infonce_per_sample(image_emb, text_emb, scale)
    plain = 0.5 * (loss_i2t + loss_t2i)  # (B,)
    per_sample = (
        triplet_per_sample(image_emb, text_emb) if spec.train.warmup.loss == "triplet" else plain
    )
    trained = spec.train.warmup.loss == "infonce" and not selecting
    if selecting:
        keep = select_small_loss(per_sample.detach(), spec.train.warmup.select_ratio)
        return per_sample[keep].mean(), plain.mean(), trained
    return per_sample.mean(), plain.mean(), trained


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
        self.spec, self.view = spec, view
        self.layout = RunLayout(spec.output)
        self.loaded = load_clip(view.init, device)
        self.loaded.model.train()
        self.model = self.loaded.model
        if is_distributed():  # DDP across Ray Train's workers; one worker trains it as is
            import ray.train.torch

            self.model = ray.train.torch.prepare_model(self.loaded.model, move_to_device=False)
        self.optimizer = build_optimizer(self.loaded.model, spec.train, device)
        self.total_steps, self.step_offset = total_steps, step_offset
        self.step, self.epoch, self.step_in_epoch = 0, 0, 0
        self.warmup = WarmupState()
        self.history: list[dict] = []
        self.new_epoch()
        self.stopped = False
        self.scaler = torch.amp.GradScaler(
            enabled=spec.precision == "fp16" and device.type == "cuda"
        )
        self.resume()

    def new_epoch(self) -> None:
        self.epoch_loss_sum, self.epoch_batches = 0.0, 0
        self.epoch_targets = dict.fromkeys(EPOCH_SUMS, 0.0)
        self.weight_hist = [0.0] * WEIGHT_BINS
        self.objective = objective_name(self.spec, False)

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
            "weight_hist": json.dumps(self.weight_hist),
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
        self.epoch_targets.update(json.loads(state.get("epoch_targets", "{}")))
        self.weight_hist = json.loads(state.get("weight_hist", "null")) or self.weight_hist
        torch.set_rng_state(state["rng"])
        self.warmup = WarmupState(**json.loads(state["warmup"]))
        self.history = json.loads(state["history"])
        self.stopped = bool(state["stopped"])

    # -- one optimizer step
    def train_step(self, batch: dict, device: torch.device) -> float:
        spec = self.spec
        selecting = (
            spec.round_kind == "warmup"
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
        if spec.round_kind == "labels":  # (B, B) rows that share an image or a text source
            targets["co_positives"] = co_positive_mask(
                batch["image_group"].to(device), batch["text_group"].to(device)
            )
        dtype = self.loaded.autocast_dtype
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
            image_emb, text_emb, logit_scale = self.model(pixels, tokens)
        loss, plain, temperature_trained = _step_loss(
            spec, image_emb.float(), text_emb.float(), logit_scale.float(), targets, selecting
        )
        if not temperature_trained:
            # DDP waits for a gradient of every parameter in the forward's graph; a zero one
            # keeps it from failing ("Expected to have finished reduction"), and dropping it
            # after the all-reduce leaves the temperature untouched, as without DDP.
            loss = loss + 0.0 * logit_scale.float()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if not temperature_trained:
            self.loaded.model.logit_scale.grad = None
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
        self.epoch_targets["objective"] += float(loss.detach())
        self.objective = objective_name(spec, selecting)
        # What the labels made of the epoch's pairs (weights, SPS reliable rows, proxy pairs).
        for name in ("weight", "reliable", "proxy"):
            self.epoch_targets[name] += float(batch[name].sum())
        self.epoch_targets["pairs"] += float(batch["weight"].numel())
        counts = torch.histc(batch["weight"].float().cpu(), bins=WEIGHT_BINS, min=0.0, max=1.0)
        self.weight_hist = [a + float(b) for a, b in zip(self.weight_hist, counts, strict=True)]
        return float(loss.detach())


def train_loop(config: dict) -> None:
    """Runs on every Ray Train worker, or as the one worker's Ray task (`config["ray_train"]`
    says which; `pipeline.stages.train.driver`).

    Ray Train restarts the worker group (Ray retries the one worker's task) after any worker
    error (`train.max_failures` times), which resumes from `resume.pt` after a lost node but
    only repeats an error in the data or the set-up: such an error (`NOT_RETRIED`) is recorded
    for the driver, and a restarted worker that finds the record ends at once instead of
    reaching the error again.
    """
    spec: TrainSpec = pickle.loads(config["spec"])  # pickled by run_training: see there
    ray_train = config.get("ray_train", True)
    path = RunLayout(spec.output).train_error(spec.round_index)
    record = read_json(path)
    if record is not None:
        if _rank_and_world(ray_train)[0] == 0:
            record["restarts_ended"] = record.get("restarts_ended", 0) + 1
            write_json_atomic(record, path)
        return
    try:
        _train(spec, config.get("progress"), ray_train)
    except Exception as exc:
        root = root_cause(exc)
        if isinstance(root, NOT_RETRIED):
            write_json_atomic(
                {
                    "type": type(root).__name__,
                    "message": str(root),
                    "traceback": traceback.format_exc(),
                },
                path,
            )
        raise


def _rank_and_world(ray_train: bool) -> tuple[int, int]:
    """(rank, world size): Ray Train's worker group, or the one worker of a Ray task."""
    if not ray_train:
        return 0, 1
    import ray.train

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size()


def _device(spec: TrainSpec, ray_train: bool) -> torch.device:
    if ray_train:
        import ray.train.torch

        return ray.train.torch.get_device()
    # A Ray task granted a GPU sees only that one (Ray sets CUDA_VISIBLE_DEVICES).
    return torch.device("cuda", 0) if spec.use_gpu else torch.device("cpu")


def _train(spec: TrainSpec, board, ray_train: bool) -> None:
    if spec.train.torch_threads:
        torch.set_num_threads(spec.train.torch_threads)
    rank, world = _rank_and_world(ray_train)
    if spec.use_gpu:
        from pipeline.runtime.devices import GpuUnusableError, cuda_unusable_reason

        reason = cuda_unusable_reason()
        if reason is not None:
            raise GpuUnusableError(f"training worker {rank} was granted a GPU but {reason}")
    device = _device(spec, ray_train)
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
    injected = [0]  # steps run by this process, for the fault-injection test
    data = EpochData(spec, rank, world, device)
    try:
        while not all(t.stopped for t in trainers):
            epoch = min(t.epoch for t in trainers if not t.stopped)
            active = [t for t in trainers if not t.stopped and t.epoch == epoch]
            seen, seconds = _run_epoch(spec, data, active, epoch, steps, device, injected, board)
            results = {}
            if val_set is not None:
                from pipeline.stages.train.evaluation import evaluate_models

                results = evaluate_models({t.view.name: t.loaded for t in active}, val_set)
            results = from_rank0(results, device)  # patience reads it on every rank
            for t in active:
                _pool_epoch(t, device)
                rsum = results.get(t.view.name, {}).get("rsum")
                _end_epoch(spec, t, epoch, rsum, seen, seconds, rank, board)
            _agree_on_stops(active, device)
            for t in active:
                if t.stopped:
                    data.stop(t.view)  # its readers would run on into epochs it never trains
            if ray_train:  # Ray Train's controller follows the workers' epochs
                import ray.train

                ray.train.report({"epoch": epoch})
    finally:
        data.close()  # the pipelines' readers run ahead: end them (also after an error)
    if rank == 0:
        _finish(spec, trainers)


def _pool_epoch(t: _ViewTrainer, device: torch.device) -> None:
    """The view's epoch sums over every rank, so each rank judges the same mean loss."""
    names = list(EPOCH_SUMS)
    sums = [t.epoch_targets[n] for n in names]
    pooled = sum_across([t.epoch_loss_sum, float(t.epoch_batches), *sums, *t.weight_hist], device)
    t.epoch_loss_sum, t.epoch_batches = pooled[0], int(pooled[1])
    t.epoch_targets = dict(zip(names, pooled[2 : 2 + len(names)], strict=True))
    t.weight_hist = pooled[2 + len(names) :]


def _agree_on_stops(active: list[_ViewTrainer], device: torch.device) -> None:
    """Rank 0's warm-up state and stop decision on every rank (its inputs are already shared;
    this makes the decision itself one, whatever float differences a rank could have)."""
    decided = from_rank0([(t.warmup.to_dict(), t.stopped) for t in active], device)
    for t, (warmup, stopped) in zip(active, decided, strict=True):
        t.warmup, t.stopped = WarmupState(**warmup), stopped


def _epoch_name(spec: TrainSpec, epoch: int) -> str:
    stage = "warm-up" if spec.round_kind == "warmup" else f"co-teaching round {spec.round_index}"
    return f"{stage} epoch {epoch + 1}/{spec.max_epochs}"


def _report(board, name: str, done: int, total: int, note: str) -> None:
    """Counts for the driver's progress bar (pipeline.runtime.progress); never waits for an
    answer."""
    if board is not None:
        board.report.remote(name, done, total, note)


def _say(board, message: dict) -> None:
    """An epoch's numbers for the driver to log and track (workers do not print)."""
    if board is not None:
        board.message.remote(message)
    else:
        logger.debug(epoch_line(message))


def checkpoint_due(train, steps_done: int, since_save_s: float) -> bool:
    """Whether rank 0 writes resume checkpoints after `steps_done` steps of an epoch, the last
    one `since_save_s` seconds ago: every `train.checkpoint_every_steps` steps, or once
    `train.checkpoint_every_s` seconds have passed (0 turns either off; epoch ends always save).
    """
    every = train.checkpoint_every_steps
    if every and steps_done % every == 0:
        return True
    return bool(train.checkpoint_every_s) and since_save_s >= train.checkpoint_every_s


def _run_epoch(
    spec, data: EpochData, active, epoch, steps, device, injected, board=None
) -> tuple[int, float]:
    """One epoch of every active view, in lockstep; returns (samples seen, seconds). The data
    of later epochs is read meanwhile (`pipeline.stages.train.prefetch`).

    A step is taken only when every rank has a batch for it: a rank whose shards hold fewer
    usable samples than `shard_sizes` promised (samples without a label row) ends the epoch for
    all, instead of leaving the others alone in the next all-reduce.
    """
    rank, world, views = data.rank, data.world, [t.view for t in active]
    report_every = max(1, steps // PROGRESS_REPORTS)
    # Batches each view consumed before a restart. The views' resume states are separate files,
    # so a worker lost between two saves leaves them at different steps: each skips its own.
    done = [t.step_in_epoch for t in active]
    steps_in = zip(*data.batches(views, epoch), strict=False)
    started, seen = time.perf_counter(), 0
    saved = started  # the last resume checkpoint (or the epoch's start)
    for index in range(steps):
        batches = next(steps_in, None)
        if not all_have(batches is not None, device):
            break
        assert batches is not None  # all_have is False when this rank has none
        stepping = [(t, b) for t, b, d in zip(active, batches, done, strict=True) if index >= d]
        if not stepping:
            continue
        for t, b in stepping:
            t.train_step(b, device)
        seen += spec.train.batch_size * world
        injected[0] += 1
        if rank == 0 and ((index + 1) % report_every == 0 or index + 1 == steps):
            # The same quantity as the epoch line's, on this rank's batches so far.
            names = " ".join(
                f"{t.view.name}={t.epoch_loss_sum / max(t.epoch_batches, 1):.3f}" for t in active
            )
            note = f"mean InfoNCE so far {names}"
            _report(board, _epoch_name(spec, epoch), index + 1, steps, note)
        if rank == 0 and checkpoint_due(spec.train, index + 1, time.perf_counter() - saved):
            for t, _ in stepping:
                t.save()
            saved = time.perf_counter()
        if spec.fail_after_steps is not None and injected[0] >= spec.fail_after_steps:
            raise RuntimeError(f"injected failure after {injected[0]} steps (test only)")
    return seen, time.perf_counter() - started


def _epoch_record(t: _ViewTrainer, epoch: int, rsum, seen: int, seconds: float) -> dict:
    """A view's finished epoch as its history keeps it (epoch counted from 0; sums pooled)."""
    batches, pairs = max(t.epoch_batches, 1), max(t.epoch_targets["pairs"], 1.0)
    values = histogram_quantiles(t.weight_hist, WEIGHT_QUANTILES)
    quantiles = zip(WEIGHT_QUANTILES, values, strict=True)
    return {
        "epoch": epoch,
        "loss": t.epoch_loss_sum / batches,  # mean plain InfoNCE: all pairs, unweighted
        "objective": t.epoch_targets["objective"] / batches,  # mean of what was minimised
        "objective_name": t.objective,
        "val_rsum": rsum,
        "seconds": seconds,
        "samples_per_s": seen / max(seconds, 1e-9),
        "pairs": int(t.epoch_targets["pairs"]),
        "mean_weight": t.epoch_targets["weight"] / pairs,
        "weight_quantiles": {f"p{round(100 * q)}": v for q, v in quantiles},
        "reliable_pairs": int(t.epoch_targets["reliable"]),
        "proxy_pairs": int(t.epoch_targets["proxy"]),
    }


def epoch_line(message: dict) -> str:
    """The console line of a finished epoch (a message `_end_epoch` leaves for the driver);
    epochs counted from 1, each loss named."""
    line = (
        f"  round {message['round']} {message['view']} epoch {message['epoch'] + 1}/"
        f"{message['max_epochs']}: mean InfoNCE {message['loss']:.3f} (all pairs, unweighted)"
    )
    if message["objective_name"] != "InfoNCE":
        line += f", objective {message['objective_name']} {message['objective']:.3f}"
    if message["round_kind"] == "labels":
        line += f", mean pair weight {message['mean_weight']:.2f}"
    if message["val_rsum"] is not None:
        line += f", validation rSum {message['val_rsum']:.1f}"
    line += f", {message['samples_per_s']:.0f} samples/s"
    return line + (f"; stop: {message['stop']}" if message["stop"] else "")


def _end_epoch(spec, t: _ViewTrainer, epoch: int, rsum, seen, seconds, rank, board=None):
    """Record a view's epoch, advance its warm-up state (validation rSum), checkpoint, and
    leave the epoch's numbers for the driver (its console line and tracker)."""
    record = _epoch_record(t, epoch, rsum, seen, seconds)
    t.history.append(record)
    if spec.round_kind == "warmup":
        warm = spec.train.warmup
        t.warmup = update_warmup(
            t.warmup,
            epoch_loss=record["loss"],
            batch_size=spec.train.batch_size,
            rsum=rsum,
            max_epochs=spec.max_epochs,
            plateau_fraction=warm.plateau_fraction,
            patience=warm.patience,
        )
        if rank == 0 and rsum is not None and t.warmup.best_epoch == t.warmup.epochs_done:
            best = t.layout.best_model(spec.round_index, t.view.name)
            save_torch_atomic(t.loaded.model.state_dict(), best)
        t.stopped = t.warmup.stopped
    else:
        t.stopped = epoch + 1 >= spec.max_epochs
    t.epoch, t.step_in_epoch = epoch + 1, 0
    t.new_epoch()
    if rank == 0:
        t.save()
        stop = t.warmup.reason if t.stopped and spec.round_kind == "warmup" else ""
        _say(
            board,
            {
                **record,
                "round": spec.round_index,
                "round_kind": spec.round_kind,
                "view": t.view.name,
                "max_epochs": spec.max_epochs,
                "stop": stop,
            },
        )


def _eval_set(spec: TrainSpec, shards: tuple[str, ...], trainer: _ViewTrainer):
    """A held-out split decoded once with the models' preprocessing (None without shards)."""
    if not shards:
        return None
    from pipeline.stages.train.evaluation import load_eval_set

    loaded = trainer.loaded
    return load_eval_set(shards, loaded.preprocess, loaded.tokenizer, spec.decode)


def _finish(spec: TrainSpec, trainers: list[_ViewTrainer]) -> None:
    """Keep each view's final weights, evaluate them (A, B, A+B) and write the summary last."""
    layout = RunLayout(spec.output)
    summary: dict[str, Any] = {
        "round": spec.round_index,
        "round_kind": spec.round_kind,
        "views": {},
        "retrieval": None,
    }
    for t in trainers:
        best = (
            load_torch(layout.best_model(spec.round_index, t.view.name))
            if (spec.round_kind == "warmup" and t.warmup.best_epoch is not None)
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
            "warmup": t.warmup.to_dict() if spec.round_kind == "warmup" else None,
            "kept_epoch": t.warmup.best_epoch if best is not None else t.epoch,
            "checkpoint": layout.model_checkpoint(spec.round_index, t.view.name),
        }
    test_set = _eval_set(spec, spec.test_shards, trainers[0])
    if test_set is not None:
        from pipeline.stages.train.evaluation import evaluate_models

        summary["retrieval"] = evaluate_models({t.view.name: t.loaded for t in trainers}, test_set)
        summary["retrieval_test_pairs"] = test_set.n_texts
    if spec.run_state is not None:
        summary[RUN_STATE_FIELD] = spec.run_state
    write_json_atomic(summary, layout.train_summary(spec.round_index))
    # A finished round is never resumed and model.pt holds the weights it kept: the resume
    # state (weights and optimizer moments) and the best epoch's copy would only take space.
    for t in trainers:
        remove_path(layout.resume_state(spec.round_index, t.view.name))
        remove_path(layout.best_model(spec.round_index, t.view.name))
