"""The embed pass's worker side: one tar shard -> its embeddings table (and quarantine),
on a GPU actor (`EmbedShardStage`) or a pooled CPU task (`embed_shards_on_cpu`)."""

from __future__ import annotations

import json
import time
import zlib
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from pipeline.config import EmbedConfig
from pipeline.core.losses.per_sample import batched_losses, fixed_size_loss_batches
from pipeline.io.admitted import (
    SHARD_BYTES_KEY,
    SHARD_SHA256_KEY,
    SHARD_SIGNATURE_KEY,
    ShardReference,
    file_signature,
    fingerprint_change,
    read_reference,
)
from pipeline.io.clip_retrieval import (
    EmbeddingLookup,
    EmbeddingsFolder,
    check_dim,
)
from pipeline.io.decode import sample_pixels, undecodable
from pipeline.io.labels import uid_of
from pipeline.io.layout import STAGE_KEY_META, RunLayout
from pipeline.io.records import quarantine_columns
from pipeline.io.shards import (
    DecodedSample,
    DecodeOptions,
    Rejection,
    ShardReadError,
    ShardReadStats,
    decode_record,
    iter_shard_records,
    qualify_key,
    shard_name,
    split_source,
)
from pipeline.io.tables import QUARANTINE_SCHEMA, embedding_schema, write_table_atomic
from pipeline.models import LoadedClip, ModelSpec, encode_pairs, load_clip
from pipeline.models.encode import encode_images
from pipeline.models.pixels import PixelPlan, ShardTexts, chunk_pixels, image_pixels, pixel_plan
from pipeline.models.weights import weights_version
from pipeline.runtime.devices import granted_device

SUMMARY_COLUMNS = (
    "shard",
    "path",
    "records",
    "embedded",
    "quarantined",
    "reasons",  # JSON object: quarantine reason -> count
    "ignored_members",  # JSON object: member extension -> count
    "short_batches",  # 1 when the shard had fewer samples than the loss batch
    "seconds",
    "error",  # the shard could not be read at all: nothing written but quarantine; rerun retries
    "warning",  # the tar broke part-way: samples before the break are kept, the break quarantined
    "changed",  # rounds >= 1: the tar is not the file round 0 read (nothing written)
    "bytes",  # the tar's size as read (-1 when not read completely)
    "sha256",  # the tar's sha256 as read ("" when not read completely)
    "ingested",  # pairs whose embeddings came from embed.from_embeddings
    "not_ingested",  # JSON: {"reasons": {why: count}, "examples": [key, ...]} (model-embedded)
)
NOT_INGESTED_EXAMPLES = 3  # keys named per shard and per pass when pairs were not ingested


@dataclass(frozen=True)
class EmbedSpec:
    """Everything an embed worker needs; plain data so Ray can ship it to workers."""

    output: str  # run directory
    round_index: int
    views: dict[str, ModelSpec]  # view name ("a", "b") -> model; one pass scores every view
    seed: int
    embed: EmbedConfig = field(default_factory=EmbedConfig)  # the job's embed section
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    write_quarantine: bool = True  # only round 0 records quarantine; later rounds re-read
    device: str = "auto"
    shard_keys: Mapping[str, str] = field(default_factory=dict)  # shard -> run-state key (footer)
    source: EmbeddingsFolder | None = None  # round 0's clip-retrieval embeddings, if any
    source_name: str | None = None  # the input source they embedded (None: input.shards)


@dataclass
class _ShardBuffers:
    """What one shard accumulates between decoding and writing."""

    keys: list[str] = field(default_factory=list)
    urls: list[str | None] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)
    image_sha256: list[str] = field(default_factory=list)  # hex, of the raw image bytes
    uids: list[str] = field(default_factory=list)  # 32 hex digits (uid_of)
    image_embeddings: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    text_embeddings: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    rejections: list[Rejection] = field(default_factory=list)
    not_ingested: Counter = field(default_factory=Counter)  # why -> pairs the model embedded
    not_ingested_keys: list[str] = field(default_factory=list)  # the first few
    ingesting: bool = False  # the shard's embeddings come from spec.source


def _preprocess(sample: DecodedSample | Rejection, plan: PixelPlan, lookup, prefix: str):
    """(sample, its pixels, its row in `lookup` (-1: none), why not); pixels only for the
    pairs the model embeds (a JPEG's bytes when the device decodes it)."""
    if isinstance(sample, Rejection):
        return sample, None, -1, ""
    why = ""
    if lookup is not None:
        found, reasons = lookup.find([sample.key.removeprefix(prefix)], [sample.caption])
        if found[0] >= 0:
            return sample, None, int(found[0]), ""
        why = reasons[0]
    pixels = sample_pixels(sample, lambda image: image_pixels(image, plan), plan.on_device)
    if isinstance(pixels, Rejection):
        return pixels, None, -1, ""
    return sample, pixels, -1, why


# This worker process's lookup of its last round-0 pass from embeddings (one folder at a time).
_process_lookups: dict[EmbeddingsFolder, EmbeddingLookup] = {}


def _shard_lookup(spec: EmbedSpec, path: str) -> tuple[EmbeddingLookup | None, str]:
    """The lookup a round-0 shard reads its embeddings from, and the prefix its keys carry
    beyond the folder's (its source's); (None, "") when the model embeds the shard."""
    source, _ = split_source(path)
    if spec.source is None or spec.round_index != 0 or source != spec.source_name:
        return None, ""
    if spec.source not in _process_lookups:
        _process_lookups.clear()
        _process_lookups[spec.source] = EmbeddingLookup(spec.source)
    return _process_lookups[spec.source], qualify_key(source, "")


def _load_views(spec: EmbedSpec) -> dict[str, LoadedClip]:
    # "auto" follows Ray's grant: a 0-GPU worker on a GPU node stays on CPU, and a granted
    # GPU that CUDA cannot use fails here, not by silently embedding on CPU.
    device = granted_device("embed worker") if spec.device == "auto" else spec.device
    return {view: load_clip(model, device) for view, model in spec.views.items()}


def _embed_paths(paths, spec: EmbedSpec, models, pool) -> dict[str, np.ndarray]:
    # No grad-mode switch here: encode_pairs runs the models under no_grad, and a pooled CPU
    # worker runs other tasks after this one.
    rows = [embed_shard(str(path), spec, models, pool) for path in paths]
    return {column: np.array([row[column] for row in rows]) for column in SUMMARY_COLUMNS}


class EmbedShardStage:
    """Ray Data actor (the GPU pass): loads the views' models once onto its GPU, then embeds
    one shard per input row."""

    def __init__(self, spec: EmbedSpec):
        self.spec = spec
        self.models = _load_views(spec)
        self.pool = ThreadPoolExecutor(max_workers=spec.embed.decode_threads)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _embed_paths(batch["path"], self.spec, self.models, self.pool)


# This worker process's models of its last CPU pass, under the key of `_views_key`.
_process_views: dict[tuple, tuple[dict[str, LoadedClip], ThreadPoolExecutor]] = {}


def _views_key(spec: EmbedSpec) -> tuple:
    """What the loaded models depend on: a checkpoint rewritten at the same path (a retrained
    round of a rerun) gets a new key through its file's version."""
    views = tuple(
        (view, model, weights_version(model.pretrained)) for view, model in spec.views.items()
    )
    return views, spec.device, cpu_threads(spec.embed)


def cpu_threads(embed: EmbedConfig) -> tuple[int, int]:
    """(torch threads, decode threads) of a CPU worker: one per CPU it holds, the decode's
    capped there too, since every other core runs another worker (docs/benchmarks.md, Embed)."""
    cpus = max(1, int(embed.cpus_per_worker))
    return cpus, min(embed.decode_threads, cpus)


def embed_shards_on_cpu(batch: dict[str, np.ndarray], spec: EmbedSpec) -> dict[str, np.ndarray]:
    """Ray Data task (the CPU pass): embeds one shard per input row on a pooled Ray worker.

    Why tasks and not actors on CPU: Ray keeps idle task workers alive between passes (and
    between the jobs of one driver), torch and open_clip already imported and the last pass's
    models loaded, where each actor pool starts new processes that import both again (most of
    a small pass; docs/development.md). A GPU pass keeps its actors, which pin one device each.
    """
    key = _views_key(spec)
    torch_threads, decode_threads = cpu_threads(spec.embed)
    if key not in _process_views:
        for _, old_pool in _process_views.values():
            old_pool.shutdown()
        _process_views.clear()  # one pass's models at a time: a worker's memory stays bounded
        _process_views[key] = (
            _load_views(spec),
            ThreadPoolExecutor(max_workers=decode_threads),
        )
    models, pool = _process_views[key]
    # Set for every task: a pooled worker's torch keeps the thread count of whichever task
    # used it first.
    torch.set_num_threads(torch_threads)
    return _embed_paths(batch["path"], spec, models, pool)


def _decode_chunk(records, spec: EmbedSpec, plan: PixelPlan, pool, lookup=(None, "")):
    """Decode + preprocess a chunk of raw records on the thread pool (returns futures)."""

    def work(record):
        sample = decode_record(record, spec.decode, pixels=not plan.on_device)
        return _preprocess(sample, plan, *lookup)

    return [pool.submit(work, record) for record in records]


def _ingest_or_encode(lookup: EmbeddingLookup, loaded: LoadedClip, images, captions, rows):
    """(B, D) float32 image and text embeddings: the folder's rows where `rows` >= 0
    (L2-normalised in fp32, as `encode_pairs` returns them), the model's for the others."""
    check_dim(lookup.folder, loaded.embed_dim, loaded.model_id)
    rows = np.asarray(rows)
    have, missing = np.flatnonzero(rows >= 0), np.flatnonzero(rows < 0)
    image_emb = torch.zeros((len(rows), loaded.embed_dim))
    text_emb = torch.zeros_like(image_emb)
    if len(have):
        image, text = lookup.read(rows[have])  # (n, D) the folder's dtype
        image_emb[have] = F.normalize(torch.from_numpy(image.astype(np.float32)), dim=-1)
        text_emb[have] = F.normalize(torch.from_numpy(text.astype(np.float32)), dim=-1)
    if len(missing):
        pixels = torch.stack([images[i] for i in missing])  # (m, 3, H, W)
        tokens = loaded.tokenizer([captions[i] for i in missing])
        image, text, _ = encode_pairs(loaded, pixels, tokens)
        image_emb[missing], text_emb[missing] = image.cpu(), text.cpu()
    return image_emb, text_emb


def _chunk_results(futures, plan: PixelPlan) -> tuple[list, torch.Tensor]:
    """The chunk's results (device decode failures as rejections) and pixels of row < 0."""
    results = [future.result() for future in futures]
    need = [i for i, r in enumerate(results) if r[2] < 0 and not isinstance(r[0], Rejection)]
    errors, batch = chunk_pixels([results[i][1] for i in need], plan)
    for i, error in zip(need, errors, strict=True):
        if error is not None:
            results[i] = (undecodable(results[i][0], error), None, -1, "")
    return results, batch


def _embed_decoded(futures, buffers: _ShardBuffers, models, plan, texts, lookup=None) -> None:
    """Collect a decoded chunk, run the image towers (or read embeddings), keep its texts."""
    results, pixels = _chunk_results(futures, plan)
    images, captions, rows = [], [], []
    modelled = iter(pixels)  # the rows of `pixels`: the samples with row < 0, in order
    for sample, _, row, why in results:
        if isinstance(sample, Rejection):
            buffers.rejections.append(sample)
            continue
        buffers.keys.append(sample.key)
        buffers.urls.append(sample.url)
        buffers.captions.append(sample.caption)
        buffers.image_sha256.append(sample.image_sha256)
        buffers.uids.append(uid_of(sample.key, sample.meta.get("uid")))
        captions.append(sample.caption)
        images.append(next(modelled) if row < 0 else None)
        rows.append(row)
        if why:
            buffers.not_ingested[why] += 1
            if len(buffers.not_ingested_keys) < NOT_INGESTED_EXAMPLES:
                buffers.not_ingested_keys.append(sample.key)
    if not captions:
        return
    for view, loaded in models.items():
        if lookup is not None:
            image_emb, text_emb = _ingest_or_encode(lookup, loaded, images, captions, rows)
            buffers.image_embeddings.setdefault(view, []).append(image_emb)
            buffers.text_embeddings.setdefault(view, []).append(text_emb)
            continue
        image_emb = encode_images(loaded, pixels)  # (B, D)
        buffers.image_embeddings.setdefault(view, []).append(image_emb.cpu())
    if lookup is None:
        texts.add(captions)
        texts.encode(buffers.text_embeddings, keep=1)


def _fixed_list(matrix: np.ndarray) -> pa.FixedSizeListArray:
    flat = pa.array(matrix.astype(np.float16).reshape(-1), type=pa.float16())
    return pa.FixedSizeListArray.from_arrays(flat, matrix.shape[1])


def _read_shard(
    path: str,
    spec: EmbedSpec,
    models: dict[str, LoadedClip],
    pool: ThreadPoolExecutor,
    stats: ShardReadStats,
    admitted: frozenset[str] | None,
) -> _ShardBuffers:
    """Stream, decode and embed one shard; only `admitted` keys when given (rounds >= 1)."""
    lookup, prefix = _shard_lookup(spec, path)
    buffers = _ShardBuffers(ingesting=lookup is not None)
    plan = pixel_plan(spec.embed.decode, next(iter(models.values())))
    views = {view: (spec.views[view].name, loaded) for view, loaded in models.items()}
    texts = ShardTexts(pool, views, spec.embed.forward_batch_size)
    pending = None  # futures of the chunk being decoded while the previous one is embedded
    chunk: list = []
    for item in iter_shard_records(path, stats):
        if admitted is not None and item.key not in admitted:
            continue  # quarantined or a corpus-wide duplicate in round 0
        if isinstance(item, Rejection):
            buffers.rejections.append(item)
            continue
        chunk.append(item)
        if len(chunk) == spec.embed.forward_batch_size:
            futures = _decode_chunk(chunk, spec, plan, pool, (lookup, prefix))
            if pending is not None:
                _embed_decoded(pending, buffers, models, plan, texts, lookup)
            pending, chunk = futures, []
    tail = _decode_chunk(chunk, spec, plan, pool, (lookup, prefix)) if chunk else None
    for futures in (pending, tail):
        if futures is not None:
            _embed_decoded(futures, buffers, models, plan, texts, lookup)
    texts.encode(buffers.text_embeddings)
    return buffers


def embed_shard(
    path: str,
    spec: EmbedSpec,
    models: dict[str, LoadedClip],
    pool: ThreadPoolExecutor,
) -> dict:
    """Embed one shard and write its tables. Returns the shard's summary row."""
    started = time.perf_counter()
    shard = shard_name(path)
    layout = RunLayout(spec.output)
    stats = ShardReadStats()
    reference: ShardReference | None = None
    if spec.round_index > 0:
        reference = read_reference(layout.embeddings(0, shard))
    error = changed = ""
    signature = file_signature(path)  # before reading: a rewrite while read then shows later
    try:
        buffers = _read_shard(
            path, spec, models, pool, stats, reference.keys if reference else None
        )
    except ShardReadError as exc:
        # Nothing of this shard can be trusted: record it, write no embeddings (a rerun retries).
        error = str(exc)
        buffers = _ShardBuffers(
            rejections=[Rejection(None, shard, None, "unreadable_shard", error)]
        )
    if reference is not None and not error:
        changed = fingerprint_change(path, reference, stats.size, stats.sha256) or ""

    n = len(buffers.keys)
    if spec.write_quarantine:
        quarantine = pa.table(quarantine_columns(buffers.rejections))
        write_table_atomic(quarantine, layout.quarantine(shard), QUARANTINE_SCHEMA)
    if not error and not changed:
        _write_embeddings(shard, spec, models, buffers, layout, stats, signature)

    reasons = Counter(r.reason for r in buffers.rejections)
    return {
        "shard": shard,
        "path": path,
        "records": stats.records,
        "embedded": n,
        "quarantined": len(buffers.rejections),
        "reasons": json.dumps(dict(sorted(reasons.items()))),
        "ignored_members": json.dumps(dict(sorted(stats.ignored_members.items()))),
        "short_batches": int(0 < n < spec.embed.batch_size),
        "seconds": time.perf_counter() - started,
        "error": error,
        "warning": "" if error else (stats.error or ""),
        "changed": changed,
        "bytes": stats.size if stats.size is not None else -1,
        "sha256": stats.sha256 or "",
        "ingested": n - sum(buffers.not_ingested.values()) if buffers.ingesting else 0,
        "not_ingested": json.dumps(
            {"reasons": dict(buffers.not_ingested), "examples": buffers.not_ingested_keys}
        ),
    }


def _write_embeddings(
    shard: str,
    spec: EmbedSpec,
    models: dict[str, LoadedClip],
    buffers: _ShardBuffers,
    layout: RunLayout,
    stats: ShardReadStats,
    signature: str | None,
) -> None:
    n = len(buffers.keys)
    rng = np.random.default_rng([spec.seed, spec.round_index, zlib.crc32(shard.encode())])
    batchings = [
        fixed_size_loss_batches(n, spec.embed.batch_size, rng)
        for _ in range(spec.embed.loss_permutations)
    ]
    columns: dict[str, object] = {
        "key": buffers.keys,
        "shard": [shard] * n,
        "url": buffers.urls,
        "caption": buffers.captions,
        "image_sha256": buffers.image_sha256,
        "uid": buffers.uids,
    }
    metadata = {
        "ncl.schema": "embeddings.v1",
        "ncl.round": str(spec.round_index),
        "ncl.batch_size": str(spec.embed.batch_size),
        "ncl.loss_permutations": str(spec.embed.loss_permutations),
        "ncl.seed": str(spec.seed),
    }
    if shard in spec.shard_keys:
        metadata[STAGE_KEY_META] = spec.shard_keys[shard]
    if stats.sha256 is not None:  # the file as read: later readers check they read the same
        metadata[SHARD_BYTES_KEY] = str(stats.size)
        metadata[SHARD_SHA256_KEY] = stats.sha256
        if signature is not None:
            metadata[SHARD_SIGNATURE_KEY] = signature
    dim = 0
    batch_ids = np.zeros(n, dtype=np.int32)
    for view, loaded in models.items():
        dim, logit_scale = loaded.embed_dim, loaded.logit_scale
        if n:
            image_emb = torch.cat(buffers.image_embeddings[view])  # (N, D) float32
            text_emb = torch.cat(buffers.text_embeddings[view])
        else:
            image_emb = torch.zeros((0, dim))
            text_emb = torch.zeros((0, dim))
        losses = batched_losses(image_emb, text_emb, logit_scale, batchings)
        batch_ids = losses["batch"]
        columns[f"image_embedding_{view}"] = _fixed_list(image_emb.numpy())
        columns[f"text_embedding_{view}"] = _fixed_list(text_emb.numpy())
        columns[f"cosine_{view}"] = (image_emb * text_emb).sum(dim=1).numpy().astype(np.float32)
        columns[f"loss_i2t_{view}"] = losses["i2t"]
        columns[f"loss_t2i_{view}"] = losses["t2i"]
        columns[f"loss_triplet_{view}"] = losses["triplet"]
        metadata[f"ncl.model_id.{view}"] = loaded.model_id
        metadata[f"ncl.logit_scale.{view}"] = repr(logit_scale)
    schema = embedding_schema(list(models), dim, metadata)
    ordered = {name: columns[name] if name != "loss_batch" else batch_ids for name in schema.names}
    table = pa.table(ordered, schema=schema)
    write_table_atomic(table, layout.embeddings(spec.round_index, shard), schema)


# ------------------------------------------------------------------------------------------
# Driver side: the thin Ray Data wrapper.
