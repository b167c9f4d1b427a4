"""Devices, precision and the forward pass: where a model runs and how pairs are embedded.

Contract (part of :mod:`pipeline.models.clip`):

* :func:`resolve_device` turns ``"auto"`` / ``"cpu"`` / ``"cuda[:i]"`` into a usable device or
  raises ``ValueError`` naming the fix.
* Weights always stay fp32; reduced precision is autocast only (:func:`autocast_dtype_for`), and
  a precision the device cannot autocast falls back to fp32 with a warning.
* :func:`encode_pairs` returns L2-normalised float32 embeddings and the CLIP temperature, so
  anything computed from the outputs (losses, cosines) is fp32.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from pipeline.models.spec import (
    DEFAULT_DEVICE,
    LOGIT_SCALE_MAX,
    PRECISIONS,
    LoadedClip,
    ModelLoadError,
)

__all__ = ["autocast_dtype_for", "bf16_native", "encode_pairs", "resolve_device"]


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
    dev = loaded.device
    dtype = loaded.autocast_dtype
    images = images.to(dev, dtype=torch.float32, non_blocking=True)  # (B, 3, H, W)
    tokens = tokens.to(dev, dtype=torch.long, non_blocking=True)  # (B, L)
    with torch.no_grad():
        with torch.autocast(device_type=dev.type, dtype=dtype, enabled=dtype is not None):
            img = loaded.model.encode_image(images)  # (B, D), autocast dtype
            txt = loaded.model.encode_text(tokens)  # (B, D), autocast dtype
        # Normalise in fp32, outside autocast: a bf16 norm is only good to ~1e-2.
        img = F.normalize(img.float(), dim=-1)
        txt = F.normalize(txt.float(), dim=-1)
        scale = loaded.model.logit_scale.detach().float().exp().clamp(max=LOGIT_SCALE_MAX)
    return img, txt, float(scale.reshape(-1)[0].item())
