"""Devices, precision and the forward pass: where a model runs and how pairs are embedded.

Contract (part of :mod:`pipeline.models.clip`):

* :func:`resolve_device` turns ``"auto"`` / ``"cpu"`` / ``"cuda[:i]"`` into a usable device or
  raises ``ValueError`` naming the fix.
* Weights always stay fp32; reduced precision is autocast only (:func:`autocast_dtype_for`), and
  a precision the device cannot autocast falls back to fp32 with a warning.
* :func:`encode_pairs` returns L2-normalised float32 embeddings and the CLIP temperature, so
  anything computed from the outputs (losses, cosines) is fp32; :func:`encode_images` and
  :func:`encode_texts` are its two towers, run apart (the embed pass encodes texts per shard).
* Pixels: :func:`pixel_spec` reads the size, crop and mean/std out of open_clip's eval
  transform; :func:`decode_pixels` decodes JPEG bytes batched with torchvision on any device
  (nvJPEG on CUDA) and resizes, crops and normalises there; :func:`pil_pixels` is the CPU
  path's resize + crop to uint8 and :func:`normalize_pixels` the shared last step, so a reader
  can ship uint8 and normalise on the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.models.spec import (
    DEFAULT_DEVICE,
    LOGIT_SCALE_MAX,
    PRECISIONS,
    LoadedClip,
    ModelLoadError,
)

__all__ = [
    "PixelSpec",
    "autocast_dtype_for",
    "bf16_native",
    "decode_jpegs",
    "decode_pixels",
    "encode_images",
    "encode_pairs",
    "encode_texts",
    "normalize_pixels",
    "pil_pixels",
    "pixel_spec",
    "resize_crop",
    "resolve_device",
]


def resolve_device(device: str | torch.device = DEFAULT_DEVICE) -> torch.device:
    """Turns a device request into a concrete ``torch.device``.

    Args:
        device: ``"auto"`` (CUDA when available, else CPU), or anything ``torch.device``
            accepts (``"cpu"``, ``"cuda"``, ``"cuda:1"``).

    Returns:
        The device.

    Raises:
        ValueError: CUDA was requested but is not usable in this process.
    """
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(
                f"Unknown device {device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:<index>'."
            ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"Device {str(dev)!r} requested but CUDA is not available in this process "
            "(CPU-only torch build, or no GPU assigned to this worker). Use device='auto' or 'cpu'."
        )
    return dev


def bf16_native(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively (compute capability 8.0+: Ampere and later).

    `torch.cuda.is_bf16_supported()` also counts emulation, which runs bf16 autocast on a
    T4/V100 far slower than fp32, and it asks about the current device, not `device`.
    """
    return torch.cuda.get_device_capability(device)[0] >= 8


def autocast_dtype_for(precision: str, device: torch.device) -> torch.dtype | None:
    """Maps a precision name to the autocast dtype this device supports (None = fp32).

    Unsupported combinations fall back to fp32 with a warning rather than failing, so a job
    written for a GPU cluster still runs (slower) on a laptop.
    """
    if precision not in PRECISIONS:
        raise ModelLoadError(
            f"Unknown precision {precision!r}: set model.precision to one of {list(PRECISIONS)}."
        )
    if precision == "fp32":
        return None
    if device.type == "cuda":
        if precision == "bf16" and not bf16_native(device):
            warnings.warn(
                f"bf16 requested but {torch.cuda.get_device_name(device)} does not support it; "
                "running in fp32 (set model.precision: fp16 for reduced precision on this GPU).",
                stacklevel=3,
            )
            return None
        return torch.bfloat16 if precision == "bf16" else torch.float16
    if device.type == "cpu":
        if precision == "bf16":
            return torch.bfloat16  # CPU autocast supports bf16 on every torch we allow
        warnings.warn(
            "fp16 requested on CPU, where autocast does not support it; running in fp32 "
            "(use model.precision: bf16 for reduced precision on CPU).",
            stacklevel=3,
        )
        return None
    warnings.warn(
        f"{precision} autocast is not wired up for device type {device.type!r}; running in fp32.",
        stacklevel=3,
    )
    return None


def _autocast(loaded: LoadedClip):
    dtype = loaded.autocast_dtype
    return torch.autocast(device_type=loaded.device.type, dtype=dtype, enabled=dtype is not None)


def encode_images(loaded: LoadedClip, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) float preprocessed pixels, any device -> (B, D) float32 L2-normalised
    image embeddings on ``loaded.device``."""
    images = images.to(loaded.device, dtype=torch.float32, non_blocking=True)  # (B, 3, H, W)
    with torch.no_grad():
        with _autocast(loaded):
            emb = loaded.model.encode_image(images)  # (B, D), autocast dtype
        # Normalise in fp32, outside autocast: a bf16 norm is only good to ~1e-2.
        return F.normalize(emb.float(), dim=-1)


def encode_texts(loaded: LoadedClip, tokens: torch.Tensor) -> torch.Tensor:
    """(B, L) int64 tokens, any device -> (B, D) float32 L2-normalised text embeddings."""
    tokens = tokens.to(loaded.device, dtype=torch.long, non_blocking=True)  # (B, L)
    with torch.no_grad():
        with _autocast(loaded):
            emb = loaded.model.encode_text(tokens)  # (B, D), autocast dtype
        return F.normalize(emb.float(), dim=-1)


def encode_pairs(
    loaded: LoadedClip, images: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Embeds a batch of image-text pairs.

    Args:
        loaded: From :func:`load_clip`.
        images: (B, 3, H, W) float, already preprocessed; any device.
        tokens: (B, L) int64 from ``loaded.tokenizer``; any device.

    Returns:
        image_emb: (B, D) float32, L2-normalised, on ``loaded.device``.
        text_emb: (B, D) float32, L2-normalised, on ``loaded.device``.
        logit_scale: ``exp(logit_scale)`` as a Python float, clamped at 100 like CLIP.

    Raises:
        ValueError: Shapes do not form a batch of pairs.
    """
    if images.ndim != 4 or tokens.ndim != 2 or images.shape[0] != tokens.shape[0]:
        raise ValueError(
            "encode_pairs expects images (B, 3, H, W) and tokens (B, L) with the same B; got "
            f"{tuple(images.shape)} and {tuple(tokens.shape)}."
        )
    img = encode_images(loaded, images)
    txt = encode_texts(loaded, tokens)
    scale = loaded.model.logit_scale.detach().float().exp().clamp(max=LOGIT_SCALE_MAX)
    return img, txt, float(scale.reshape(-1)[0].item())


# --------------------------------------------------------------------------------------------
# Pixels


@dataclass(frozen=True)
class PixelSpec:
    """What open_clip's eval transform does to an image, as data."""

    size: int  # shortest side resized to this (bicubic, antialiased), then a size x size crop
    mean: tuple[float, float, float]  # per channel, on [0, 1] pixels
    std: tuple[float, float, float]


def pixel_spec(preprocess: Callable) -> PixelSpec:
    """The :class:`PixelSpec` of an open_clip eval transform (``LoadedClip.preprocess`` or
    ``load_transforms``): Resize(shortest side, bicubic), CenterCrop(square), to-tensor,
    Normalize.

    Raises:
        ValueError: the transform is not of that shape (another resize mode or interpolation),
            naming it; decode such a model's images on CPU (``embed.decode: cpu``).
    """
    from torchvision.transforms import CenterCrop, InterpolationMode, Normalize, Resize

    steps = list(getattr(preprocess, "transforms", []))
    resize = next((t for t in steps if isinstance(t, Resize)), None)
    crop = next((t for t in steps if isinstance(t, CenterCrop)), None)
    norm = next((t for t in steps if isinstance(t, Normalize)), None)
    size = resize.size if resize is not None else None
    size = size[0] if isinstance(size, (list, tuple)) and len(size) == 1 else size
    if (
        resize is None
        or crop is None
        or norm is None
        or not isinstance(size, int)
        or resize.interpolation != InterpolationMode.BICUBIC
        or tuple(crop.size) != (size, size)
    ):
        shown = ", ".join(repr(step) for step in steps) if steps else repr(preprocess)
        raise ValueError(
            f"the model's image transform is not resize-shortest-side + square centre crop + "
            f"normalise ({shown}); use embed.decode: cpu for this model"
        )
    return PixelSpec(size=size, mean=tuple(norm.mean), std=tuple(norm.std))


def pil_pixels(image, spec: PixelSpec) -> np.ndarray:
    """A PIL RGB image -> (3, size, size) uint8: the eval transform's resize and crop, exactly
    (torchvision's own PIL ops), without the float conversion."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    image = TF.resize(image, spec.size, interpolation=InterpolationMode.BICUBIC, antialias=True)
    image = TF.center_crop(image, [spec.size, spec.size])
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def normalize_pixels(pixels: torch.Tensor, spec: PixelSpec) -> torch.Tensor:
    """(B, 3, H, W) uint8 on any device -> float32 ``(x / 255 - mean) / std`` there: the same
    operations, in the same order, as the eval transform's to-tensor and Normalize."""
    mean = torch.tensor(spec.mean, dtype=torch.float32, device=pixels.device).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float32, device=pixels.device).view(1, 3, 1, 1)
    return pixels.to(torch.float32).div(255).sub_(mean).div_(std)


def decode_jpegs(blobs: Sequence[bytes], device: str | torch.device) -> list[torch.Tensor | str]:
    """Decode JPEG bytes to RGB on `device` (nvJPEG on CUDA, libjpeg on CPU), batched.

    Returns:
        Per blob, a (3, H, W) uint8 tensor on `device`, or the decoder's message when that
        blob does not decode (the batch is then decoded one by one to name the bad ones).
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    if not blobs:
        return []
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its decoders in favour of TorchCodec (not a dependency
        # here); one warning per chunk would flood a worker's log.
        warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)
        return _decode_jpegs(blobs, device, decode_jpeg, ImageReadMode.RGB)


def _decode_jpegs(blobs, device, decode_jpeg, mode) -> list[torch.Tensor | str]:
    data = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
    try:
        return list(decode_jpeg(data, mode=mode, device=device))
    except RuntimeError:
        pass
    out: list[torch.Tensor | str] = []
    for one in data:
        try:
            out.append(decode_jpeg(one, mode=mode, device=device))
        except RuntimeError as exc:
            # torchvision prefixes its source location: "decode_jpeg, <file>:<line>, <why>".
            out.append(str(exc).splitlines()[0].rsplit(", ", 1)[-1])
    return out


def resize_crop(images: Sequence[torch.Tensor], spec: PixelSpec) -> torch.Tensor:
    """(3, H_i, W_i) uint8 images on one device -> (B, 3, size, size) uint8 there: shortest
    side to `spec.size` (bicubic, antialiased, as the PIL path), then the centre crop."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    out = []
    for image in images:  # sizes differ: one resize each (the GPU runs them back to back)
        image = TF.resize(
            image, [spec.size], interpolation=InterpolationMode.BICUBIC, antialias=True
        )
        out.append(TF.center_crop(image, [spec.size, spec.size]))
    return torch.stack(out)  # (B, 3, size, size)


def decode_pixels(
    blobs: Sequence[bytes], spec: PixelSpec, device: str | torch.device
) -> tuple[torch.Tensor, list[str | None]]:
    """JPEG bytes -> model-ready pixels on `device`: batched decode, resize, crop, normalise.

    Args:
        blobs: encoded JPEG images.
        spec: from :func:`pixel_spec` of the model's transform.
        device: where to decode and transform ("cuda", "cuda:1", "cpu").

    Returns:
        pixels: (B_ok, 3, size, size) float32 on `device`, one row per blob that decoded, in
            order.
        errors: per blob, None or why it did not decode.
    """
    decoded = decode_jpegs(blobs, device)
    good = [image for image in decoded if isinstance(image, torch.Tensor)]
    errors = [None if isinstance(image, torch.Tensor) else image for image in decoded]
    if not good:
        empty = torch.empty((0, 3, spec.size, spec.size), dtype=torch.float32, device=device)
        return empty, errors
    return normalize_pixels(resize_crop(good, spec), spec), errors
