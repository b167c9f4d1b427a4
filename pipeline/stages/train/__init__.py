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
  `train_summary.json` goes last. Whether a round runs at all is the run state's decision
  (`pipeline.run.state`); it deletes a round's checkpoints before training it under a new key.
- Warm-up (`mode="warmup"`): loss on all pairs, or (`select`) on the ⌊ε·b⌋ lowest-loss pairs of
  each batch once the model has left the chance plateau; length adapts (pipeline.core.schedule).
- Co-teaching (`mode="labels"`): each view joins its own label table (the PEER's labels) and
  turns rows into training targets with `pipeline.core.coteach.training_targets` for the
  epoch's phase (`coteach_phase` over all rounds' epochs, `coteach_epochs`): a per-pair weight
  for weighted InfoNCE (or BiCro's soft margin), SPS's reliable flag (L_cro + L_met on those
  rows), SPS's proxy caption in place of a noisy pair's caption, and the proxy rows added
  beside the pairs (assign's rematches, both directions; SPS's text direction). Mixed subsets
  share one
  batch and one optimizer step (the references step once per subset loader); weight-0 pairs
  stay in the batch as negatives. The LR follows one warm-up + cosine over all rounds.
"""

from pipeline.stages.train.data import epoch_shard_order, read_training_batches
from pipeline.stages.train.driver import run_training
from pipeline.stages.train.spec import TrainSpec, ViewSpec

__all__ = ["TrainSpec", "ViewSpec", "epoch_shard_order", "read_training_batches", "run_training"]
