"""A model's pixels and texts a chunk at a time, on its device (the embed pass's feeding).

Contract (part of :mod:`pipeline.models`; `pipeline.stages.embed` wires it to the shards):

* :func:`pixel_plan` turns ``embed.decode`` (``cpu`` | ``device``, resolved) and a loaded
  model into a :class:`PixelPlan`: ``cpu`` decodes with PIL in the decode threads and resizes
  and crops to uint8 there (:func:`image_pixels`); ``device`` leaves JPEGs undecoded for
  :func:`chunk_pixels`, which decodes a chunk of them batched on the model's device (nvJPEG on
  a GPU) and resizes and crops there (``auto`` is resolved per cluster by the embed stage).
  Either way a chunk is normalised at once on the device: on the CPU path bit-identical to
  open_clip's eval transform, on the device path within 2 uint8 levels (tests/test_pixels.py).
* A model whose transform :func:`pixel_spec` does not describe keeps its own transform in the
  threads (float32 pixels); asking it for ``device`` decode raises ``ValueError``.
* :class:`ShardTexts` tokenizes each chunk's captions once, in the decode threads, for every
  view of one tokenizer; the text tower then runs once per shard in forward batches.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pipeline.models.encode import (
    PixelSpec,
    decode_jpegs,
    encode_texts,
    normalize_pixels,
    pil_pixels,
    pixel_spec,
    resize_crop,
)
from pipeline.models.spec import LoadedClip

__all__ = ["PixelPlan", "ShardTexts", "chunk_pixels", "image_pixels", "pixel_plan"]


@dataclass(frozen=True)
class PixelPlan:
    """How one worker turns images into the model's pixels."""

    device: torch.device  # the model's: where pixels are normalised (and JPEGs decoded)
    on_device: bool  # JPEGs decoded on `device` (embed.decode device)
    pixels: PixelSpec | None  # None: the model's own transform, in the threads
    preprocess: Callable  # that transform (open_clip's eval transform)


def pixel_plan(decode: str, loaded: LoadedClip) -> PixelPlan:
    """The plan for `embed.decode` ("cpu" | "device", as `stages.embed.decode_on` resolved it
    for the cluster) and a loaded model.

    A model whose transform is not resize + crop + normalise (SigLIP's and DFN's squash)
    keeps that transform in the threads: "device" then came from `auto`, since the run refuses
    an explicit `embed.decode: device` for such a model before it starts (`run.specs`).

    Raises:
        ValueError: a decode other than "cpu" or "device".
    """
    if decode not in ("cpu", "device"):
        raise ValueError(f"embed.decode {decode!r} is not resolved to cpu or device")
    try:
        spec = pixel_spec(loaded.preprocess)
    except ValueError:
        return PixelPlan(loaded.device, False, None, loaded.preprocess)
    return PixelPlan(loaded.device, decode == "device", spec, loaded.preprocess)


def image_pixels(image, plan: PixelPlan):
    """Decode-thread part: a PIL RGB image's (3, H, W) pixels at model resolution: uint8, or
    float32 from the model's own transform."""
    if plan.pixels is None:
        return plan.preprocess(image)
    return pil_pixels(image, plan.pixels)


def chunk_pixels(pixels: list, plan: PixelPlan) -> tuple[list[str | None], torch.Tensor]:
    """Main-thread part: a chunk's pixels as one normalised batch on the model's device.

    Args:
        pixels: per sample, `image_pixels` output, or the JPEG bytes left to the device.

    Returns:
        (per sample None, or why its JPEG did not decode; (B_ok, 3, H, W) float32 normalised
        pixels of the others on `plan.device`, in order).
    """
    left = [i for i, p in enumerate(pixels) if isinstance(p, bytes)]
    decoded = decode_jpegs([pixels[i] for i in left], plan.device)
    rows = [None if isinstance(p, bytes) else torch.as_tensor(p) for p in pixels]
    errors: list[str | None] = [None] * len(pixels)
    good = []
    for i, image in zip(left, decoded, strict=True):
        if isinstance(image, str):
            errors[i] = image
        else:
            good.append((i, image))
    spec = plan.pixels  # not None: only a plan with a PixelSpec leaves JPEGs or uint8 here
    if good:
        assert spec is not None
        resized = resize_crop([image for _, image in good], spec)
        for (i, _), image in zip(good, resized, strict=True):
            rows[i] = image  # (3, H, W) uint8 on the device
    kept = [r.to(plan.device, non_blocking=True) for r in rows if r is not None]
    if not kept:
        return errors, torch.empty((0, 3, 1, 1), device=plan.device)
    batch = torch.stack(kept)  # (B_ok, 3, H, W)
    if batch.dtype == torch.uint8:
        assert spec is not None
        batch = normalize_pixels(batch, spec)
    return errors, batch


@dataclass
class ShardTexts:
    """A shard's captions, tokenized in the decode threads once per tokenizer (views of one
    model name share it), and encoded a chunk behind: the newest chunk's tokens may still be
    in the threads, and the text tower then runs while the next chunk decodes."""

    pool: ThreadPoolExecutor
    views: dict[str, tuple[str, LoadedClip]]  # view -> (model name: its tokenizer, model)
    batch: int  # texts per forward
    futures: list[dict[str, Future]] = field(default_factory=list)  # per chunk, per name

    def add(self, captions: list[str]) -> None:
        names = {name: loaded.tokenizer for name, loaded in self.views.values()}
        self.futures.append({n: self.pool.submit(t, captions) for n, t in names.items()})

    def encode(self, out: dict[str, list[torch.Tensor]], keep: int = 0) -> None:
        """Append to `out[view]` the (n, D) float32 CPU text embeddings of every chunk added
        but the newest `keep`, in order, in forward batches of `self.batch`."""
        ready = self.futures[: len(self.futures) - keep]
        self.futures = self.futures[len(ready) :]
        for chunk in ready:
            for view, (name, loaded) in self.views.items():
                tokens = chunk[name].result()  # (n, L)
                for start in range(0, len(tokens), self.batch):
                    emb = encode_texts(loaded, tokens[start : start + self.batch])
                    out.setdefault(view, []).append(emb.cpu())
