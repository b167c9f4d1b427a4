"""Pretrained weights fetched once, by the driver, before any worker starts.

Contract:
- `fetch_weights(spec)` downloads what open_clip's model factory would download for `spec` (a
  pretrained tag's file; an `hf-hub:` model's config and weights), with open_clip's own
  resolvers and the same arguments, into `spec.cache_dir` (None: open_clip's and Hugging
  Face's default caches), and returns the local file; a random init, a local file or folder
  fetches nothing (None). Already cached, it returns at once.
- Why: each embed actor and training worker builds its model with open_clip, which downloads
  an uncached tag itself. Started together on one shared cache (the RayJob's HF_HOME volume,
  or `model.cache_dir` on shared storage), that is one download per worker, all writing the
  same file (open_clip's URL downloads write in place). Fetched first, every worker finds the
  file cached. The cache must be one every node reads, else other nodes download again.
- Offline (HF_HUB_OFFLINE), `check_weights_available` has already refused an uncached tag;
  this module then only finds cached files.
"""

from __future__ import annotations

from open_clip import pretrained as _oc_pretrained

from pipeline.models.spec import ModelSpec, arch_name, split_schema
from pipeline.models.weights import cache_dir_of

__all__ = ["fetch_weights"]


def fetch_weights(spec: ModelSpec) -> str | None:
    """Download `spec`'s pretrained weights into its cache once; the local file, or None when
    there is nothing to download (random init, a local checkpoint, an unknown tag, which
    `check_weights_available` explains)."""
    if spec.pretrained is None and not spec.name.startswith("hf-hub:"):
        return None
    cache_dir = cache_dir_of(spec)
    schema, ident = split_schema(spec.name)
    if schema == "hf-hub":
        _oc_pretrained.download_pretrained_from_hf(
            ident, filename="open_clip_config.json", cache_dir=cache_dir
        )
        return _oc_pretrained.download_pretrained_from_hf(ident, cache_dir=cache_dir)
    if schema is not None or spec.pretrained is None:
        return None  # local-dir: nothing to download
    cfg = _oc_pretrained.get_pretrained_cfg(arch_name(ident), spec.pretrained)
    if not cfg:
        return None  # a local checkpoint path (or a tag check_weights_available refused)
    return _oc_pretrained.download_pretrained(cfg, cache_dir=cache_dir) or None
