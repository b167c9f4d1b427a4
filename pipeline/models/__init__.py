"""Model loading: open_clip CLIP models by name + tag | checkpoint path | random init."""

from pipeline.models.clip import (
    LoadedClip,
    ModelLoadError,
    ModelSpec,
    check_weights_available,
    encode_pairs,
    list_builtin_configs,
    load_clip,
    load_transforms,
    resolve_device,
)

__all__ = [
    "LoadedClip",
    "ModelLoadError",
    "ModelSpec",
    "check_weights_available",
    "encode_pairs",
    "list_builtin_configs",
    "load_clip",
    "load_transforms",
    "resolve_device",
]
