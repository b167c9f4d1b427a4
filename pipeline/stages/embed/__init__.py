"""Embed pass: shards -> per-shard embeddings, cosines and per-sample losses
(docs/architecture.md §2).

Contract:
- Unit of work: one tar shard. `EmbedShardStage` is a Ray Data callable class; each input row
  is a shard path and each output row a small per-shard summary (counts, timings). Per-sample
  data goes straight to `rounds/<r>/embeddings/<shard>.parquet` and never to the driver.
- Per shard it writes `quarantine/<shard>.parquet` first (when asked to), then the embeddings
  table, atomically, with the shard's run-state key in its footer (`ncl.stage_key`): the table
  is the shard's completion marker.
- Losses follow docs/methods.md §1: seeded, fixed-size batches of `batch_size` within the shard.
  Each row carries `image_sha256` and `uid`; round 0 may take embeddings from a clip-retrieval
  folder (`embed.from_embeddings`) and embeds what it lacks.
- Round 0 records the tar's fingerprint (size, sha256) in the footer; its keys are what later
  stages may use (`pipeline.io.admitted`). Rounds >= 1 embed only those keys and write nothing
  for a shard whose fingerprint changed.
"""

from pipeline.stages.embed.driver import decode_on, ray_requests, run_embed_pass, worker_options
from pipeline.stages.embed.shard import (
    SUMMARY_COLUMNS,
    EmbedShardStage,
    EmbedSpec,
    embed_shard,
    embed_shards_on_cpu,
)

__all__ = [
    "EmbedSpec",
    "EmbedShardStage",
    "SUMMARY_COLUMNS",
    "decode_on",
    "embed_shard",
    "embed_shards_on_cpu",
    "ray_requests",
    "run_embed_pass",
    "worker_options",
]
