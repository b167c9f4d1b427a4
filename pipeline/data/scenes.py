"""Scenes of the demo corpus: the vocabulary, captions that name a scene, and drawing it.

Contract (part of :mod:`pipeline.data.synthetic`):

- A :class:`Scene` has six attributes (``ATTRIBUTES``): shape, colour, size, position, count,
  background. :func:`render_caption` names all six with one of ``TEMPLATES``, so one changed
  attribute is always visible in the text, and :func:`parse_caption` inverts every caption.
- :func:`draw_scene` is a pure function of the scene, the image size and the generator it is
  given: the same generator state gives the same pixels. Object colours always contrast with
  the background (``ALLOWED_COLOURS``), so every attribute stays visible at 64 px. The web
  noise model's extras (unmentioned :class:`Distractor` objects, a low ``contrast``) are
  keyword arguments that draw nothing from the generator when absent, so the ``ncr`` corpus
  keeps its pixels.
- Caption styles besides the full one: :func:`render_short_caption` (shape plus two more
  attributes), :func:`render_alt_text` (junk tokens around a caption) and
  :func:`render_teacher_caption` (shape, colour, size, background: never count or position).
  :func:`caption_attributes` reads the attributes that a full, short or alt-text caption names.
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
    "ALT_JUNK",
    "ATTRIBUTES",
    "BACKGROUNDS",
    "COLOURS",
    "COUNTS",
    "POSITIONS",
    "RADII",
    "SHAPES",
    "SHORT_ATTRIBUTES",
    "SIZES",
    "TEACHER_NAMES",
    "TEACHER_TEMPLATES",
    "TEMPLATES",
    "Distractor",
    "Scene",
    "caption_attributes",
    "draw_scene",
    "encode_jpeg",
    "n_differences",
    "parse_caption",
    "render_alt_text",
    "render_caption",
    "render_short_caption",
    "render_teacher_caption",
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
RADII: dict[str, float] = _RADIUS  # public: the web noise model sizes its distractors from it
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


@dataclass(frozen=True)
class Distractor:
    """An object in the image that the caption does not mention (web noise model: clutter)."""

    shape: str  # one of SHAPES, not the scene's
    colour: str  # one of COLOURS, not the scene's, visible on its background
    x: float  # centre, as a fraction of the image side
    y: float
    radius: float  # nominal radius, as a fraction of the image side


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
# Other caption styles (the web noise model and the teacher corpus)

# A short caption names the shape and two of these (never the count: its noun is singular with
# an article for one object, a bare plural otherwise).
SHORT_ATTRIBUTES: tuple[str, ...] = ("colour", "size", "position", "background")
# Alt-text junk: none of these words occurs in a caption, so caption_attributes can strip them.
ALT_JUNK: tuple[str, ...] = (
    "hd", "free download", "4k", "stock", "wallpaper", "high resolution", "royalty free",
    "jpg", "png", "download", "hq", "img", "vector", "clipart",
)  # fmt: skip
_ALT_SEPARATORS = (" ", " - ", " | ")
# Teacher captions: shape, colour, size and background only. No count word, no plural, no
# position phrase: the blind spots of an off-the-shelf CLIP.
TEACHER_TEMPLATES: tuple[str, ...] = (
    "{size} {colour} {shape} on {a_bg} background",
    "{colour} {shape}, {size}, {bg} background",
    "{bg} background with {size} {colour} {shape}",
    "photo of {size} {colour} {shape} against {a_bg} backdrop",
    "{size} {colour} {shape} shape, {bg} backdrop",
    "picture: {colour} {shape} ({size}) on {bg}",
)


def render_short_caption(scene: Scene, named: Sequence[str], variant: int = 0) -> str:
    """A correct caption naming the shape and the attributes `named` (from SHORT_ATTRIBUTES).

    Returns e.g. ``"a small red star"`` or ``"red stars on a grey background"``: the count is
    never named (singular with an article for one object, a bare plural otherwise).
    """
    unknown = set(named) - set(SHORT_ATTRIBUTES)
    if unknown:
        raise ValueError(f"a short caption names only {SHORT_ATTRIBUTES}, got {sorted(unknown)}")
    words = [getattr(scene, a) for a in ("size", "colour") if a in named]
    words.append(scene.shape if scene.count == 1 else _PLURALS[scene.shape])
    text = " ".join(words)
    if scene.count == 1:
        text = f"{_article(text)} {text}"
    if "position" in named:
        phrases = _POSITION_PHRASES[scene.position]
        text += " " + phrases[variant % len(phrases)]
    if "background" in named:
        text += f" on {_article(scene.background)} {scene.background} background"
    return text


def render_alt_text(caption: str, prefix: Sequence[str], suffix: Sequence[str], sep: int) -> str:
    """`caption` with junk tokens before and after it, as scraped alt texts carry them.

    Args:
        caption: a full or short caption.
        prefix, suffix: tokens (ALT_JUNK entries or ``IMG_1234``-like file names).
        sep: index into the separators " ", " - ", " | " between the junk and the caption.
    """
    join = _ALT_SEPARATORS[sep % len(_ALT_SEPARATORS)]
    return join.join(
        [*([" ".join(prefix)] if prefix else []), caption, *([" ".join(suffix)] if suffix else [])]
    )


TEACHER_NAMES: tuple[str, ...] = ("shape", "colour", "size", "background")
_NAMED_BACKGROUND = (" on {a_bg} background", " against {a_bg} backdrop", ", {bg} background")
_NAMED_FRAME = ("{obj}{bg}", "photo of {obj}{bg}", "picture: {obj}{bg}")


def render_teacher_caption(
    scene: Scene, template: int = 0, names: Sequence[str] | None = None
) -> str:
    """A teacher-corpus caption: shape, colour, size, background; never count or position.

    `names` (a subset of TEACHER_NAMES with the shape) narrows what it names, e.g. a teacher
    blind to the background as well; None keeps the six TEACHER_TEMPLATES.
    """
    if names is not None and set(names) != set(TEACHER_NAMES):
        if "shape" not in names or not set(names) <= set(TEACHER_NAMES):
            raise ValueError(f"teacher names must include shape, within {TEACHER_NAMES}: {names}")
        words = [getattr(scene, a) for a in ("size", "colour", "shape") if a in names]
        background = _NAMED_BACKGROUND[template % len(_NAMED_BACKGROUND)].format(
            a_bg=f"{_article(scene.background)} {scene.background}", bg=scene.background
        )
        return _NAMED_FRAME[template % len(_NAMED_FRAME)].format(
            obj=" ".join(words), bg=background if "background" in names else ""
        )
    return TEACHER_TEMPLATES[template % len(TEACHER_TEMPLATES)].format(
        size=scene.size,
        colour=scene.colour,
        shape=scene.shape,
        a_bg=f"{_article(scene.background)} {scene.background}",
        bg=scene.background,
    )


_JUNK = rf"(?:{_alternation(ALT_JUNK)}|IMG_\d{{4}}|DSC\d{{5}})"
_JUNK_RUN = rf"{_JUNK}(?: {_JUNK})*"
_SEP = r"(?: - | \| | )"
_ALT = re.compile(rf"^(?:{_JUNK_RUN}{_SEP})?(?P<body>.+?)(?:{_SEP}{_JUNK_RUN})?$")
_SHORT = re.compile(
    rf"^(?:(?P<article>a|an) )?(?:(?P<size>{_alternation(SIZES)}) )?"
    rf"(?:(?P<colour>{_alternation(list(COLOURS))}) )?"
    rf"(?P<noun>{_alternation(list(SHAPES) + list(_PLURALS.values()))})"
    rf"(?: (?P<pos>{_alternation(list(_PHRASE_TO_POSITION))}))?"
    rf"(?: on (?:a|an) (?P<bg>{_alternation(list(BACKGROUNDS))}) background)?$"
)


def caption_attributes(caption: str) -> dict[str, object] | None:
    """The attributes a full, short or alt-text caption names (alt-text junk stripped).

    Returns:
        ``{attribute: value}`` with all six attributes for a full caption, the shape and the
        named ones for a short caption (no ``count``: a short caption does not name it), or
        None for any other text (boilerplate, page captions, teacher captions).
    """
    match = _ALT.match(caption)
    body = caption if match is None else match["body"]
    for text in dict.fromkeys((caption, body)):
        scene = parse_caption(text)
        if scene is not None:
            return {name: getattr(scene, name) for name in ATTRIBUTES}
    for text in dict.fromkeys((caption, body)):
        short = _SHORT.match(text)
        if short is None:
            continue
        singular = short["noun"] in SHAPES
        if singular != (short["article"] is not None):
            continue  # "a stars" or "red star": not a caption we write
        named: dict[str, object] = {"shape": _NOUN_TO_SHAPE[short["noun"]]}
        for name, group in (("size", "size"), ("colour", "colour"), ("background", "bg")):
            if short[group] is not None:
                named[name] = short[group]
        if short["pos"] is not None:
            named["position"] = _PHRASE_TO_POSITION[short["pos"]]
        return named
    return None


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


def _toward(rgb: tuple[int, int, int], bg: tuple[int, int, int], distance: float) -> tuple:
    """`rgb` moved along the line to `bg` until it lies `distance` away from `bg`."""
    full = math.dist(rgb, bg)
    t = min(1.0, distance / full) if full > 0 else 1.0
    return tuple(int(round(b + (c - b) * t)) for c, b in zip(rgb, bg, strict=True))


def _draw_object(draw, shape: str, cx: float, cy: float, r: float, rot: float, fill) -> None:
    if shape == "circle":
        draw.ellipse((cx - 0.95 * r, cy - 0.95 * r, cx + 0.95 * r, cy + 0.95 * r), fill=fill)
    else:
        draw.polygon(_shape_points(shape, cx, cy, r, rot), fill=fill)


def draw_scene(
    scene: Scene,
    image_size: int,
    rng: np.random.Generator,
    *,
    distractors: Sequence[Distractor] = (),
    contrast: float | None = None,
) -> Image.Image:
    """Draw `scene` as an RGB image of side `image_size` with light jitter and pixel noise.

    Args:
        scene: what the image shows.
        image_size: side in pixels.
        rng: the pixel stream (jitter, object placement, noise).
        distractors: unmentioned objects drawn under the scene's objects; none draws nothing
            from `rng`.
        contrast: the RGB distance between the object and the background colour (the object
            colour is moved toward the background along the line between them); None keeps
            the palette's colour (at least ``_MIN_CONTRAST`` away).
    """
    side = image_size * _SUPERSAMPLE
    background = _jitter_rgb(BACKGROUNDS[scene.background], rng, 10, 3)
    img = Image.new("RGB", (side, side), background)
    draw = ImageDraw.Draw(img)
    colour = _jitter_rgb(COLOURS[scene.colour], rng, 10, 6)
    if contrast is not None:
        colour = _toward(colour, background, contrast)
    for extra in distractors:
        fill = _jitter_rgb(COLOURS[extra.colour], rng, 10, 6)
        r = extra.radius * rng.uniform(0.9, 1.1) * side
        rot = rng.uniform(-0.14, 0.14)
        _draw_object(draw, extra.shape, extra.x * side, extra.y * side, r, rot, fill)
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
        _draw_object(draw, scene.shape, cx, cy, r, rot, colour)
    img = img.reduce(_SUPERSAMPLE)
    pixels = np.asarray(img, dtype=np.int16) + rng.integers(
        -4, 5, (image_size, image_size, 3), dtype=np.int16
    )
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def encode_jpeg(img: Image.Image, quality: int = _JPEG_QUALITY) -> bytes:
    buf = io.BytesIO()
    # 4:4:4 chroma: 4:2:0 would smear the colour of 10 px objects into the background.
    img.save(buf, format="JPEG", quality=quality, subsampling=0)
    return buf.getvalue()
