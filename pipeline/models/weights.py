"""Model weights on disk: the driver-side preflight, and reading and writing checkpoint files.

Contract (part of :mod:`pipeline.models.clip`):

* :func:`check_weights_available` is a cheap driver-side preflight (no model build; no network
  but, for weights still to download, one TCP connect to their host within
  ``PROBE_SECONDS``) that turns every foreseeable loading failure into a
  :class:`ModelLoadError` whose message names the model, the tag or path, and the fix, and
  says whether the weights are here (a local checkpoint, or in the download cache:
  ``spec.cache_dir`` or open_clip's and Hugging Face's defaults) or will be downloaded.
* Checkpoints are read with ``torch.load(weights_only=True)`` (or safetensors) only
  (docs/architecture.md §4.1): a file that needs arbitrary unpickling is refused, never
  executed. :func:`read_state_dict` unwraps the common container layouts and wrapper prefixes;
  :func:`load_state_dict_strict` fits them or explains why they do not fit.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import pickle
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from open_clip import constants as _oc_constants
from open_clip import pretrained as _oc_pretrained

from pipeline.io.paths import file_sha256
from pipeline.io.tables import open_atomic
from pipeline.models.spec import (
    CHECKPOINT_SUFFIXES,
    PRECISIONS,
    ModelLoadError,
    ModelSpec,
    arch_name,
    list_builtin_configs,
    split_schema,
)

__all__ = [
    "WeightsStatus",
    "cache_dir_of",
    "check_weights_available",
    "file_sha256",
    "load_state_dict_strict",
    "read_state_dict",
    "weights_version",
]

# Prefixes that wrappers add to parameter names: DistributedDataParallel and torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_TRUTHY = {"1", "on", "yes", "true"}  # the values huggingface_hub treats as "set"
# How long the reachability probe of a download source may take, name lookup included: a
# closed network otherwise costs ~50 s of hub retries and a traceback inside the run.
PROBE_SECONDS = 3.0


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
    "copy its download cache ({cache}) to the same place here (or set model.cache_dir to the "
    "copy); "
    "(2) set model.pretrained to a local checkpoint file path; "
    "(3) set model.pretrained: null for a random init."
)


@dataclass(frozen=True)
class WeightsStatus:
    """Where a model's weights come from at run time (what `validate` reports)."""

    state: Literal["random", "cached", "download"]
    where: str = ""  # the file or folder read, or the source and the cache it downloads into

    def describe(self) -> str:
        if self.state == "random":
            return "random init, no weights to load"
        if self.state == "cached":
            return f"weights cached ({self.where})"
        return f"weights will be downloaded at run time ({self.where})"


def cache_dir_of(spec: ModelSpec) -> str | None:
    """`spec.cache_dir` with `~` expanded (None: open_clip's and Hugging Face's defaults)."""
    return os.path.expanduser(spec.cache_dir) if spec.cache_dir else None


def _hf_cache_dir(cache_dir: str | None = None) -> str:
    if cache_dir:
        return cache_dir
    try:
        from huggingface_hub import constants as hf_constants

        return str(hf_constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - open_clip depends on huggingface_hub
        return "~/.cache/huggingface/hub"


def _url_cache_dir(cache_dir: str | None) -> str:
    # open_clip's URL downloads land in ~/.cache/clip/<basename> when no cache_dir is given.
    return cache_dir or os.path.expanduser("~/.cache/clip")


def _cached_hub_file(repo_id: str, candidates: list[str], cache_dir: str | None) -> str | None:
    """The first of `candidates` in the Hugging Face cache (`cache_dir` or the default)."""
    from huggingface_hub import try_to_load_from_cache

    for candidate in candidates:
        hit = try_to_load_from_cache(repo_id=repo_id, filename=candidate, cache_dir=cache_dir)
        if isinstance(hit, str) and os.path.isfile(hit):
            return hit
    return None


def _cached_tag_file(
    cfg: Mapping[str, Any], cache_dir: str | None = None
) -> tuple[str | None, str]:
    """Finds a pretrained tag's weights in the local caches without touching the network.

    Mirrors ``open_clip.pretrained.download_pretrained``: an explicit ``file`` wins; the
    Hugging Face Hub source is preferred over the URL when huggingface_hub is installed; a
    hub entry without a filename means ``open_clip_pytorch_model.bin`` with its safetensors
    twin tried first. `cache_dir` is open_clip's: the hub cache's root, or the URL downloads'
    folder (None: Hugging Face's and open_clip's defaults).

    Returns:
        (path or None when not cached, a human-readable description of the source).
    """
    if cfg.get("file"):
        path = str(cfg["file"])
        return (path if os.path.isfile(path) else None), f"file {path}"
    hub = cfg.get("hf_hub") or ""
    url = cfg.get("url") or ""
    if hub and _oc_pretrained.has_hf_hub():
        repo_id, filename = os.path.split(hub)
        filename = filename or _oc_constants.HF_WEIGHTS_NAME
        candidates = [filename]
        if filename == _oc_constants.HF_WEIGHTS_NAME:
            candidates.insert(0, _oc_constants.HF_SAFE_WEIGHTS_NAME)
        elif filename.endswith((".bin", ".pth")):
            candidates.insert(0, filename[:-4] + ".safetensors")
        hit = _cached_hub_file(repo_id, candidates, cache_dir)
        return hit, f"hf-hub {repo_id} ({' or '.join(candidates)})"
    if url:
        path = os.path.join(_url_cache_dir(cache_dir), os.path.basename(url))
        return (path if os.path.isfile(path) else None), f"url {url}"
    return None, "no download source"


def _hub_endpoint() -> str:
    """Hugging Face's endpoint as huggingface_hub will use it (HF_ENDPOINT, read now)."""
    endpoint = os.environ.get("HF_ENDPOINT")
    if not endpoint:
        try:
            from huggingface_hub import constants as hf_constants

            endpoint = hf_constants.ENDPOINT
        except ImportError:
            endpoint = "https://huggingface.co"
    return endpoint


def _reachable(url: str, seconds: float = PROBE_SECONDS) -> bool:
    """Whether a TCP connection to `url`'s host and port opens within `seconds` (the name
    lookup, which a socket timeout does not bound, runs on a thread given the same budget)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (80 if parts.scheme == "http" else 443)
    opened: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=seconds).close()
            opened.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True, name="weights-probe")
    probe.start()
    probe.join(seconds)
    return bool(opened)


def _download_status(
    spec: ModelSpec, source: str, url: str, cache: str, fetch: str
) -> WeightsStatus:
    """ "download" when `url`'s host answers; else a ModelLoadError in one sentence (the
    weights are neither in `cache` nor reachable, and how to get them here)."""
    if _reachable(url):
        return WeightsStatus("download", f"{source} into {cache}")
    raise ModelLoadError(
        f"Model {spec.name!r}: the weights ({source}) are not in the cache ({cache}) and "
        f"{url} cannot be reached from here (no connection within {PROBE_SECONDS:.0f} s); "
        f"pre-fetch them on a machine with network access (`{fetch}`) and copy that cache "
        "here (or point model.cache_dir at the copy), or set model.pretrained to a local "
        "checkpoint file."
    )


def _check_local_dir(spec: ModelSpec, directory: str) -> WeightsStatus:
    config = Path(directory) / "open_clip_config.json"
    if not config.is_file():
        raise ModelLoadError(
            f"Model {spec.name!r}: {config} not found. A 'local-dir:' model needs a folder "
            "holding open_clip_config.json and the weights; fix model.name."
        )
    return WeightsStatus("cached", f"local folder {directory}")


def _check_hf_hub_name(spec: ModelSpec, repo_id: str) -> WeightsStatus:
    cache_dir = cache_dir_of(spec)
    cache = _hf_cache_dir(cache_dir)
    config = _cached_hub_file(repo_id, ["open_clip_config.json"], cache_dir)
    weights = _cached_hub_file(
        repo_id, [_oc_constants.HF_SAFE_WEIGHTS_NAME, _oc_constants.HF_WEIGHTS_NAME], cache_dir
    )
    if config is not None and weights is not None:
        return WeightsStatus("cached", weights)
    if _hf_offline():
        missing = "open_clip_config.json" if config is None else "its weights"
        raise ModelLoadError(
            f"Model {spec.name!r}: {repo_id} ({missing}) is not in the local Hugging Face "
            f"cache ({cache}) and cannot be downloaded here (HF_HUB_OFFLINE is set). Download "
            "it on a machine with network access and copy the cache (or set model.cache_dir "
            "to the copy), or use a built-in model.name with a local checkpoint path in "
            "model.pretrained."
        )
    fetch = f"huggingface-cli download {repo_id} --cache-dir {cache}"
    return _download_status(spec, f"hf-hub {repo_id}", _hub_endpoint(), cache, fetch)


def _check_own_weights(spec: ModelSpec, schema: str, ident: str) -> WeightsStatus:
    """Checks a ``hf-hub:`` / ``local-dir:`` model, which brings its own weights."""
    if spec.pretrained is not None:
        raise ModelLoadError(
            f"Model {spec.name!r} brings its own weights, so model.pretrained must be null "
            f"(got {spec.pretrained!r}); drop the '{schema}:' prefix to use a tag or path."
        )
    if schema == "local-dir":
        return _check_local_dir(spec, ident)
    return _check_hf_hub_name(spec, ident)


def _check_tag(spec: ModelSpec, arch: str, tag: str) -> WeightsStatus:
    """A pretrained tag's weights: cached, or to download (refused when offline)."""
    cfg = _oc_pretrained.get_pretrained_cfg(arch, tag)
    cache_dir = cache_dir_of(spec)
    cached, source = _cached_tag_file(cfg, cache_dir)
    if cached is not None:
        return WeightsStatus("cached", cached)
    hub = bool(cfg.get("hf_hub")) and _oc_pretrained.has_hf_hub()
    cache = _hf_cache_dir(cache_dir) if hub else _url_cache_dir(cache_dir)
    if _hf_offline():
        raise ModelLoadError(
            f"Pretrained weights for model {spec.name!r} tag {tag!r} ({source}) are "
            "not in the local cache and cannot be downloaded here (HF_HUB_OFFLINE is set). "
            + _FIX_OFFLINE.format(name=arch, tag=tag, cache=cache)
        )
    url = _hub_endpoint() if hub else str(cfg.get("url") or "")
    fetch = (
        f"python -c \"import open_clip; open_clip.create_model('{arch}', pretrained='{tag}', "
        f"cache_dir='{cache}')\""
    )
    return _download_status(spec, source, url, cache, fetch)


def _check_pretrained(spec: ModelSpec, arch: str, tag_or_path: str) -> WeightsStatus:
    """Checks that ``tag_or_path`` is a tag of ``arch`` (cached, when offline) or a file."""
    tags = _oc_pretrained.list_pretrained_tags_by_model(arch)
    if _oc_pretrained.is_pretrained_cfg(arch, tag_or_path):
        return _check_tag(spec, arch, tag_or_path)

    if is_url(tag_or_path):  # a checkpoint in shared storage (a run directory on S3)
        import fsspec

        fs, fs_path = fsspec.core.url_to_fs(tag_or_path)
        if fs.isfile(fs_path):
            return WeightsStatus("download", f"copied from {tag_or_path} where it is loaded")
        raise ModelLoadError(
            f"Checkpoint {tag_or_path!r} for model {spec.name!r} does not exist. Set "
            "model.pretrained to an existing checkpoint file (local path or fsspec URL), a "
            "pretrained tag, or null for a random init."
        )
    path = os.path.expanduser(tag_or_path)
    if os.path.isfile(path):
        return WeightsStatus("cached", f"local checkpoint {path}")
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


def check_weights_available(spec: ModelSpec) -> WeightsStatus:
    """Checks, without building the model, that ``spec`` can be loaded here.

    Runs on the driver before any Ray work starts, so config mistakes fail in milliseconds
    instead of inside a GPU actor. Touches only the filesystem (typically a few milliseconds
    even for a missing tag with ``HF_HUB_OFFLINE=1``), but for the one probe above.

    Checks, in order: known precision; known architecture (with close-name suggestions);
    ``pretrained`` is ``None``, a known tag for this architecture, or an existing file; and,
    when Hugging Face access is offline, that a tag's weights are already in the local cache
    (``spec.cache_dir``, else the default caches). Online, a tag that is not cached passes
    when its host (the hub's endpoint, ``HF_ENDPOINT``, or the tag's URL) accepts a
    connection within ``PROBE_SECONDS``: :func:`fetch_weights` will download it.

    Args:
        spec: The model to check.

    Returns:
        Whether the weights are a random init, cached here (a local checkpoint or folder, or
        in the download cache), or will be downloaded at run time, and from where.

    Raises:
        ModelLoadError: With a message naming the model, the tag or path, and the fix.
    """
    if spec.precision not in PRECISIONS:
        raise ModelLoadError(
            f"Unknown precision {spec.precision!r} for model {spec.name!r}: set "
            f"model.precision to one of {list(PRECISIONS)}."
        )
    schema, ident = split_schema(spec.name)
    if schema is not None:
        return _check_own_weights(spec, schema, ident)

    arch = arch_name(spec.name)
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
        return WeightsStatus("random")
    return _check_pretrained(spec, arch, spec.pretrained)


# --------------------------------------------------------------------------------------------
# Checkpoint files


def is_url(path: str) -> bool:
    """An fsspec URL such as s3://bucket/run/model.pt (not a local path)."""
    return "://" in path and not path.startswith("file://")


def weights_version(pretrained: str | None) -> int | None:
    """A value that changes when the checkpoint file `pretrained` is rewritten (fsspec's
    checksum of its listing: size and mtime, or the object's ETag on S3); None for a random
    init or an open_clip tag, whose weights never change under one name."""
    if pretrained is None:
        return None
    import fsspec

    path = pretrained if is_url(pretrained) else os.path.expanduser(pretrained)
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.isfile(fs_path):
        return None
    return fs.checksum(fs_path)


def local_copy(url: str) -> str:
    """A checkpoint URL copied to a local temporary file (torch and safetensors read local
    files); the copy is named after the URL and replaced on every call, atomically."""
    import tempfile

    import fsspec

    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "ncl-checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / f"{digest}-{os.path.basename(url)}"
    with fsspec.open(url, "rb") as src, open_atomic(dest) as out:
        for block in iter(lambda: src.read(1 << 20), b""):
            out.write(block)
    return str(dest)


def _unpickler_reason(exc: Exception) -> str:
    """The useful part of torch's long weights_only refusal, e.g. "Unsupported global: ..."."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # torch bolds part of it with ANSI codes
    _, marker, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if marker else text).splitlines() if line.strip()]
    reason = lines[0] if lines else type(exc).__name__
    return reason.split(" was not an allowed global", 1)[0]


def read_state_dict(path: str, spec: ModelSpec) -> dict[str, torch.Tensor]:
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
                "torch.save(model.state_dict(), path)."
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


def load_state_dict_strict(
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
