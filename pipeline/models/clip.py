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
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import logging
import os
import pickle
import re
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import open_clip
import torch
import torch.nn.functional as F
from open_clip import constants as _oc_constants
from open_clip import pretrained as _oc_pretrained
from PIL import Image

__all__ = [
    "CHECKPOINT_SUFFIXES",
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
    "save_checkpoint_state_dict",
]

PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"
LOGIT_SCALE_MAX = 100.0  # CLIP clamps the learned temperature at 100 (ln 100 before exp)

# Prefixes that wrappers add to parameter names: DistributedDataParallel and torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_TRUTHY = {"1", "on", "yes", "true"}  # the values huggingface_hub treats as "set"
_DEFAULT_DEVICE = "auto"  # sentinel kept in one place so callers and docs agree
# Name prefixes open_clip resolves itself (config + weights from a hub repo or a folder).
_NAME_SCHEMAS = ("hf-hub", "local-dir")


class ModelLoadError(ValueError):
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
# Devices and precision


def resolve_device(device: str | torch.device = _DEFAULT_DEVICE) -> torch.device:
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


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
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
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
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


# --------------------------------------------------------------------------------------------
# Preflight


def _hf_offline() -> bool:
    """True when Hugging Face downloads are disabled.

    Reads the environment at call time *and* huggingface_hub's import-time constant: the
    library freezes ``HF_HUB_OFFLINE`` when first imported, while tests and launchers often
    set the variable later.
    """
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    if env.strip().lower() in _TRUTHY:
        return True
    try:
        from huggingface_hub import constants as hf_constants
    except ImportError:
        return False
    return bool(getattr(hf_constants, "HF_HUB_OFFLINE", False))


def _clean_tag(tag: str) -> str:
    # Same normalisation open_clip applies before looking tags up ("LAION2B-..." == "laion2b_...").
    return tag.strip().lower().replace("-", "_")


def _split_schema(name: str) -> tuple[str | None, str]:
    """('hf-hub' | 'local-dir' | None, rest): the two name schemas open_clip understands."""
    for schema in _NAME_SCHEMAS:
        if name.startswith(schema + ":"):
            return schema, name[len(schema) + 1 :]
    return None, name


def _arch_name(name: str) -> str:
    # open_clip accepts "ViT-B/32" and looks up "ViT-B-32".
    return name.replace("/", "-")


def _looks_like_path(value: str) -> bool:
    return "/" in value or os.sep in value or value.lower().endswith(CHECKPOINT_SUFFIXES)


def _close_names(name: str, choices: list[str], n: int = 5) -> list[str]:
    """Close matches, case-insensitive (users type 'vit-b-32')."""
    by_lower = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.6)
    return [by_lower[h] for h in hits]


_FIX_OFFLINE = (
    "Fix one of: (1) on a machine with network access run "
    "`python -c \"import open_clip; open_clip.create_model('{name}', pretrained='{tag}')\"` and "
    "copy its Hugging Face cache ({cache}) to the same place here (or point HF_HOME at the copy); "
    "(2) set model.pretrained to a local checkpoint file path; "
    "(3) set model.pretrained: null for a random init."
)


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub import constants as hf_constants

        return str(hf_constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - open_clip depends on huggingface_hub
        return "~/.cache/huggingface/hub"


def _cached_tag_file(cfg: Mapping[str, Any]) -> tuple[str | None, str]:
    """Finds a pretrained tag's weights in the local caches without touching the network.

    Mirrors ``open_clip.pretrained.download_pretrained``: an explicit ``file`` wins; the
    Hugging Face Hub source is preferred over the URL when huggingface_hub is installed; a
    hub entry without a filename means ``open_clip_pytorch_model.bin`` with its safetensors
    twin tried first.

    Returns:
        (path or None when not cached, a human-readable description of the source).
    """
    if cfg.get("file"):
        path = str(cfg["file"])
        return (path if os.path.isfile(path) else None), f"file {path}"
    hub = cfg.get("hf_hub") or ""
    url = cfg.get("url") or ""
    if hub and _oc_pretrained.has_hf_hub():
        from huggingface_hub import try_to_load_from_cache

        repo_id, filename = os.path.split(hub)
        filename = filename or _oc_constants.HF_WEIGHTS_NAME
        candidates = [filename]
        if filename == _oc_constants.HF_WEIGHTS_NAME:
            candidates.insert(0, _oc_constants.HF_SAFE_WEIGHTS_NAME)
        elif filename.endswith((".bin", ".pth")):
            candidates.insert(0, filename[:-4] + ".safetensors")
        for candidate in candidates:
            hit = try_to_load_from_cache(repo_id=repo_id, filename=candidate)
            if isinstance(hit, str) and os.path.isfile(hit):
                return hit, f"hf-hub {repo_id} ({candidate})"
        return None, f"hf-hub {repo_id} ({' or '.join(candidates)})"
    if url:
        # open_clip's URL downloads land in ~/.cache/clip/<basename> when no cache_dir is given.
        path = os.path.join(os.path.expanduser("~/.cache/clip"), os.path.basename(url))
        return (path if os.path.isfile(path) else None), f"url {url}"
    return None, "no download source"


def _check_local_dir(spec: ModelSpec, directory: str) -> None:
    config = Path(directory) / "open_clip_config.json"
    if not config.is_file():
        raise ModelLoadError(
            f"Model {spec.name!r}: {config} not found. A 'local-dir:' model needs a folder "
            "holding open_clip_config.json and the weights; fix model.name."
        )


def _check_hf_hub_name(spec: ModelSpec, repo_id: str) -> None:
    if not _hf_offline():
        return
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id=repo_id, filename="open_clip_config.json")
    if not isinstance(hit, str):
        raise ModelLoadError(
            f"Model {spec.name!r}: {repo_id}/open_clip_config.json is not in the local Hugging "
            f"Face cache ({_hf_cache_dir()}) and cannot be downloaded here (HF_HUB_OFFLINE is "
            "set). Download it on a machine with network access and copy the cache, or use a "
            "built-in model.name with a local checkpoint path in model.pretrained."
        )


def check_weights_available(spec: ModelSpec) -> None:
    """Checks, without building the model, that ``spec`` can be loaded here.

    Runs on the driver before any Ray work starts, so config mistakes fail in milliseconds
    instead of inside a GPU actor. Touches only the filesystem: no model build, no network,
    no DNS (typically a few milliseconds even for a missing tag with ``HF_HUB_OFFLINE=1``).

    Checks, in order: known precision; known architecture (with close-name suggestions);
    ``pretrained`` is ``None``, a known tag for this architecture, or an existing file; and,
    when Hugging Face access is offline, that a tag's weights are already in the local cache.
    Online, a tag that is not cached passes: :func:`load_clip` will download it.

    Args:
        spec: The model to check.

    Raises:
        ModelLoadError: With a message naming the model, the tag or path, and the fix.
    """
    if spec.precision not in PRECISIONS:
        raise ModelLoadError(
            f"Unknown precision {spec.precision!r} for model {spec.name!r}: set "
            f"model.precision to one of {list(PRECISIONS)}."
        )
    schema, ident = _split_schema(spec.name)
    if schema is not None:
        if spec.pretrained is not None:
            raise ModelLoadError(
                f"Model {spec.name!r} brings its own weights, so model.pretrained must be null "
                f"(got {spec.pretrained!r}); drop the '{schema}:' prefix to use a tag or path."
            )
        if schema == "local-dir":
            _check_local_dir(spec, ident)
        else:
            _check_hf_hub_name(spec, ident)
        return

    arch = _arch_name(spec.name)
    models = list_builtin_configs()
    if arch not in models:
        close = _close_names(arch, models)
        hint = f"Did you mean {close}? " if close else ""
        raise ModelLoadError(
            f"Unknown model {spec.name!r}. {hint}Set model.name to an open_clip architecture "
            f"(see open_clip.list_models(); {len(models)} known here, e.g. 'ViT-B-32', "
            "'ncl-tiny')."
        )
    if spec.pretrained is None:
        return

    tag_or_path = spec.pretrained
    tags = _oc_pretrained.list_pretrained_tags_by_model(arch)
    if _oc_pretrained.is_pretrained_cfg(arch, tag_or_path):
        cfg = _oc_pretrained.get_pretrained_cfg(arch, tag_or_path)
        cached, source = _cached_tag_file(cfg)
        if cached is None and _hf_offline():
            raise ModelLoadError(
                f"Pretrained weights for model {spec.name!r} tag {tag_or_path!r} ({source}) are "
                "not in the local cache and cannot be downloaded here (HF_HUB_OFFLINE is set). "
                + _FIX_OFFLINE.format(name=arch, tag=tag_or_path, cache=_hf_cache_dir())
            )
        return

    path = os.path.expanduser(tag_or_path)
    if os.path.isfile(path):
        return
    if _looks_like_path(tag_or_path):
        where = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise ModelLoadError(
            f"Checkpoint {tag_or_path!r} for model {spec.name!r} {where}. Set "
            "model.pretrained to an existing local checkpoint file (.pt/.pth/.bin/.safetensors), "
            "a pretrained tag, or null for a random init."
        )
    close = _close_names(tag_or_path, tags, n=3)
    hint = f" Did you mean {close}?" if close else ""
    if tags:
        known = f"Known tags for {arch}: {tags}. Set model.pretrained to one of them,"
    else:
        known = f"{arch} has no pretrained tags. Set model.pretrained to"
    raise ModelLoadError(
        f"Unknown pretrained tag {tag_or_path!r} for model {spec.name!r}.{hint} {known} "
        "a local checkpoint file path, or null for a random init."
    )


# --------------------------------------------------------------------------------------------
# Loading


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
    schema, _ = _split_schema(spec.name)
    with _open_clip_logging():
        model, _, preprocess = open_clip.create_model_and_transforms(
            spec.name if schema else _arch_name(spec.name),
            pretrained=pretrained,
            precision="fp32",  # weights stay fp32; reduced precision is autocast
            device="cpu",  # built on CPU so a seed gives the same weights on any device
            # "Random init" means all random: never fetch HF base text weights.
            pretrained_text=False,
            weights_only=True,
        )
    return model, preprocess


def _tokenizer(name: str) -> Callable:
    with _open_clip_logging():
        return open_clip.get_tokenizer(name)


def _file_sha256(path: str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def _unpickler_reason(exc: Exception) -> str:
    """The useful part of torch's long weights_only refusal, e.g. "Unsupported global: ..."."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # torch bolds part of it with ANSI codes
    _, marker, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if marker else text).splitlines() if line.strip()]
    reason = lines[0] if lines else type(exc).__name__
    return reason.split(" was not an allowed global", 1)[0]


def _read_state_dict(path: str, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Reads a checkpoint file safely and unwraps the common container layouts."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            obj: Any = load_file(path, device="cpu")
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = _unpickler_reason(exc)
        if "Unsupported global" in reason:
            raise ModelLoadError(
                f"Checkpoint {path!r} for model {spec.name!r} was refused: it holds pickled "
                f"Python objects, not just tensors ({reason}), and checkpoints are only read "
                "with torch.load(weights_only=True). Re-save it as a plain state dict, e.g. "
                "torch.save(model.state_dict(), path) or "
                "pipeline.models.save_checkpoint_state_dict."
            ) from exc
        raise ModelLoadError(
            f"Checkpoint {path!r} for model {spec.name!r} could not be read ({reason}); it is "
            "corrupt or not a torch/safetensors checkpoint. Point model.pretrained at a file "
            "written by torch.save(model.state_dict(), path)."
        ) from exc
    except Exception as exc:  # truncated zip, not a torch file, bad safetensors header...
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"Checkpoint {path!r} for model {spec.name!r} could not be read ({detail}); it is "
            "truncated or not a torch/safetensors checkpoint. Point model.pretrained at a file "
            "written by torch.save(model.state_dict(), path)."
        ) from exc

    if isinstance(obj, Mapping):
        for wrapper in ("state_dict", "model"):  # trainer / lightning-style containers
            if wrapper in obj and isinstance(obj[wrapper], Mapping):
                obj = obj[wrapper]
                break
    if not isinstance(obj, Mapping) or not obj:
        raise ModelLoadError(
            f"Checkpoint {path!r} for model {spec.name!r} holds a {type(obj).__name__}, not a "
            "state dict; save model.state_dict() (optionally under a 'state_dict' or 'model' key)."
        )
    state = {}
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise ModelLoadError(
                f"Checkpoint {path!r} for model {spec.name!r}: entry {key!r} is a "
                f"{type(value).__name__}, not a tensor; save model.state_dict() only."
            )
        for prefix in _WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
        state[key] = value
    return state


def _load_state_dict_strict(
    model: torch.nn.Module, state: dict[str, torch.Tensor], path: str, spec: ModelSpec
) -> None:
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"Checkpoint {path!r} does not fit model {spec.name!r}: {len(missing)} missing keys "
            f"(e.g. {missing[:3]}) and {len(unexpected)} unexpected keys (e.g. {unexpected[:3]}). "
            "It was probably saved from a different architecture; set model.name to the one it "
            "was trained with."
        )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # same keys, different shapes
        mismatches = [
            k for k, v in model.state_dict().items() if tuple(state[k].shape) != tuple(v.shape)
        ]
        raise ModelLoadError(
            f"Checkpoint {path!r} does not fit model {spec.name!r}: {len(mismatches)} tensors "
            f"have other shapes (e.g. {mismatches[:3]}). It was saved from a differently sized "
            "config; set model.name to the one it was trained with."
        ) from exc


def load_clip(spec: ModelSpec, device: str | torch.device = _DEFAULT_DEVICE) -> LoadedClip:
    """Builds an open_clip model with its transform and tokenizer, ready for inference.

    Weight sources:
        * ``pretrained=None``: random init with ``torch.manual_seed(spec.seed)`` on CPU; the
          global torch RNG state is restored afterwards. Same seed -> identical weights.
        * a local file: built randomly, then ``torch.load(weights_only=True)`` (or safetensors)
          and a strict ``load_state_dict``; accepts a bare state dict or one wrapped under
          ``"state_dict"`` / ``"model"``; strips ``module.`` / ``_orig_mod.`` prefixes.
        * an open_clip tag: :func:`check_weights_available` first (fails fast offline), then
          open_clip downloads or reads its cache.

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
    autocast_dtype = _autocast_dtype(spec.precision, dev)
    check_weights_available(spec)
    schema, _ = _split_schema(spec.name)
    arch = spec.name if schema else _arch_name(spec.name)

    local_path: str | None = None
    tag: str | None = None
    if spec.pretrained is not None and not schema:
        if _oc_pretrained.is_pretrained_cfg(arch, spec.pretrained):
            tag = spec.pretrained
        else:
            local_path = os.path.expanduser(spec.pretrained)  # preflight proved it is a file

    try:
        with _seeded_cpu_rng(spec.seed):
            # Local checkpoints are loaded by us (not open_clip) so the weights_only/strict
            # policy and the error messages are ours; the seed only shapes the discarded init.
            model, preprocess = _build(spec, tag)
        tokenizer = _tokenizer(arch)
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

    if local_path is not None:
        state = _read_state_dict(local_path, spec)
        _load_state_dict_strict(model, state, local_path, spec)
        model_id = f"{arch}/ckpt:{_file_sha256(local_path)[:12]}"
    elif tag is not None:
        model_id = f"{arch}/{_clean_tag(tag)}"
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


# --------------------------------------------------------------------------------------------
# Inference and checkpoints


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


def save_checkpoint_state_dict(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Writes ``model.state_dict()`` atomically (temp file + fsync + rename).

    Tensors are moved to CPU first so the file loads on any machine. A reader sees either the
    old file or the complete new one, never a partial write (docs/architecture.md §4.1). The
    result loads with
    ``torch.load(weights_only=True)`` and therefore with :func:`load_clip`.

    Args:
        model: Any module (a DDP/compiled wrapper is fine: its prefixes are stripped on load).
        path: Destination file; parent folders are created.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def load_transforms(spec: ModelSpec) -> tuple[Callable[[Any], torch.Tensor], Callable]:
    """The model's eval image transform and tokenizer, without building the model.

    Data-loading tasks need these but not the weights (a ViT-B-32 is 600 MB to build). The
    transform is resolved the way open_clip resolves it for `load_clip`: library defaults, then
    the model config's `preprocess_cfg`, then the pretrained tag's mean/std/interpolation,
    with the tower's image size. `tests/test_models.py` checks both give identical tensors.
    """
    from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict

    schema, _ = _split_schema(spec.name)
    if schema:  # hub / local-dir models: only open_clip knows their transform
        return load_clip(spec, "cpu").preprocess, _tokenizer(spec.name)
    arch = _arch_name(spec.name)
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
    transform = image_transform_v2(PreprocessCfg(**preprocess_cfg), is_train=False)
    return transform, _tokenizer(arch)
