"""Sampling the demo corpus: scenes per sample, then caption noise and damaged members.

Contract (part of :mod:`pipeline.data.synthetic`; the NCR / BiCro noise protocol):

- :func:`draw_samples` draws clean samples (scene, caption template, key) from one generator.
- :func:`apply_noise` makes ``n_mismatched`` samples ``mismatched`` (degree 0.0: the true
  caption of another mismatched sample, a constrained derangement whose donor scene differs in
  at least ``MIN_MISMATCH_DIFF`` attributes) and ``n_partial`` samples ``partial`` (degree 0.5:
  exactly one attribute of the caption changed). The rest stay ``clean`` (degree 1.0).
- :func:`apply_corruption` assigns ``CORRUPT_MODES`` round-robin over a seeded order.
- Every function is a pure function of its arguments and the generator state it is given.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.data.scenes import (
    ALLOWED_COLOURS,
    ATTRIBUTES,
    BACKGROUNDS,
    COLOURS,
    COUNTS,
    POSITIONS,
    SHAPES,
    SIZES,
    TEMPLATES,
    Scene,
    n_differences,
    render_caption,
)

__all__ = [
    "CORRUPT_MODES",
    "KIND_DEGREES",
    "MIN_MISMATCH_DIFF",
    "Sample",
    "apply_corruption",
    "apply_noise",
    "draw_samples",
    "fraction_count",
]

KIND_DEGREES: dict[str, float] = {"clean": 1.0, "partial": 0.5, "mismatched": 0.0}
CORRUPT_MODES: tuple[str, ...] = (
    "truncated_jpeg",  # scan data cut in half: Image.open works, .load() fails
    "empty_image",  # zero-byte .jpg member
    "missing_txt",  # no .txt member at all
    "invalid_utf8",  # .txt bytes that do not decode as UTF-8
    "empty_caption",  # .txt member present but empty
)
# A mismatched caption that differed in one attribute only would be a partial pair in disguise.
MIN_MISMATCH_DIFF = 2


def fraction_count(fraction: float, n: int) -> int:
    """``floor(fraction * n)``, the number of samples a fraction stands for."""
    # The epsilon absorbs float representation (0.29 * 100 == 28.999999999999996).
    return int(math.floor(fraction * n + 1e-9))


@dataclass(frozen=True)
class Sample:
    """One pair of the corpus as drawn: its scene, caption choice, key, noise and damage."""

    key: str
    shard: str
    scene: Scene
    template: int
    variant: int  # which synonym of the position phrase
    original_size: tuple[int, int]  # the fake pre-resize (width, height) img2dataset records
    kind: str = "clean"
    noisy_caption: str = ""
    changed_attribute: str | None = None
    corrupt: str | None = None

    @property
    def caption(self) -> str:
        return render_caption(self.scene, self.template, self.variant)


def draw_samples(
    n: int, samples_per_shard: int, shard_offset: int, image_size: int, rng: np.random.Generator
) -> list[Sample]:
    """Draw `n` clean samples (scene, template, key) from `rng`."""
    shapes = rng.integers(0, len(SHAPES), n)
    sizes = rng.integers(0, len(SIZES), n)
    positions = rng.integers(0, len(POSITIONS), n)
    counts = rng.integers(0, len(COUNTS), n)
    backgrounds = rng.integers(0, len(BACKGROUNDS), n)
    colour_draws = rng.integers(0, 1 << 30, n)  # reduced modulo the background's allowed list
    templates = rng.integers(0, len(TEMPLATES), n)
    variants = rng.integers(0, 2, n)
    # img2dataset records the size before resizing; any plausible web size will do.
    originals = rng.integers(image_size, 8 * image_size + 1, (n, 2))
    bg_names = list(BACKGROUNDS)
    out = []
    for i in range(n):
        shard, within = divmod(i, samples_per_shard)
        bg = bg_names[backgrounds[i]]
        allowed = ALLOWED_COLOURS[bg]
        scene = Scene(
            shape=SHAPES[shapes[i]],
            colour=allowed[colour_draws[i] % len(allowed)],
            size=SIZES[sizes[i]],
            position=POSITIONS[positions[i]],
            count=COUNTS[counts[i]],
            background=bg,
        )
        sample = Sample(
            key=f"{shard + shard_offset:05d}{within:04d}",
            shard=f"{shard:05d}",
            scene=scene,
            template=int(templates[i]),
            variant=int(variants[i]),
            original_size=(int(originals[i, 0]), int(originals[i, 1])),
        )
        out.append(dataclasses.replace(sample, noisy_caption=sample.caption))
    return out


def _alternatives(scene: Scene, attribute: str) -> list:
    """Values `attribute` may take in a one-attribute corruption of `scene`."""
    current = getattr(scene, attribute)
    if attribute == "colour":
        # Not the background's name either: "a white star on a white background" is nonsense.
        return [c for c in COLOURS if c not in (current, scene.background)]
    if attribute == "background":
        return [b for b in BACKGROUNDS if b not in (current, scene.colour)]
    values = {"shape": SHAPES, "size": SIZES, "position": POSITIONS, "count": COUNTS}[attribute]
    return [v for v in values if v != current]


def _make_partial(sample: Sample, rng: np.random.Generator) -> Sample:
    attribute = ATTRIBUTES[int(rng.integers(0, len(ATTRIBUTES)))]
    choices = _alternatives(sample.scene, attribute)
    wrong = dataclasses.replace(
        sample.scene, **{attribute: choices[int(rng.integers(0, len(choices)))]}
    )
    return dataclasses.replace(
        sample,
        kind="partial",
        noisy_caption=render_caption(wrong, sample.template, sample.variant),
        changed_attribute=attribute,
    )


def _assign_donors(
    receivers: np.ndarray, samples: list[Sample], rng: np.random.Generator
) -> dict[int, str]:
    """Pick, for every mismatched sample, the caption it receives.

    A random permutation of the receivers' own captions (the NCR protocol), repaired by swaps
    wherever a receiver would get its own caption or one too close to its scene. A receiver no
    swap can fix (tiny sets: one mismatched sample, near-identical scenes) borrows the caption
    of any other sample in the corpus, and as a last resort a freshly drawn scene's caption.
    """

    def ok(receiver: int, donor: int) -> bool:
        return receiver != donor and (
            n_differences(samples[receiver].scene, samples[donor].scene) >= MIN_MISMATCH_DIFF
        )

    rows = [int(r) for r in receivers]
    donor = dict(zip(rows, (int(d) for d in rng.permutation(rows)), strict=True))
    captions: dict[int, str] = {}
    for r in rows:
        if not ok(r, donor[r]):
            for other in rng.permutation(rows):
                other = int(other)
                if ok(r, donor[other]) and ok(other, donor[r]):
                    donor[r], donor[other] = donor[other], donor[r]
                    break
        if ok(r, donor[r]):
            continue
        for any_sample in rng.permutation(len(samples)):
            if ok(r, int(any_sample)):
                captions[r] = samples[int(any_sample)].caption
                break
        else:
            captions[r] = _unrelated_caption(samples[r], rng)
    for r in rows:
        captions.setdefault(r, samples[donor[r]].caption)
    return captions


def _unrelated_caption(sample: Sample, rng: np.random.Generator) -> str:
    """A caption whose scene differs from `sample`'s in every attribute."""
    scene = sample.scene
    changes: dict[str, Any] = {}
    for attribute in ATTRIBUTES:
        choices = _alternatives(dataclasses.replace(scene, **changes), attribute)
        changes[attribute] = choices[int(rng.integers(0, len(choices)))]
    return render_caption(Scene(**changes), sample.template, sample.variant)


def apply_noise(
    samples: list[Sample], n_mismatched: int, n_partial: int, rng: np.random.Generator
) -> list[Sample]:
    order = rng.permutation(len(samples))
    mismatched = np.sort(order[:n_mismatched])
    partial = np.sort(order[n_mismatched : n_mismatched + n_partial])
    out = list(samples)
    for i in partial:
        out[i] = _make_partial(samples[i], rng)
    for i, caption in _assign_donors(mismatched, samples, rng).items():
        out[i] = dataclasses.replace(samples[i], kind="mismatched", noisy_caption=caption)
    return out


def apply_corruption(
    samples: list[Sample], n_corrupt: int, rng: np.random.Generator
) -> list[Sample]:
    out = list(samples)
    # Round-robin over a seeded order: every mode appears once n_corrupt >= len(CORRUPT_MODES).
    for rank, i in enumerate(rng.permutation(len(samples))[:n_corrupt]):
        out[i] = dataclasses.replace(out[i], corrupt=CORRUPT_MODES[rank % len(CORRUPT_MODES)])
    return out
