"""open_clip loading for the embed stage and the trainer.

Contract:
    * A model is named by a :class:`ModelSpec`: an open_clip architecture name plus where the
      weights come from: an open_clip pretrained tag, a local checkpoint file, or ``None`` for
      a random init that is fully determined by ``spec.seed``.
    * :func:`check_weights_available` is a cheap driver-side preflight (no model build, no
      network, well under a second) that turns every foreseeable loading failure into a
      :class:`ModelLoadError` whose message names the model, the tag or path, and the fix.
    * :func:`load_clip` returns a :class:`LoadedClip` in eval mode on the resolved device. Weights
      always stay fp32; reduced precision is applied with autocast in :func:`encode_pairs`, so
      anything computed from the outputs (losses, cosines) is fp32.
    * :func:`encode_pairs` returns L2-normalised float32 embeddings and the CLIP temperature.
    * Checkpoints are read with ``torch.load(weights_only=True)`` only (docs/architecture.md
      §4.1): a file that needs arbitrary unpickling is refused, never executed.

Importing this module registers ``pipeline/models/model_configs/*.json`` with open_clip, so
names such as ``"ncl-tiny"`` work in every process (driver and Ray workers) that imports it.

This module is the public entry point and holds the contract; the code lives in
:mod:`pipeline.models.spec` (spec, errors, names, config registry), :mod:`pipeline.models.weights`
(preflight, checkpoint files), :mod:`pipeline.models.loading` (building models and transforms)
and :mod:`pipeline.models.encode` (devices, precision, the forward pass).
"""

from __future__ import annotations

from pipeline.models.encode import encode_pairs, resolve_device
from pipeline.models.loading import load_clip, load_transforms
from pipeline.models.spec import (
    CHECKPOINT_SUFFIXES,
    LOGIT_SCALE_MAX,
    MODEL_CONFIG_DIR,
    PRECISIONS,
    LoadedClip,
    ModelLoadError,
    ModelSpec,
    list_builtin_configs,
)
from pipeline.models.weights import check_weights_available

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "LOGIT_SCALE_MAX",
    "MODEL_CONFIG_DIR",
    "LoadedClip",
    "ModelLoadError",
    "ModelSpec",
    "PRECISIONS",
    "check_weights_available",
    "encode_pairs",
    "list_builtin_configs",
    "load_clip",
    "load_transforms",
    "resolve_device",
]
