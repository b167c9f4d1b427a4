"""open_clip loading for the embed stage and the trainer: the public entry point, re-exporting
`pipeline.models.spec`, `weights`, `loading` and `encode`.

Contract:
- A model is named by a `ModelSpec`: an open_clip architecture name plus an open_clip pretrained
  tag, a local checkpoint file, or `None` for a random init fully determined by `spec.seed`.
- `check_weights_available` is a cheap driver-side preflight (no model build, no network) that
  turns every foreseeable loading failure into a `ModelLoadError` naming the model, the tag or
  path, and the fix.
- `load_clip` returns a `LoadedClip` in eval mode; weights stay fp32 and reduced precision is
  autocast in `encode_pairs`, which returns L2-normalised float32 embeddings and the temperature.
- Checkpoints are read with `torch.load(weights_only=True)` only: a file that needs arbitrary
  unpickling is refused, never executed. Importing this module registers
  `pipeline/models/model_configs/*.json` with open_clip (names such as "ncl-tiny").
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
