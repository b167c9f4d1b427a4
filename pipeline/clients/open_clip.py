"""open_clip's own trainer with this package's model configs registered.

Contract: `python -m pipeline.clients.open_clip ARGS` is `python -m open_clip_train.main ARGS`
(open_clip_torch's training entry point, unchanged) after two set-up steps:
- `pipeline/models/model_configs/*.json` (e.g. `ncl-tiny`) are registered with open_clip, so
  `--model ncl-tiny` resolves;
- the known webdataset incompatibility of `open_clip_train` is fixed the way both trackers
  propose (webdataset issue 384, open_clip issue 935): webdataset >= 0.2.96's
  `tar_file_expander` yields an end-of-shard marker `{}` that open_clip_train's
  `group_by_keys_nothrow` cannot read (`KeyError: 'fname'`), so `--dataset-type webdataset`
  fails with any current webdataset; we pass `eof_value=None` to it. Nothing else changes.
Use it to train on a `ncl-pipeline export --format wds` directory.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _fix_webdataset_eof_marker() -> bool:
    """Make open_clip_train's tar expansion yield no end-of-shard marker (see the contract).

    Returns:
        True when the fix was needed and applied (webdataset has `eof_value`).
    """
    import open_clip_train.data as data
    from webdataset import tariterators

    expander: Callable[..., Any] = tariterators.tar_file_expander
    if "eof_value" not in inspect.signature(expander).parameters:
        return False  # webdataset < 0.2.96: no marker, nothing to fix
    if getattr(data, "tar_file_expander", None) is not expander:
        return False  # open_clip_train no longer uses it directly (fixed upstream)
    data.tar_file_expander = functools.partial(expander, eof_value=None)
    return True


def main(argv: list[str] | None = None) -> None:
    """Register the packaged configs, fix the marker, run `open_clip_train.main.main(argv)`."""
    try:
        from open_clip_train.main import main as open_clip_main
    except ImportError as exc:  # pragma: no cover - open_clip_torch ships it since 2.24
        raise ImportError(
            "open_clip_train is missing: install open_clip_torch>=2.24 (it ships the trainer)"
        ) from exc
    import pipeline.models.clip  # noqa: F401  (importing it registers the configs)

    if _fix_webdataset_eof_marker():
        logger.info("open_clip_train: webdataset end-of-shard marker disabled (eof_value=None)")
    open_clip_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
