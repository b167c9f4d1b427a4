"""Noisy demo corpus generator: procedurally drawn scenes in the img2dataset layout.

Contract (docs/architecture.md §4.1 and §6; file names and ground-truth columns are a contract):

``make_corpus(out_dir, ...)`` writes::

    out_dir/00000.tar            img2dataset WebDataset shards; per sample, in this order,
                                 ``{key}.jpg``, ``{key}.txt``, ``{key}.json``
    out_dir/00000.parquet        img2dataset metadata table (``IMG2DATASET_SCHEMA``)
    out_dir/00000_stats.json     img2dataset shard stats
    out_dir/ground_truth.parquet ``GROUND_TRUTH_SCHEMA``: key, shard, kind, degree, caption
                                 (the original, true caption), noisy_caption (the one in the
                                 tar), changed_attribute, corrupt
    out_dir/test/...             the same layout for a clean held-out split, with its own
                                 ``test/ground_truth.parquet``

- Keys are 9 digits, img2dataset style: 5-digit shard index + 4-digit index within the shard
  (shard 3, sample 17 -> ``000030017``). Held-out shards are numbered from ``00000`` under
  ``test/`` but their keys use shard prefixes from 90000, so keys are unique across both splits.
- Noise (the NCR / BiCro protocol): ``floor(noise * samples)`` samples are ``mismatched``
  (degree 0.0): their caption is the true caption of another mismatched sample (a constrained
  derangement; the donor's scene differs in at least ``MIN_MISMATCH_DIFF`` attributes).
  ``floor(partial * samples)`` samples are ``partial`` (degree 0.5): exactly one attribute of
  the caption is changed. The rest are ``clean`` (degree 1.0). The held-out split is all clean.
- ``floor(corrupt * samples)`` training samples get one damaged member (``CORRUPT_MODES``,
  assigned round-robin in a seeded order); they stay in the ground truth with the kind they
  were drawn as, and ``corrupt`` names the damage. Their json/parquet ``sha256`` is the hash of
  the intact JPEG, as it would be for data damaged after download.
- Everything except the wall-clock fields of ``*_stats.json`` is a pure function of the
  arguments: the same seed gives byte-identical tars and Parquet files.
- Every caption parses back to its scene with ``parse_caption`` (used by tests and analysis).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import re
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

__all__ = [
    "ATTRIBUTES",
    "BACKGROUNDS",
    "COLOURS",
    "COUNTS",
    "CORRUPT_MODES",
    "GROUND_TRUTH_SCHEMA",
    "IMG2DATASET_SCHEMA",
    "KIND_DEGREES",
    "MIN_MISMATCH_DIFF",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "TEMPLATES",
    "TEST_SHARD_OFFSET",
    "CorpusSummary",
    "Scene",
    "make_corpus",
    "parse_caption",
    "render_caption",
]

# --------------------------------------------------------------------------------------------
# Vocabulary. Colours are far apart in RGB so a 64 px JPEG keeps them distinguishable.
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross", "diamond")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (40, 80, 235),
    "yellow": (245, 225, 30),
    "purple": (150, 50, 200),
    "cyan": (0, 200, 220),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "grey": (128, 128, 128),
    "white": (240, 240, 240),
    "black": (20, 20, 20),
    "beige": (215, 195, 150),
}
SIZES: tuple[str, ...] = ("small", "large")
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom", "centre")
COUNTS: tuple[int, ...] = (1, 2, 3)
ATTRIBUTES: tuple[str, ...] = ("shape", "colour", "size", "position", "count", "background")

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
# Held-out keys start at this shard prefix so they never collide with training keys.
TEST_SHARD_OFFSET = 90_000

# Caption templates: {obj} = "two small red circles", {pos} = "on the left", {a_bg} = "a grey",
# {be} = "is" / "are". Every template names all six attributes, so one changed attribute is
# always visible in the text and parse_caption can invert every caption.
TEMPLATES: tuple[str, ...] = (
    "{obj} {pos} on {a_bg} background",
    "{obj} {pos} of {a_bg} picture",
    "there {be} {obj} {pos} of {a_bg} image",
    "{a_bg} background with {obj} {pos}",
    "{obj} against {a_bg} backdrop, {pos}",
    "photo of {obj} {pos}, {bg} background",
)
_POSITION_PHRASES: dict[str, tuple[str, ...]] = {
    "left": ("on the left",),
    "right": ("on the right",),
    "top": ("at the top",),
    "bottom": ("at the bottom",),
    "centre": ("in the middle", "in the centre"),
}
_COUNT_WORDS = {2: "two", 3: "three"}
_PLURALS = {shape: shape + ("es" if shape.endswith("s") else "s") for shape in SHAPES}

# Geometry, as fractions of the image side. Large objects must still fit three in a row.
_RADIUS = {"small": 0.085, "large": 0.14}
_ANCHORS = {
    "left": (0.27, 0.5),
    "right": (0.73, 0.5),
    "top": (0.5, 0.27),
    "bottom": (0.5, 0.73),
    "centre": (0.5, 0.5),
}
_MIN_CONTRAST = 120.0  # RGB distance object/background below which the object is hard to see
_SUPERSAMPLE = 2  # draw at 2x and box-reduce: cheap anti-aliasing so small shapes keep outlines
_JPEG_QUALITY = 90
_TAR_MTIME = 946_684_800  # fixed (2000-01-01) so tar bytes do not depend on when they were made
_MAX_PER_SHARD = 10_000  # the 4-digit in-shard part of a key

# Seed streams: independent numpy Generators per purpose, so e.g. changing `corrupt` does not
# reshuffle which samples are noisy.
_STREAM_SCENES, _STREAM_NOISE, _STREAM_CORRUPT, _STREAM_PIXELS = 1, 2, 3, 4
_SPLIT_TRAIN, _SPLIT_TEST = 0, 1

_SHARD_FILE = re.compile(r"^\d{5}(\.tar|\.parquet|_stats\.json)(\.tmp)?$")

IMG2DATASET_SCHEMA = pa.schema(
    [
        pa.field("url", pa.string()),
        pa.field("caption", pa.string()),
        pa.field("key", pa.string()),
        pa.field("status", pa.string()),
        pa.field("error_message", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("original_width", pa.int32()),
        pa.field("original_height", pa.int32()),
        pa.field("exif", pa.string()),
        pa.field("sha256", pa.string()),
    ]
)

GROUND_TRUTH_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),  # tar basename without .tar, e.g. 00003
        pa.field("kind", pa.string(), nullable=False),  # clean | partial | mismatched
        pa.field("degree", pa.float32(), nullable=False),  # 1.0 | 0.5 | 0.0
        pa.field("caption", pa.string(), nullable=False),  # true caption of the image
        pa.field("noisy_caption", pa.string(), nullable=False),  # caption written to the tar
        pa.field("changed_attribute", pa.string(), nullable=True),  # partial pairs only
        pa.field("corrupt", pa.string(), nullable=True),  # a CORRUPT_MODES entry, or null
    ],
    metadata={"ncl.schema": "ground_truth.v1"},
)


@dataclass(frozen=True)
class Scene:
    """What an image shows; a caption names all six attributes."""

    shape: str  # one of SHAPES
    colour: str  # one of COLOURS (object colour)
    size: str  # one of SIZES
    position: str  # one of POSITIONS
    count: int  # one of COUNTS; all objects share shape, colour and size
    background: str  # one of BACKGROUNDS


@dataclass(frozen=True)
class CorpusSummary:
    """What `make_corpus` wrote. Paths are strings; sequences are tuples (immutable)."""

    out_dir: str
    shards: tuple[str, ...]  # training tar paths, in key order
    test_shards: tuple[str, ...]  # held-out tar paths (empty when test_samples == 0)
    ground_truth: str  # out_dir/ground_truth.parquet
    test_ground_truth: str | None  # out_dir/test/ground_truth.parquet, or None
    samples: int  # training samples, corrupt ones included
    test_samples: int
    counts: dict[str, int]  # training samples per kind: clean / partial / mismatched
    corrupt: int  # training samples with a damaged member
    corrupt_counts: dict[str, int]  # per CORRUPT_MODES entry (zeros included)
    seed: int


@dataclass(frozen=True)
class _Sample:
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


# --------------------------------------------------------------------------------------------
# Captions


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def render_caption(scene: Scene, template: int = 0, variant: int = 0) -> str:
    """Render the caption of `scene` with one of `TEMPLATES`.

    Args:
        scene: the attributes to describe.
        template: index into `TEMPLATES` (taken modulo its length).
        variant: picks a synonym where a phrase has several (taken modulo their number).

    Returns:
        A lower-case English caption naming all six attributes, e.g.
        ``"two small green triangles at the top on a grey background"``.
    """
    noun = scene.shape if scene.count == 1 else _PLURALS[scene.shape]
    phrase = f"{scene.size} {scene.colour} {noun}"
    count_word = _article(phrase) if scene.count == 1 else _COUNT_WORDS[scene.count]
    phrases = _POSITION_PHRASES[scene.position]
    return TEMPLATES[template % len(TEMPLATES)].format(
        obj=f"{count_word} {phrase}",
        pos=phrases[variant % len(phrases)],
        a_bg=f"{_article(scene.background)} {scene.background}",
        bg=scene.background,
        be="is" if scene.count == 1 else "are",
    )


def _alternation(words: Sequence[str]) -> str:
    # Longest first so "crosses" is not matched as "cross" + leftover text.
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


def _build_parsers() -> tuple[re.Pattern[str], ...]:
    nouns = list(SHAPES) + list(_PLURALS.values())
    pos_words = [p for phrases in _POSITION_PHRASES.values() for p in phrases]
    parts = {
        "obj": (
            rf"(?P<count>a|an|{_alternation(list(_COUNT_WORDS.values()))}) "
            rf"(?P<size>{_alternation(SIZES)}) (?P<colour>{_alternation(list(COLOURS))}) "
            rf"(?P<noun>{_alternation(nouns)})"
        ),
        "pos": rf"(?P<pos>{_alternation(pos_words)})",
        "a_bg": rf"(?:a|an) (?P<bg>{_alternation(list(BACKGROUNDS))})",
        "bg": rf"(?P<bg>{_alternation(list(BACKGROUNDS))})",
        "be": r"(?:is|are)",
    }
    patterns = []
    for template in TEMPLATES:
        # Escape the literal text between placeholders, then splice the groups in.
        pieces = re.split(r"\{(\w+)\}", template)
        regex = "".join(
            parts[piece] if i % 2 else re.escape(piece) for i, piece in enumerate(pieces)
        )
        patterns.append(re.compile(f"^{regex}$"))
    return tuple(patterns)


_PARSERS = _build_parsers()
_NOUN_TO_SHAPE = {**{s: s for s in SHAPES}, **{p: s for s, p in _PLURALS.items()}}
_PHRASE_TO_POSITION = {p: pos for pos, phrases in _POSITION_PHRASES.items() for p in phrases}
_WORD_TO_COUNT = {"a": 1, "an": 1, **{w: n for n, w in _COUNT_WORDS.items()}}


def parse_caption(caption: str) -> Scene | None:
    """Invert `render_caption`.

    Args:
        caption: a caption produced by `render_caption` (any template, any variant).

    Returns:
        The scene it describes, or None when it matches no template.
    """
    for pattern in _PARSERS:
        match = pattern.match(caption)
        if match is not None:
            return Scene(
                shape=_NOUN_TO_SHAPE[match["noun"]],
                colour=match["colour"],
                size=match["size"],
                position=_PHRASE_TO_POSITION[match["pos"]],
                count=_WORD_TO_COUNT[match["count"]],
                background=match["bg"],
            )
    return None


def _n_differences(a: Scene, b: Scene) -> int:
    return sum(getattr(a, name) != getattr(b, name) for name in ATTRIBUTES)


# --------------------------------------------------------------------------------------------
# Drawing


def _allowed_colours(background: str) -> list[str]:
    bg = BACKGROUNDS[background]
    return [c for c, rgb in COLOURS.items() if math.dist(rgb, bg) >= _MIN_CONTRAST]


_ALLOWED_COLOURS = {bg: _allowed_colours(bg) for bg in BACKGROUNDS}


def _shape_points(shape: str, cx: float, cy: float, r: float, rot: float) -> list[tuple]:
    """Polygon vertices (pixels) of `shape` centred at (cx, cy) with nominal radius `r`."""
    if shape == "square":
        h = 0.85 * r  # area close to the circle's, so size reads the same for every shape
        pts = [(-h, -h), (h, -h), (h, h), (-h, h)]
    elif shape == "diamond":
        pts = [(0.0, -1.1 * r), (0.75 * r, 0.0), (0.0, 1.1 * r), (-0.75 * r, 0.0)]
    elif shape == "triangle":
        # Pointing up; shifted down by 0.2 r so its visual centre sits on (cx, cy).
        pts = [
            (1.15 * r * math.cos(a), 1.15 * r * math.sin(a) + 0.2 * r)
            for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)
        ]
    elif shape == "star":
        pts = [
            (
                (r if k % 2 == 0 else 0.45 * r) * math.cos(-math.pi / 2 + k * math.pi / 5),
                (r if k % 2 == 0 else 0.45 * r) * math.sin(-math.pi / 2 + k * math.pi / 5),
            )
            for k in range(10)
        ]
    elif shape == "cross":
        w = 0.32 * r
        pts = [
            (-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w),
            (w, r), (-w, r), (-w, w), (-r, w), (-r, -w), (-w, -w),
        ]  # fmt: skip
    else:
        raise ValueError(f"no polygon for shape {shape!r}")
    c, s = math.cos(rot), math.sin(rot)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def _jitter_rgb(
    rgb: tuple[int, int, int], rng: np.random.Generator, shift: int, tint: int
) -> tuple[int, int, int]:
    # A shared brightness shift plus a small per-channel tint: a per-channel-only jitter as
    # large would turn a white background pink or a grey one green.
    jittered = np.asarray(rgb) + rng.integers(-shift, shift + 1) + rng.integers(-tint, tint + 1, 3)
    r, g, b = (int(v) for v in np.clip(jittered, 0, 255))
    return r, g, b


def _draw_scene(scene: Scene, image_size: int, rng: np.random.Generator) -> Image.Image:
    """Draw `scene` as an RGB image of side `image_size` with light jitter and pixel noise."""
    side = image_size * _SUPERSAMPLE
    img = Image.new("RGB", (side, side), _jitter_rgb(BACKGROUNDS[scene.background], rng, 10, 3))
    draw = ImageDraw.Draw(img)
    colour = _jitter_rgb(COLOURS[scene.colour], rng, 10, 6)
    radius = _RADIUS[scene.size]
    ax, ay = _ANCHORS[scene.position]
    # Several objects line up across the position's axis: a column on the left/right, a row
    # elsewhere, so "two ... on the left" and "two ... at the top" look different.
    along_y = scene.position in ("left", "right")
    spacing = 2.3 * radius  # centre to centre; jittered radii stay apart
    for k in range(scene.count):
        offset = (k - (scene.count - 1) / 2) * spacing
        cx = ax + (0.0 if along_y else offset) + rng.uniform(-0.025, 0.025)
        cy = ay + (offset if along_y else 0.0) + rng.uniform(-0.025, 0.025)
        r = radius * rng.uniform(0.9, 1.1) * side
        cx, cy = cx * side, cy * side
        rot = rng.uniform(-0.14, 0.14)  # ~8 degrees: never enough to turn a square into a diamond
        if scene.shape == "circle":
            draw.ellipse((cx - 0.95 * r, cy - 0.95 * r, cx + 0.95 * r, cy + 0.95 * r), fill=colour)
        else:
            draw.polygon(_shape_points(scene.shape, cx, cy, r, rot), fill=colour)
    img = img.reduce(_SUPERSAMPLE)
    pixels = np.asarray(img, dtype=np.int16) + rng.integers(
        -4, 5, (image_size, image_size, 3), dtype=np.int16
    )
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def _encode_jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    # 4:4:4 chroma: 4:2:0 would smear the colour of 10 px objects into the background.
    img.save(buf, format="JPEG", quality=_JPEG_QUALITY, subsampling=0)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# Sampling scenes and noise


def _draw_samples(
    n: int, samples_per_shard: int, shard_offset: int, image_size: int, rng: np.random.Generator
) -> list[_Sample]:
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
        allowed = _ALLOWED_COLOURS[bg]
        scene = Scene(
            shape=SHAPES[shapes[i]],
            colour=allowed[colour_draws[i] % len(allowed)],
            size=SIZES[sizes[i]],
            position=POSITIONS[positions[i]],
            count=COUNTS[counts[i]],
            background=bg,
        )
        sample = _Sample(
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


def _make_partial(sample: _Sample, rng: np.random.Generator) -> _Sample:
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
    receivers: np.ndarray, samples: list[_Sample], rng: np.random.Generator
) -> dict[int, str]:
    """Pick, for every mismatched sample, the caption it receives.

    A random permutation of the receivers' own captions (the NCR protocol), repaired by swaps
    wherever a receiver would get its own caption or one too close to its scene. A receiver no
    swap can fix (tiny sets: one mismatched sample, near-identical scenes) borrows the caption
    of any other sample in the corpus, and as a last resort a freshly drawn scene's caption.
    """

    def ok(receiver: int, donor: int) -> bool:
        return receiver != donor and (
            _n_differences(samples[receiver].scene, samples[donor].scene) >= MIN_MISMATCH_DIFF
        )

    receivers = [int(r) for r in receivers]
    donor = dict(zip(receivers, (int(d) for d in rng.permutation(receivers)), strict=True))
    captions: dict[int, str] = {}
    for r in receivers:
        if not ok(r, donor[r]):
            for other in rng.permutation(receivers):
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
    for r in receivers:
        captions.setdefault(r, samples[donor[r]].caption)
    return captions


def _unrelated_caption(sample: _Sample, rng: np.random.Generator) -> str:
    """A caption whose scene differs from `sample`'s in every attribute."""
    scene = sample.scene
    changes = {}
    for attribute in ATTRIBUTES:
        choices = _alternatives(dataclasses.replace(scene, **changes), attribute)
        changes[attribute] = choices[int(rng.integers(0, len(choices)))]
    return render_caption(Scene(**changes), sample.template, sample.variant)


def _apply_noise(
    samples: list[_Sample], n_mismatched: int, n_partial: int, rng: np.random.Generator
) -> list[_Sample]:
    order = rng.permutation(len(samples))
    mismatched = np.sort(order[:n_mismatched])
    partial = np.sort(order[n_mismatched : n_mismatched + n_partial])
    out = list(samples)
    for i in partial:
        out[i] = _make_partial(samples[i], rng)
    for i, caption in _assign_donors(mismatched, samples, rng).items():
        out[i] = dataclasses.replace(samples[i], kind="mismatched", noisy_caption=caption)
    return out


def _apply_corruption(
    samples: list[_Sample], n_corrupt: int, rng: np.random.Generator
) -> list[_Sample]:
    out = list(samples)
    # Round-robin over a seeded order: every mode appears once n_corrupt >= len(CORRUPT_MODES).
    for rank, i in enumerate(rng.permutation(len(samples))[:n_corrupt]):
        out[i] = dataclasses.replace(out[i], corrupt=CORRUPT_MODES[rank % len(CORRUPT_MODES)])
    return out


# --------------------------------------------------------------------------------------------
# Writing


def _damage(mode: str | None, jpg: bytes, txt: bytes | None) -> tuple[bytes, bytes | None]:
    """Return the (image, caption) member bytes as written; None means no .txt member."""
    if mode is None:
        return jpg, txt
    if mode == "truncated_jpeg":
        # Cut halfway through the entropy-coded data after the start-of-scan marker, so the
        # headers parse (Image.open succeeds) and only decoding fails, as with a cut download.
        start_of_scan = max(jpg.find(b"\xff\xda"), 0)
        return jpg[: start_of_scan + (len(jpg) - start_of_scan) // 2], txt
    if mode == "empty_image":
        return b"", txt
    if mode == "missing_txt":
        return jpg, None
    if mode == "invalid_utf8":
        # 0xff never occurs in UTF-8; a lone continuation byte mid-text is invalid as well.
        half = len(txt) // 2
        return jpg, b"\xff" + txt[:half] + b"\x80" + txt[half:]
    if mode == "empty_caption":
        return jpg, b""
    raise ValueError(f"unknown corrupt mode {mode!r}; expected one of {CORRUPT_MODES}")


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = _TAR_MTIME
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def _write_shard(
    directory: Path,
    shard: str,
    samples: Sequence[_Sample],
    image_size: int,
    rng: np.random.Generator,
) -> Path:
    """Write `shard`.tar, .parquet and _stats.json for `samples`; return the tar path."""
    start = time.time()
    rows = []
    tar_path = directory / f"{shard}.tar"
    tmp = directory / f"{shard}.tar.tmp"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            jpg = _encode_jpeg(_draw_scene(sample.scene, image_size, rng))
            caption = "" if sample.corrupt == "empty_caption" else sample.noisy_caption
            meta = {
                "url": f"https://example.invalid/img/{sample.key}.jpg",
                "caption": caption,
                "key": sample.key,
                "status": "success",
                "error_message": None,
                "width": image_size,
                "height": image_size,
                "original_width": sample.original_size[0],
                "original_height": sample.original_size[1],
                "exif": None,
                "sha256": hashlib.sha256(jpg).hexdigest(),
            }
            rows.append(meta)
            jpg_bytes, txt_bytes = _damage(sample.corrupt, jpg, caption.encode("utf-8"))
            _add_member(tar, f"{sample.key}.jpg", jpg_bytes)
            if txt_bytes is not None:
                _add_member(tar, f"{sample.key}.txt", txt_bytes)
            _add_member(tar, f"{sample.key}.json", json.dumps(meta, indent=4).encode("utf-8"))
    os.replace(tmp, tar_path)

    table = pa.Table.from_pylist(rows, schema=IMG2DATASET_SCHEMA)
    tmp = directory / f"{shard}.parquet.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, directory / f"{shard}.parquet")

    end = time.time()
    stats = {
        "count": len(samples),
        "successes": len(samples),
        "failed_to_download": 0,
        "failed_to_resize": 0,
        "duration": end - start,
        "start_time": start,
        "end_time": end,
        "status_dict": {"success": len(samples)},
    }
    tmp = directory / f"{shard}_stats.json.tmp"
    tmp.write_text(json.dumps(stats, indent=4))
    os.replace(tmp, directory / f"{shard}_stats.json")
    return tar_path


def _write_ground_truth(path: Path, samples: Sequence[_Sample], params: dict) -> None:
    columns = {
        "key": [s.key for s in samples],
        "shard": [s.shard for s in samples],
        "kind": [s.kind for s in samples],
        "degree": [KIND_DEGREES[s.kind] for s in samples],
        "caption": [s.caption for s in samples],
        "noisy_caption": [s.noisy_caption for s in samples],
        "changed_attribute": [s.changed_attribute for s in samples],
        "corrupt": [s.corrupt for s in samples],
    }
    schema = GROUND_TRUTH_SCHEMA.with_metadata(
        {**GROUND_TRUTH_SCHEMA.metadata, b"ncl.make_corpus": json.dumps(params, sort_keys=True)}
    )
    table = pa.table(columns, schema=schema)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _write_split(
    directory: Path,
    samples: list[_Sample],
    samples_per_shard: int,
    image_size: int,
    seed: int,
    split: int,
) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, len(samples), samples_per_shard):
        chunk = samples[start : start + samples_per_shard]
        # One pixel stream per shard: a shard's bytes do not depend on how the others were made.
        rng = np.random.default_rng([seed, _STREAM_PIXELS, split, start // samples_per_shard])
        paths.append(str(_write_shard(directory, chunk[0].shard, chunk, image_size, rng)))
    return paths


def _clear_previous(out: Path) -> None:
    """Remove a previous corpus's files so no stale shard survives; refuse foreign data."""
    stale = [p for p in out.iterdir() if _SHARD_FILE.match(p.name)] if out.is_dir() else []
    if not stale:
        return
    if not (out / "ground_truth.parquet").exists():
        raise ValueError(
            f"{out} already holds shard files but no ground_truth.parquet, so it is not a corpus "
            "written by make_corpus; choose an empty or new out_dir"
        )
    test = out / "test"
    if test.is_dir():
        stale += [p for p in test.iterdir() if _SHARD_FILE.match(p.name)]
        stale += [test / "ground_truth.parquet"]
    stale += [out / "ground_truth.parquet"]
    for path in stale:
        path.unlink(missing_ok=True)
    if test.is_dir() and not any(test.iterdir()):
        test.rmdir()  # a rerun with test_samples=0 must not leave an empty test/ behind


def _count(fraction: float, samples: int) -> int:
    # The epsilon absorbs float representation (0.29 * 100 == 28.999999999999996).
    return int(math.floor(fraction * samples + 1e-9))


def _validate(
    samples: int,
    noise: float,
    partial: float,
    seed: int,
    samples_per_shard: int,
    test_samples: int,
    image_size: int,
    corrupt: float,
) -> None:
    def is_int(x: object) -> bool:
        return isinstance(x, int | np.integer) and not isinstance(x, bool)

    for name, value in (("noise", noise), ("partial", partial), ("corrupt", corrupt)):
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        if not (0.0 <= value <= 1.0):
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
    if noise + partial > 1.0 + 1e-9:
        raise ValueError(
            f"noise + partial must be <= 1 (got {noise} + {partial} = {noise + partial}); "
            "lower one of them"
        )
    if not is_int(samples) or samples < 2:
        raise ValueError(f"samples must be an integer >= 2, got {samples!r}")
    if not is_int(test_samples) or test_samples < 0:
        raise ValueError(
            f"test_samples must be an integer >= 0 (0 skips test/), got {test_samples!r}"
        )
    if not is_int(samples_per_shard) or not 1 <= samples_per_shard <= _MAX_PER_SHARD:
        raise ValueError(
            f"samples_per_shard must be an integer in [1, {_MAX_PER_SHARD}] (keys keep 4 digits "
            f"for the index within a shard), got {samples_per_shard!r}"
        )
    if not is_int(image_size) or not 32 <= image_size <= 1024:
        raise ValueError(
            f"image_size must be an integer in [32, 1024] (smaller images lose the attributes), "
            f"got {image_size!r}"
        )
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if math.ceil(samples / samples_per_shard) > TEST_SHARD_OFFSET:
        raise ValueError(
            f"{samples} samples at {samples_per_shard} per shard need more than "
            f"{TEST_SHARD_OFFSET} shards; raise samples_per_shard"
        )
    if math.ceil(test_samples / samples_per_shard) > 100_000 - TEST_SHARD_OFFSET:
        raise ValueError(
            f"test_samples={test_samples} needs more than {100_000 - TEST_SHARD_OFFSET} shards; "
            "raise samples_per_shard or lower test_samples"
        )


def make_corpus(
    out_dir: str | os.PathLike,
    *,
    samples: int = 4000,
    noise: float = 0.4,
    partial: float = 0.1,
    seed: int = 0,
    samples_per_shard: int = 500,
    test_samples: int = 500,
    image_size: int = 64,
    corrupt: float = 0.0,
) -> CorpusSummary:
    """Write a noisy synthetic image-text corpus in the img2dataset layout (see module docs).

    Args:
        out_dir: local directory; created if missing. A previous make_corpus output there is
            replaced; a directory with other shard files is refused.
        samples: training pairs, >= 2.
        noise: fraction of training pairs given another pair's caption (kind ``mismatched``);
            ``floor(noise * samples)`` pairs.
        partial: fraction given a caption with exactly one attribute changed (``partial``);
            ``floor(partial * samples)`` pairs. ``noise + partial <= 1``.
        seed: non-negative integer; same seed, same bytes.
        samples_per_shard: pairs per tar, in [1, 10000]; the last shard may be shorter.
        test_samples: clean held-out pairs written under ``out_dir/test/``; 0 writes none.
        image_size: side of the square JPEGs in pixels, in [32, 1024].
        corrupt: fraction of training pairs with one damaged member (``CORRUPT_MODES``);
            ``floor(corrupt * samples)`` pairs, independent of their kind.

    Returns:
        A `CorpusSummary` of the paths written and the counts per kind.

    Raises:
        ValueError: an argument is out of range (the message says the allowed range), or
            out_dir holds shard files that make_corpus did not write.
    """
    _validate(samples, noise, partial, seed, samples_per_shard, test_samples, image_size, corrupt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out)
    params = {
        "samples": samples,
        "noise": noise,
        "partial": partial,
        "seed": seed,
        "samples_per_shard": samples_per_shard,
        "test_samples": test_samples,
        "image_size": image_size,
        "corrupt": corrupt,
    }

    train = _draw_samples(
        samples,
        samples_per_shard,
        0,
        image_size,
        np.random.default_rng([seed, _STREAM_SCENES, _SPLIT_TRAIN]),
    )
    train = _apply_noise(
        train,
        _count(noise, samples),
        _count(partial, samples),
        np.random.default_rng([seed, _STREAM_NOISE]),
    )
    train = _apply_corruption(
        train, _count(corrupt, samples), np.random.default_rng([seed, _STREAM_CORRUPT])
    )
    shards = _write_split(out, train, samples_per_shard, image_size, seed, _SPLIT_TRAIN)

    test_shards: list[str] = []
    test_gt = None
    if test_samples:
        test = _draw_samples(
            test_samples,
            samples_per_shard,
            TEST_SHARD_OFFSET,
            image_size,
            np.random.default_rng([seed, _STREAM_SCENES, _SPLIT_TEST]),
        )
        test_shards = _write_split(
            out / "test", test, samples_per_shard, image_size, seed, _SPLIT_TEST
        )
        test_gt = out / "test" / "ground_truth.parquet"
        _write_ground_truth(test_gt, test, {**params, "split": "test"})
    # Written last: its presence marks a complete corpus (and lets a rerun replace it).
    _write_ground_truth(out / "ground_truth.parquet", train, {**params, "split": "train"})

    counts = {kind: 0 for kind in KIND_DEGREES}
    corrupt_counts = {mode: 0 for mode in CORRUPT_MODES}
    for sample in train:
        counts[sample.kind] += 1
        if sample.corrupt is not None:
            corrupt_counts[sample.corrupt] += 1
    return CorpusSummary(
        out_dir=str(out),
        shards=tuple(shards),
        test_shards=tuple(test_shards),
        ground_truth=str(out / "ground_truth.parquet"),
        test_ground_truth=None if test_gt is None else str(test_gt),
        samples=samples,
        test_samples=test_samples,
        counts=counts,
        corrupt=sum(corrupt_counts.values()),
        corrupt_counts=corrupt_counts,
        seed=seed,
    )
