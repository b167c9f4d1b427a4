"""Building open_clip models: seeded random init, tags, local checkpoints, transforms.

Contract (part of :mod:`pipeline.models.clip`):

* :func:`load_clip` returns a :class:`LoadedClip` in eval mode on the resolved device, with fp32
  weights. Models are built on CPU under a seeded, restored torch RNG, so a seed gives the same
  weights on any device and loading never reseeds the caller.
* :func:`load_transforms` gives the eval transform and tokenizer without building the model.
* open_clip's root-logger narration is filtered while it builds, and logging is never
  configured for good (pipeline.runtime.console owns the terminal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import open_clip
import torch
from open_clip import pretrained as _oc_pretrained
from PIL import Image

from pipeline.models.encode import autocast_dtype_for, encode_pairs, resolve_device
from pipeline.models.spec import (
    DEFAULT_DEVICE,
    LoadedClip,
    ModelLoadError,
    ModelSpec,
    arch_name,
    clean_tag,
    split_schema,
)
from pipeline.models.weights import (
    cache_dir_of,
    check_weights_available,
    file_sha256,
    is_url,
    load_state_dict_strict,
    local_copy,
    read_state_dict,
)

__all__ = ["load_clip", "load_transforms"]


@contextlib.contextmanager
def _seeded_cpu_rng(seed: int) -> Iterator[None]:
    """Seeds torch's CPU generator for the block and restores the caller's state afterwards.

    Restoring matters: loading a model must not silently reseed the caller's data order or
    augmentation. Only the CPU generator is touched because models are always built on CPU
    (which also makes a seed give the same weights whatever the target device).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class _QuietOpenClip(logging.Filter):
    """Drops what open_clip logs through the root logger below WARNING, and its "initialized
    randomly" warning.

    open_clip narrates model and tokenizer building at INFO (a dozen lines per Ray worker), and
    the random-init warning is expected for ``pretrained=None`` and wrong for local checkpoints
    (we load them right after the build). A filter on the root logger only sees records logged
    on the root logger itself (``logging.info(...)``), so the pipeline's own records, which
    propagate to the root from named loggers, are not affected.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        return "Model initialized randomly" not in record.getMessage()


class _LastResort(logging.Handler):
    """What Python does with a record when no handler is configured: WARNING and above to
    stderr (`logging.lastResort`)."""

    def emit(self, record: logging.LogRecord) -> None:
        last = logging.lastResort
        if last is not None and record.levelno >= last.level:
            last.handle(record)


@contextlib.contextmanager
def _open_clip_logging() -> Iterator[None]:
    """Around open_clip calls: quiet its root-logger narration without configuring logging.

    open_clip logs with the module-level ``logging.info``, which calls ``logging.basicConfig``
    when the root logger has no handler: that would leave a handler on the root logger of every
    process that builds a model (Ray workers included). While the block runs, an unconfigured
    root logger gets a stand-in handler that does what Python does without one, so nothing is
    configured for good; both the filter and the stand-in are removed afterwards.
    """
    root = logging.getLogger()
    quiet = _QuietOpenClip()
    stand_in = None if root.handlers else _LastResort()
    root.addFilter(quiet)
    if stand_in is not None:
        root.addHandler(stand_in)
    try:
        yield
    finally:
        root.removeFilter(quiet)
        if stand_in is not None:
            root.removeHandler(stand_in)


def _build(spec: ModelSpec, pretrained: str | None) -> tuple[torch.nn.Module, Callable]:
    """Builds the architecture on CPU in fp32 and returns (model, val transform)."""
    schema, _ = split_schema(spec.name)
    with _open_clip_logging():
        model, _, preprocess = open_clip.create_model_and_transforms(
            spec.name if schema else arch_name(spec.name),
            pretrained=pretrained,
            precision="fp32",  # weights stay fp32; reduced precision is autocast
            device="cpu",  # built on CPU so a seed gives the same weights on any device
            # "Random init" means all random: never fetch HF base text weights.
            pretrained_text=False,
            weights_only=True,
            cache_dir=cache_dir_of(spec),  # None: open_clip's and Hugging Face's defaults
        )
    return model, preprocess


def _tokenizer(name: str, cache_dir: str | None = None) -> Callable:
    with _open_clip_logging():
        return open_clip.get_tokenizer(name, cache_dir=cache_dir)


def _weight_source(spec: ModelSpec, arch: str, schema: str | None) -> tuple[str | None, str | None]:
    """(open_clip tag or None, local checkpoint path or None); both None for a random init."""
    if spec.pretrained is None or schema:
        return None, None
    if _oc_pretrained.is_pretrained_cfg(arch, spec.pretrained):
        return spec.pretrained, None
    if is_url(spec.pretrained):
        return None, local_copy(spec.pretrained)
    return None, os.path.expanduser(spec.pretrained)  # preflight proved it is a file


def _build_or_explain(
    spec: ModelSpec, arch: str, schema: str | None, tag: str | None, local_path: str | None
) -> tuple[torch.nn.Module, Callable, Callable]:
    """(model, val transform, tokenizer); any open_clip failure becomes a ModelLoadError."""
    try:
        with _seeded_cpu_rng(spec.seed):
            # Local checkpoints are loaded by us (not open_clip) so the weights_only/strict
            # policy and the error messages are ours; the seed only shapes the discarded init.
            model, preprocess = _build(spec, tag)
        tokenizer = _tokenizer(arch, cache_dir_of(spec))
    except ModelLoadError:
        raise
    except Exception as exc:
        if tag is not None:
            source = f"tag {tag!r}"
        elif local_path is not None:
            source = f"architecture for checkpoint {local_path!r}"
        else:
            source = "random init" if not schema else "its own weights"
        raise ModelLoadError(
            f"open_clip could not build model {spec.name!r} ({source}): "
            f"{type(exc).__name__}: {exc}. Check model.name / model.pretrained; for tags, check "
            "network access or the Hugging Face cache."
        ) from exc
    return model, preprocess, tokenizer


def load_clip(spec: ModelSpec, device: str | torch.device = DEFAULT_DEVICE) -> LoadedClip:
    """Builds an open_clip model with its transform and tokenizer, ready for inference.

    Weight sources:
        * ``pretrained=None``: random init with ``torch.manual_seed(spec.seed)`` on CPU; the
          global torch RNG state is restored afterwards. Same seed -> identical weights.
        * a local file: built randomly, then ``torch.load(weights_only=True)`` (or safetensors)
          and a strict ``load_state_dict``; accepts a bare state dict or one wrapped under
          ``"state_dict"`` / ``"model"``; strips ``module.`` / ``_orig_mod.`` prefixes.
        * an open_clip tag: :func:`check_weights_available` first (fails fast offline), then
          open_clip downloads or reads its cache (``spec.cache_dir``, else its defaults);
          likewise a ``hf-hub:`` name.

    Args:
        spec: What to build.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``... (see :func:`resolve_device`).

    Returns:
        A :class:`LoadedClip`; the model is in eval mode with fp32 weights.

    Raises:
        ModelLoadError: Any failure to resolve, read or fit the weights, with the fix.
        ValueError: The device is unusable (see :func:`resolve_device`).
    """
    dev = resolve_device(device)
    autocast_dtype = autocast_dtype_for(spec.precision, dev)
    check_weights_available(spec)
    schema, _ = split_schema(spec.name)
    arch = spec.name if schema else arch_name(spec.name)
    tag, local_path = _weight_source(spec, arch, schema)
    model, preprocess, tokenizer = _build_or_explain(spec, arch, schema, tag, local_path)

    if local_path is not None:
        state = read_state_dict(local_path, spec)
        load_state_dict_strict(model, state, local_path, spec)
        model_id = f"{arch}/ckpt:{file_sha256(local_path)[:12]}"
    elif tag is not None:
        model_id = f"{arch}/{clean_tag(tag)}"
    elif schema:
        model_id = spec.name
    else:
        model_id = f"{arch}/random-seed{spec.seed}"

    model = model.to(dev).eval()
    loaded = LoadedClip(
        model=model,
        preprocess=preprocess,
        tokenizer=tokenizer,
        device=dev,
        autocast_dtype=autocast_dtype,
        model_id=model_id,
    )
    # One tiny forward tells D and the scale for any tower type (open_clip stores neither).
    probe_image = preprocess(Image.new("RGB", (8, 8))).unsqueeze(0)  # (1, 3, H, W)
    _, text_emb, scale = encode_pairs(loaded, probe_image, tokenizer(["a"]))
    return dataclasses.replace(loaded, embed_dim=int(text_emb.shape[1]), logit_scale=scale)


def load_transforms(spec: ModelSpec) -> tuple[Callable[[Any], torch.Tensor], Callable]:
    """The model's eval image transform and tokenizer, without building the model.

    Data-loading tasks need these but not the weights (a ViT-B-32 is 600 MB to build). The
    transform is resolved the way open_clip resolves it for `load_clip`: library defaults, then
    the model config's `preprocess_cfg`, then the pretrained tag's mean/std/interpolation,
    with the tower's image size. `tests/test_models.py` checks both give identical tensors.
    """
    schema, _ = split_schema(spec.name)
    if schema:  # hub / local-dir models: only open_clip knows their transform
        return load_clip(spec, "cpu").preprocess, _tokenizer(spec.name, cache_dir_of(spec))
    return load_image_transform(spec), _tokenizer(arch_name(spec.name), cache_dir_of(spec))


def load_image_transform(spec: ModelSpec) -> Callable[[Any], torch.Tensor]:
    """`load_transforms`'s image transform alone (no tokenizer: some need `transformers`)."""
    from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict

    if split_schema(spec.name)[0]:
        return load_clip(spec, "cpu").preprocess
    arch = arch_name(spec.name)
    config = open_clip.get_model_config(arch)
    if config is None:
        check_weights_available(spec)  # raises the helpful unknown-model error
        raise ModelLoadError(f"model {spec.name!r} has no open_clip config")
    preprocess_cfg = dataclasses.asdict(PreprocessCfg())
    preprocess_cfg = merge_preprocess_dict(preprocess_cfg, config.get("preprocess_cfg", {}))
    if spec.pretrained is not None and _oc_pretrained.is_pretrained_cfg(arch, spec.pretrained):
        tag_cfg = _oc_pretrained.get_pretrained_cfg(arch, spec.pretrained)
        preprocess_cfg = merge_preprocess_dict(preprocess_cfg, tag_cfg)
    preprocess_cfg["size"] = config["vision_cfg"].get("image_size", preprocess_cfg["size"])
    return image_transform_v2(PreprocessCfg(**preprocess_cfg), is_train=False)
