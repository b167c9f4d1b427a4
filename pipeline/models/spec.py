"""What a model is: its spec, the loaded bundle, the error type, names and the config registry.

Contract (part of :mod:`pipeline.models.clip`):

* A model is named by a :class:`ModelSpec`: an open_clip architecture name plus where the weights
  come from (an open_clip pretrained tag, a local checkpoint file, or ``None`` for a random init
  fully determined by ``spec.seed``). Names may carry open_clip's own schemas (``hf-hub:``,
  ``local-dir:``), which bring their own weights.
* Every loading failure is a :class:`ModelLoadError` whose message names the model, the tag or
  path, and the fix.
* Importing this module registers ``pipeline/models/model_configs/*.json`` with open_clip, so
  names such as ``"ncl-tiny"`` work in every process (driver and Ray workers) that imports any
  module of :mod:`pipeline.models`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import open_clip
import torch

from pipeline.errors import UserError

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "DEFAULT_DEVICE",
    "LOGIT_SCALE_MAX",
    "MODEL_CONFIG_DIR",
    "PRECISIONS",
    "LoadedClip",
    "ModelLoadError",
    "ModelSpec",
    "arch_name",
    "clean_tag",
    "list_builtin_configs",
    "split_schema",
]

PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"
LOGIT_SCALE_MAX = 100.0  # CLIP clamps the learned temperature at 100 (ln 100 before exp)
DEFAULT_DEVICE = "auto"  # sentinel kept in one place so callers and docs agree
# Name prefixes open_clip resolves itself (config + weights from a hub repo or a folder).
_NAME_SCHEMAS = ("hf-hub", "local-dir")


class ModelLoadError(UserError, ValueError):
    """A model could not be built or its weights could not be found or read.

    The message is meant for users: it names the model, the tag or path, and the fix. It
    subclasses ``ValueError`` because nearly every cause is a bad ``model:`` config value.
    """


@dataclass(frozen=True)
class ModelSpec:
    """Which CLIP to build and where its weights come from (the ``model:`` job section)."""

    name: str  # open_clip architecture name, e.g. "ViT-B-32" or our "ncl-tiny"
    pretrained: str | None  # open_clip tag | local checkpoint file | None = random init
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16": autocast dtype, weights stay fp32
    seed: int = 0  # random-init seed: co-teaching views A and B differ only by this
    # Where open_clip / Hugging Face download and look up tag or hub weights (None: their
    # defaults). Not part of what a model is: the same weights come from any cache.
    cache_dir: str | None = None


@dataclass
class LoadedClip:
    """A ready-to-use CLIP and everything needed to feed it."""

    model: torch.nn.Module  # eval mode, fp32 weights, on `device`
    preprocess: Callable[[Any], torch.Tensor]  # open_clip's val transform: PIL -> (3, H, W)
    tokenizer: Callable[[list[str]], torch.Tensor]  # list[str] -> (B, L) int64
    device: torch.device  # where `model` lives; encode_pairs moves inputs here
    autocast_dtype: torch.dtype | None  # None = plain fp32; else autocast with this dtype
    model_id: str  # stable lineage id written into tables, e.g. "ncl-tiny/random-seed0"
    embed_dim: int = 0  # D of the joint embedding space (filled by load_clip)
    logit_scale: float = 0.0  # exp(logit_scale) clamped at 100, as encode_pairs returns it


# --------------------------------------------------------------------------------------------
# Registry


def _register_model_configs() -> None:
    """Adds our config folder to open_clip's registry, once per process.

    ``open_clip.add_model_config`` appends to a path list and rescans on every call, so calling
    it blindly from every worker/stage would grow that list; guard on the resolved path.
    """
    from open_clip import factory as _oc_factory  # the path list is not part of the public API

    target = MODEL_CONFIG_DIR.resolve()
    known = {Path(p).resolve() for p in getattr(_oc_factory, "_MODEL_CONFIG_PATHS", [])}
    if target not in known:
        open_clip.add_model_config(target)


_register_model_configs()


def list_builtin_configs() -> list[str]:
    """Names of every architecture open_clip can build here (its built-ins plus ours).

    Returns:
        Sorted-as-open_clip-sorts list of model names, e.g. ``["RN50", ..., "ncl-tiny", ...]``.
    """
    _register_model_configs()
    return list(open_clip.list_models())


# --------------------------------------------------------------------------------------------
# Names


def clean_tag(tag: str) -> str:
    # Same normalisation open_clip applies before looking tags up ("LAION2B-..." == "laion2b_...").
    return tag.strip().lower().replace("-", "_")


def split_schema(name: str) -> tuple[str | None, str]:
    """('hf-hub' | 'local-dir' | None, rest): the two name schemas open_clip understands."""
    for schema in _NAME_SCHEMAS:
        if name.startswith(schema + ":"):
            return schema, name[len(schema) + 1 :]
    return None, name


def arch_name(name: str) -> str:
    # open_clip accepts "ViT-B/32" and looks up "ViT-B-32".
    return name.replace("/", "-")


def config_embed_dim(name: str) -> int | None:
    """D of a model's joint embedding, from its config without building it (None for an
    hf-hub or local-dir name, whose config only loading reads)."""
    schema, rest = split_schema(name)
    if schema is not None:
        return None
    _register_model_configs()
    config = open_clip.get_model_config(arch_name(rest))
    return int(config["embed_dim"]) if config and "embed_dim" in config else None
