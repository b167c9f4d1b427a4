"""open_clip's own trainer with this package's model configs registered.

Contract: `python -m pipeline.train_open_clip ARGS` is `python -m open_clip_train.main ARGS`
(open_clip_torch's training entry point, unchanged) after `pipeline/models/model_configs/*.json`
(e.g. `ncl-tiny`) are registered with open_clip, so `--model ncl-tiny` resolves. Use it to
train on a `ncl-pipeline export --format wds` directory with a packaged model config.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Register the packaged configs, then run `open_clip_train.main.main(argv)`."""
    try:
        from open_clip_train.main import main as open_clip_main
    except ImportError as exc:  # pragma: no cover - open_clip_torch ships it since 2.24
        raise ImportError(
            "open_clip_train is missing: install open_clip_torch>=2.24 (it ships the trainer)"
        ) from exc
    import pipeline.models.clip  # noqa: F401  (importing it registers the configs)

    open_clip_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
