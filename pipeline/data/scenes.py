"""Scenes of the demo corpus: the vocabulary, captions that name a scene, and drawing it.

Contract (part of :mod:`pipeline.data.synthetic`):

- A :class:`Scene` has six attributes (``ATTRIBUTES``): shape, colour, size, position, count,
  background. :func:`render_caption` names all six with one of ``TEMPLATES``, so one changed
  attribute is always visible in the text, and :func:`parse_caption` inverts every caption.
- :func:`draw_scene` is a pure function of the scene, the image size and the generator it is
  given: the same generator state gives the same pixels. Object colours always contrast with
  the background (``ALLOWED_COLOURS``), so every attribute stays visible at 64 px.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "ALLOWED_COLOURS",
    "ATTRIBUTES",
    "BACKGROUNDS",
    "COLOURS",
    "COUNTS",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "TEMPLATES",
    "Scene",
    "draw_scene",
    "encode_jpeg",
    "n_differences",
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


@dataclass(frozen=True)
class Scene:
    """What an image shows; a caption names all six attributes."""

    shape: str  # one of SHAPES
    colour: str  # one of COLOURS (object colour)
    size: str  # one of SIZES
    position: str  # one of POSITIONS
    count: int  # one of COUNTS; all objects share shape, colour and size
    background: str  # one of BACKGROUNDS


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


def n_differences(a: Scene, b: Scene) -> int:
    return sum(getattr(a, name) != getattr(b, name) for name in ATTRIBUTES)


# --------------------------------------------------------------------------------------------
# Drawing


def _allowed_colours(background: str) -> list[str]:
    bg = BACKGROUNDS[background]
    return [c for c, rgb in COLOURS.items() if math.dist(rgb, bg) >= _MIN_CONTRAST]


ALLOWED_COLOURS = {bg: _allowed_colours(bg) for bg in BACKGROUNDS}


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


def draw_scene(scene: Scene, image_size: int, rng: np.random.Generator) -> Image.Image:
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


def encode_jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    # 4:4:4 chroma: 4:2:0 would smear the colour of 10 px objects into the background.
    img.save(buf, format="JPEG", quality=_JPEG_QUALITY, subsampling=0)
    return buf.getvalue()
