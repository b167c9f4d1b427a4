"""Retrieval evaluation on clean held-out shards (the papers' R@1/5/10 and rSum).

Contract:
- `load_eval_set` decodes the test shards once (they are small: 1k-25k pairs) with the same
  decode + preprocessing as the embed pass. Images are de-duplicated by the SHA-256 of their
  bytes, so a corpus with several captions per image (COCO/F30K style: one tar sample per
  caption) is scored the papers' way: an image query hits if ANY of its captions is in the top K.
- `evaluate_models` embeds the set with each model, and also scores the average of the
  models' similarity matrices (co-teaching inference: A and B averaged).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.core.metrics import retrieval_recall, similarity_for_eval
from pipeline.io.shards import DecodeOptions, Rejection, decode_record, iter_shard_records
from pipeline.models import LoadedClip, encode_pairs

__all__ = ["EvalSet", "load_eval_set", "embed_eval_set", "evaluate_models"]


@dataclass
class EvalSet:
    pixels: torch.Tensor  # (n_images, 3, H, W) float32, one row per unique image
    tokens: torch.Tensor  # (n_texts, L) int64
    text_to_image: np.ndarray  # (n_texts,) int64: row of `pixels` each caption describes
    rejected: int  # test samples that could not be decoded (counted, not silently dropped)

    @property
    def n_images(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def n_texts(self) -> int:
        return int(self.tokens.shape[0])


def load_eval_set(
    shard_paths: Sequence[str],
    preprocess: Callable,
    tokenizer: Callable,
    options: DecodeOptions | None = None,
) -> EvalSet:
    """Decode the held-out shards into tensors (de-duplicating images by content hash)."""
    options = options or DecodeOptions()
    image_rows: dict[str, int] = {}
    pixels: list[torch.Tensor] = []
    captions: list[str] = []
    text_to_image: list[int] = []
    rejected = 0
    for path in shard_paths:
        for record in iter_shard_records(path):
            if isinstance(record, Rejection):
                rejected += 1
                continue
            sample = decode_record(record, options)
            if isinstance(sample, Rejection):
                rejected += 1
                continue
            image_bytes = next(
                (
                    record.members[ext]
                    for ext in ("jpg", "jpeg", "png", "webp")
                    if ext in record.members
                ),
                b"",
            )
            digest = hashlib.sha256(image_bytes).hexdigest()
            if digest not in image_rows:
                image_rows[digest] = len(pixels)
                pixels.append(preprocess(sample.image))
            captions.append(sample.caption)
            text_to_image.append(image_rows[digest])
    if not captions:
        raise ValueError(f"no usable test pairs in {list(shard_paths)[:3]}")
    return EvalSet(
        pixels=torch.stack(pixels),
        tokens=tokenizer(captions),
        text_to_image=np.asarray(text_to_image, dtype=np.int64),
        rejected=rejected,
    )


def embed_eval_set(
    loaded: LoadedClip, eval_set: EvalSet, batch_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_images, D) and (n_texts, D) float32 L2-normalised embeddings, model in eval mode."""
    was_training = loaded.model.training
    loaded.model.eval()
    try:
        images, texts = [], []
        n = max(eval_set.n_images, eval_set.n_texts)
        for start in range(0, n, batch_size):
            pix = eval_set.pixels[start : start + batch_size]
            tok = eval_set.tokens[start : start + batch_size]
            # encode_pairs wants equal batch sizes; pad the shorter side by repeating row 0.
            size = max(len(pix), len(tok))
            pix_in = pix if len(pix) == size else _pad(pix, size, eval_set.pixels[:1])
            tok_in = tok if len(tok) == size else _pad(tok, size, eval_set.tokens[:1])
            image_emb, text_emb, _ = encode_pairs(loaded, pix_in, tok_in)
            images.append(image_emb[: len(pix)].cpu())
            texts.append(text_emb[: len(tok)].cpu())
        return torch.cat(images), torch.cat(texts)
    finally:
        loaded.model.train(was_training)


def _pad(rows: torch.Tensor, size: int, filler: torch.Tensor) -> torch.Tensor:
    missing = size - len(rows)
    return torch.cat([rows, filler.expand(missing, *filler.shape[1:])]) if missing else rows


def evaluate_models(models: Mapping[str, LoadedClip], eval_set: EvalSet) -> dict[str, dict]:
    """Recall@1/5/10 both directions and rSum for each model and for their averaged similarity.

    Returns:
        {view: metrics, ..., "+".join(views): metrics of the averaged similarity (when 2 views)}.
    """
    embeddings = {view: embed_eval_set(loaded, eval_set) for view, loaded in models.items()}
    results = {}
    for view, (image_emb, text_emb) in embeddings.items():
        sim = similarity_for_eval(image_emb, text_emb)
        results[view] = retrieval_recall(sim, eval_set.text_to_image)
    if len(embeddings) == 2:
        (va, (ua, ta)), (vb, (ub, tb)) = embeddings.items()
        results[f"{va}+{vb}"] = retrieval_recall(
            similarity_for_eval(ua, ta, ub, tb), eval_set.text_to_image
        )
    return results
