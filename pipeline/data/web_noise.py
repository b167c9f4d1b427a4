"""Web-like noise for the demo corpus, and the clean teacher corpus (docs/corpus.md).

Contract (part of :mod:`pipeline.data.synthetic`, ``noise_model="web"`` and ``"teacher"``):

- :func:`draw_pages` draws clean rows in pages of ``page_size_min..page_size_max`` images that
  share ``page_shared`` attributes (drawn from ``PAGE_ATTRIBUTES``); every row also draws its
  caption style, clutter (unmentioned :class:`~pipeline.data.scenes.Distractor` objects) and
  low contrast. Held-out rows (``held_out=True``) get full or short captions only.
- :func:`apply_web_noise` turns ``fraction_count(f, n)`` training rows into each noise type of
  ``NOISE_TYPES`` (near and exact duplicates first, then the caption noise on the other rows);
  the rest stay ``clean``. ``NOISE_KINDS`` maps a noise type to the 3-class ``kind`` and
  ``NOISE_DEGREES`` to its degree (``page_caption`` is ``partial`` at 0.25).
- :func:`draw_teacher_rows` draws a clean corpus (the ``ncr`` drawing, no clutter) whose
  captions never name the count or the position (``TEACHER_TEMPLATES``).
- :func:`render_jpeg` draws a row's image from the generator it is given. Exact duplicates share
  the ``Look`` (and so the pixel stream) of the row they copy, so their JPEG bytes are equal.
- Every function is a pure function of its arguments and the generator state it is given.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pipeline.data.noise import (
    MIN_MISMATCH_DIFF,
    Sample,
    _assign_donors,
    _make_partial,
    _unrelated_caption,
    fraction_count,
)
from pipeline.data.scenes import (
    ALLOWED_COLOURS,
    ALT_JUNK,
    BACKGROUNDS,
    COUNTS,
    POSITIONS,
    RADII,
    SHAPES,
    SHORT_ATTRIBUTES,
    SIZES,
    TEMPLATES,
    Distractor,
    Scene,
    draw_scene,
    encode_jpeg,
    n_differences,
    render_alt_text,
    render_caption,
    render_short_caption,
    render_teacher_caption,
)

__all__ = [
    "BOILERPLATE",
    "NOISE_DEGREES",
    "NOISE_KINDS",
    "NOISE_TYPES",
    "PAGE_ATTRIBUTES",
    "Look",
    "Style",
    "WebNoise",
    "WebSample",
    "apply_web_noise",
    "draw_pages",
    "draw_teacher_rows",
    "noise_type_counts",
    "render_jpeg",
]

NOISE_KINDS: dict[str, str] = {
    "clean": "clean",
    "near_dup": "clean",  # a re-rendered sibling's scene with its own correct caption
    "dup_clean": "clean",  # another row's exact JPEG bytes with a correct caption
    "dup_wrong": "mismatched",  # the same bytes with a page sibling's caption
    "page_swap": "mismatched",
    "random_swap": "mismatched",
    "boilerplate": "mismatched",
    "page_caption": "partial",
    "partial": "partial",
}
NOISE_TYPES: tuple[str, ...] = tuple(NOISE_KINDS)
NOISE_DEGREES: dict[str, float] = {
    **{t: 1.0 for t, k in NOISE_KINDS.items() if k == "clean"},
    **{t: 0.0 for t, k in NOISE_KINDS.items() if k == "mismatched"},
    "page_caption": 0.25,  # right about the page's shared attributes, silent on the rest
    "partial": 0.5,
}
PAGE_ATTRIBUTES: tuple[str, ...] = ("shape", "colour", "background", "size")

# Site boilerplate, most frequent first (drawn with Zipf weights). Every third names one
# attribute word, so a bag-of-words match finds something in it.
BOILERPLATE: tuple[str, ...] = (
    "click to enlarge",
    "photo 3 of 12",
    "red items - free shipping",
    "image not available",
    "add to cart",
    "new arrivals: large sizes in stock",
    "view larger image",
    "sold out",
    "shop our white collection",
    "product image",
    "thumbnail",
    "star seller - top rated",
    "see more photos",
    "customer photo",
    "grey tones sale up to 50% off",
    "image 1 of 5",
    "zoom",
    "small business, ships worldwide",
    "best price guaranteed",
    "untitled",
    "blue friday deals",
    "share this picture",
    "loading...",
    "circle of friends newsletter",
    "photo courtesy of the seller",
    "default image",
    "black edition now available",
    "gallery",
    "all rights reserved",
    "top picks: square deals every day",
)


@dataclass(frozen=True)
class WebNoise:
    """The knobs of the web noise model (defaults: docs/corpus.md, methods notes §3.2).

    Fractions are of training rows and are disjoint: ``fraction_count(f, n)`` rows each.
    """

    page_size_min: int = 4  # images per page, uniform in [min, max]: a product gallery
    page_size_max: int = 8
    page_shared: int = 3  # attributes fixed per page, from page_attributes; more = harder swaps
    page_attributes: tuple[str, ...] = PAGE_ATTRIBUTES  # the attributes a page may fix
    near_dup: float = 0.15  # re-rendered copies of a sibling's scene (clean)
    near_dup_crop: int = 4  # largest crop per side in pixels, then resized back
    near_dup_quality: tuple[int, int] = (60, 95)  # JPEG quality range of a near duplicate
    exact_dup: float = 0.05  # another row's exact JPEG bytes: the same stock photo
    exact_dup_wrong: float = 0.5  # share of exact duplicates captioned by a page sibling
    full: float = 0.55  # clean caption styles: all six attributes
    short: float = 0.25  # shape and two more attributes (correct, under-specified)
    alt: float = 0.20  # full caption with 2-4 junk tokens around it
    held_out_full: float = 0.7  # val/test caption styles: full, else short
    clutter: float = 0.30  # rows (all splits) with 1-2 unmentioned distractor objects
    distractor_scale: float = 0.7  # distractor radius over the object's
    low_contrast: float = 0.10  # rows (all splits) whose object is hard to see
    contrast: tuple[float, float] = (60.0, 100.0)  # RGB distance object/background
    page_swap: float = 0.06  # a same-page sibling's caption, >= 2 attributes off (mismatched)
    random_swap: float = 0.20  # another random row's caption (mismatched), the ncr protocol
    boilerplate: float = 0.08  # site boilerplate text (mismatched)
    boilerplate_zipf: float = 1.2  # exponent of the boilerplate frequencies
    page_caption: float = 0.06  # the page's topic caption (partial, degree 0.25)
    partial: float = 0.10  # one attribute changed (partial, degree 0.5)

    def validate(self) -> None:
        """Raise ValueError naming the knob and its allowed range."""
        fractions = (
            "near_dup", "exact_dup", "exact_dup_wrong", "full", "short", "alt", "held_out_full",
            "clutter", "low_contrast", "page_swap", "random_swap", "boilerplate",
            "page_caption", "partial",
        )  # fmt: skip
        for name in fractions:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"web.{name} must be a number in [0, 1], got {value!r}")
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"web.{name} must be a fraction in [0, 1], got {value!r}")
        if abs(self.full + self.short + self.alt - 1.0) > 1e-6:
            raise ValueError(
                f"web.full + web.short + web.alt must be 1 (got {self.full} + {self.short} + "
                f"{self.alt})"
            )
        noisy = ("near_dup", "exact_dup", "page_swap", "random_swap", "boilerplate")
        total = sum(getattr(self, n) for n in (*noisy, "page_caption", "partial"))
        if total > 1.0 + 1e-9:
            raise ValueError(
                f"the web noise fractions ({', '.join(noisy)}, page_caption, partial) must sum "
                f"to <= 1, got {total:.3f}; lower some of them"
            )
        if not 1 <= self.page_size_min <= self.page_size_max:
            raise ValueError(
                "web.page_size_min and web.page_size_max must satisfy 1 <= min <= max, got "
                f"{self.page_size_min}, {self.page_size_max}"
            )
        unknown = set(self.page_attributes) - set(PAGE_ATTRIBUTES)
        if unknown or not self.page_attributes:
            raise ValueError(
                f"web.page_attributes must be a non-empty subset of {PAGE_ATTRIBUTES}, got "
                f"{self.page_attributes}"
            )
        if not 0 <= self.page_shared <= len(self.page_attributes):
            raise ValueError(
                f"web.page_shared must be in [0, {len(self.page_attributes)}] (shared among "
                f"{self.page_attributes}), got {self.page_shared}"
            )
        if not 0 <= self.near_dup_crop <= 8:
            raise ValueError(f"web.near_dup_crop must be in [0, 8] px, got {self.near_dup_crop}")
        low, high = self.near_dup_quality
        if not 1 <= low <= high <= 95:
            raise ValueError(
                f"web.near_dup_quality must be 1 <= low <= high <= 95, got {low, high}"
            )
        dim, vivid = self.contrast
        if not 0 < dim <= vivid:
            raise ValueError(f"web.contrast must be 0 < low <= high, got {dim, vivid}")


@dataclass(frozen=True)
class Look:
    """How a row's image is drawn, beyond its scene. Equal looks and scenes, equal bytes."""

    pixel_row: int  # seeds the row's pixel stream (the row index; a copied row's for exact dups)
    distractors: tuple[Distractor, ...] = ()
    contrast: float | None = None  # object/background RGB distance; None: the palette's
    crop: tuple[int, int, int, int] | None = None  # (left, top, right, bottom) px trimmed
    quality: int = 90  # JPEG quality


@dataclass(frozen=True)
class Style:
    """How a row's caption is written: ``full``, ``short`` or ``alt`` (full + junk)."""

    name: str
    named: tuple[str, ...] = ()  # short: the attributes named besides the shape
    prefix: tuple[str, ...] = ()  # alt: junk before the caption
    suffix: tuple[str, ...] = ()  # alt: junk after it
    sep: int = 0  # alt: separator index (see render_alt_text)

    def dress(self, full: str) -> str:
        """A full caption in this style's clothes: alt adds the junk, others leave it."""
        return (
            render_alt_text(full, self.prefix, self.suffix, self.sep)
            if self.name == "alt"
            else full
        )


@dataclass(frozen=True)
class WebSample:
    """One row of a web or teacher corpus: the ncr `Sample` plus what the web model adds."""

    sample: Sample  # key, shard, scene, template, kind, noisy_caption, changed_attribute, corrupt
    caption: str  # the true caption written in full (teacher: the teacher caption)
    noise_type: str  # one of NOISE_TYPES
    caption_style: str | None  # full | short | alt | teacher; None for boilerplate, page text
    look: Look
    style: Style
    page: int | None = None  # page index within the split; None in the teacher corpus
    topic: str = ""  # the page's topic caption
    duplicate_of: str | None = None  # near_dup / dup_*: the key of the row whose image it copies

    @property
    def kind(self) -> str:
        return NOISE_KINDS[self.noise_type]

    @property
    def degree(self) -> float:
        return NOISE_DEGREES[self.noise_type]


# --------------------------------------------------------------------------------------------
# Drawing pages


def _pick(rng: np.random.Generator, values):
    return values[int(rng.integers(0, len(values)))]


def _draw_scene(rng: np.random.Generator, fixed: dict) -> Scene:
    """A scene with the attributes in `fixed`; the others uniform, the colour visible."""
    values = {
        "shape": fixed.get("shape", _pick(rng, SHAPES)),
        "size": fixed.get("size", _pick(rng, SIZES)),
        "position": _pick(rng, POSITIONS),
        "count": _pick(rng, COUNTS),
    }
    if "background" in fixed:
        background = fixed["background"]
    else:
        colour = fixed.get("colour")
        backgrounds = [b for b in BACKGROUNDS if colour is None or colour in ALLOWED_COLOURS[b]]
        background = _pick(rng, backgrounds)
    colour = fixed.get("colour", _pick(rng, ALLOWED_COLOURS[background]))
    return Scene(colour=colour, background=background, **values)


def _topic(base: Scene, shared: list[str], rng: np.random.Generator) -> str:
    """The page's topic caption, naming its shared attributes only (`base` holds their values)."""
    lead = _pick(rng, ("a gallery of", "a collection of", "photos of", "browse our", "more"))
    words = [getattr(base, a) for a in ("size", "colour") if a in shared]
    if "shape" in shared:
        words.append(render_short_caption(dataclasses.replace(base, count=2), ()))  # the plural
    else:
        words.append("shapes")
    text = f"{lead} {' '.join(words)}"
    if "background" in shared:
        text += f" on {'an' if base.background[0] in 'aeiou' else 'a'} {base.background} background"
    return text


def _draw_style(rng: np.random.Generator, params: WebNoise, held_out: bool) -> Style:
    u = rng.random()
    if held_out:
        name = "full" if u < params.held_out_full else "short"
    else:
        name = "full" if u < params.full else "short" if u < params.full + params.short else "alt"
    if name == "short":
        chosen = rng.choice(len(SHORT_ATTRIBUTES), 2, replace=False)
        return Style("short", named=tuple(SHORT_ATTRIBUTES[i] for i in sorted(chosen)))
    # The alt junk is drawn for every row: noisy captions wear it too, so junk is no clean signal.
    tokens = []
    for _ in range(int(rng.integers(2, 5))):
        if rng.random() < 0.3:
            tokens.append(f"IMG_{int(rng.integers(0, 10_000)):04d}")
        else:
            tokens.append(_pick(rng, ALT_JUNK))
    cut = int(rng.integers(0, len(tokens) + 1))
    sep = int(rng.integers(0, 3))
    return Style(name, prefix=tuple(tokens[:cut]), suffix=tuple(tokens[cut:]), sep=sep)


def _draw_look(row: int, scene: Scene, rng: np.random.Generator, params: WebNoise) -> Look:
    distractors: list[Distractor] = []
    if rng.random() < params.clutter:
        radius = params.distractor_scale * RADII[scene.size]
        for _ in range(int(rng.integers(1, 3))):
            shape = _pick(rng, [s for s in SHAPES if s != scene.shape])
            colour = _pick(rng, [c for c in ALLOWED_COLOURS[scene.background] if c != scene.colour])
            x, y = rng.uniform(radius + 0.02, 1 - radius - 0.02, 2)
            distractors.append(Distractor(shape, colour, float(x), float(y), radius))
    contrast = None
    if rng.random() < params.low_contrast:
        contrast = float(rng.uniform(*params.contrast))
    return Look(pixel_row=row, distractors=tuple(distractors), contrast=contrast)


def draw_pages(
    n: int,
    samples_per_shard: int,
    shard_offset: int,
    image_size: int,
    params: WebNoise,
    rng: np.random.Generator,
    *,
    held_out: bool = False,
) -> list[WebSample]:
    """Draw `n` clean rows in pages (see the module contract).

    Args:
        n: rows.
        samples_per_shard, shard_offset: key layout, as in ``noise.draw_samples``.
        image_size: the JPEG side (bounds the fake pre-resize size).
        params: the web knobs (page size and sharing, styles, clutter, low contrast).
        rng: the sampling stream.
        held_out: validation or test rows: caption styles full / short (``held_out_full``).

    Returns:
        Rows in key order; ``noisy_caption`` is the row's correct caption in its style.
    """
    out: list[WebSample] = []
    page = 0
    while len(out) < n:
        size = int(rng.integers(params.page_size_min, params.page_size_max + 1))
        attributes = params.page_attributes
        shared = sorted(rng.choice(len(attributes), params.page_shared, replace=False))
        base = _draw_scene(rng, {})
        page_values = {attributes[i]: getattr(base, attributes[i]) for i in shared}
        topic = _topic(base, list(page_values), rng)
        for _ in range(min(size, n - len(out))):
            i = len(out)
            shard, within = divmod(i, samples_per_shard)
            scene = _draw_scene(rng, page_values)
            template = int(rng.integers(0, len(TEMPLATES)))
            variant = int(rng.integers(0, 2))
            original = rng.integers(image_size, 8 * image_size + 1, 2)
            style = _draw_style(rng, params, held_out)
            look = _draw_look(i, scene, rng, params)
            caption = render_caption(scene, template, variant)
            if style.name == "short":
                text = render_short_caption(scene, style.named, variant)
            else:
                text = style.dress(caption)
            sample = Sample(
                key=f"{shard + shard_offset:05d}{within:04d}",
                shard=f"{shard:05d}",
                scene=scene,
                template=template,
                variant=variant,
                original_size=(int(original[0]), int(original[1])),
                noisy_caption=text,
            )
            out.append(WebSample(sample, caption, "clean", style.name, look, style, page, topic))
        page += 1
    return out


# --------------------------------------------------------------------------------------------
# Noise


def _other_template(template: int, rng: np.random.Generator) -> int:
    return (template + 1 + int(rng.integers(0, len(TEMPLATES) - 1))) % len(TEMPLATES)


def _noisy(row: WebSample, noise_type: str, text: str, **changes) -> WebSample:
    """`row` with a caption that is not its own: full or alt style (never short)."""
    style = "alt" if row.style.name == "alt" else "full"
    sample = dataclasses.replace(
        row.sample, kind=NOISE_KINDS[noise_type], noisy_caption=row.style.dress(text), **changes
    )
    return dataclasses.replace(row, sample=sample, noise_type=noise_type, caption_style=style)


def _duplicates(
    rows: list[WebSample],
    pages: dict[int | None, list[int]],
    params: WebNoise,
    rng: np.random.Generator,
) -> tuple[dict[int, int], dict[int, int]]:
    """Pick near-duplicate rows (copying a same-page row) and exact ones (copying any row).

    Returns ``({dup: source}, {dup: source})``; a source is never a duplicate itself.
    """
    n = len(rows)
    n_near = fraction_count(params.near_dup, n)
    n_exact = fraction_count(params.exact_dup, n)
    dups: set[int] = set()
    sources: set[int] = set()
    near: dict[int, int] = {}
    exact: dict[int, int] = {}
    for i in (int(i) for i in rng.permutation(n)):
        if len(near) == n_near:
            break
        if i in sources:
            continue
        candidates = [j for j in pages[rows[i].page] if j != i and j not in dups]
        if candidates:
            near[i] = _pick(rng, candidates)
            dups.add(i)
            sources.add(near[i])
    for i in (int(i) for i in rng.permutation(n)):
        if len(exact) == n_exact:
            break
        if i in sources or i in dups:
            continue
        for _ in range(100):  # rejection: duplicates are a small share of the rows
            j = int(rng.integers(0, n))
            if j != i and j not in dups:
                exact[i] = j
                dups.add(i)
                sources.add(j)
                break
    return near, exact


def _sibling_caption(
    i: int,
    scene: Scene,
    rows: list[WebSample],
    pages: dict[int | None, list[int]],
    excluded: set[int],
    rng: np.random.Generator,
) -> int | None:
    """A same-page row (not `i`, not in `excluded`) whose scene differs from `scene` in at least
    MIN_MISMATCH_DIFF attributes, or None."""
    siblings = [
        j
        for j in pages[rows[i].page]
        if j != i
        and j not in excluded
        and n_differences(scene, rows[j].sample.scene) >= MIN_MISMATCH_DIFF
    ]
    return _pick(rng, siblings) if siblings else None


def _copy_images(
    out: list[WebSample],
    near: dict[int, int],
    exact: dict[int, int],
    pages: dict[int | None, list[int]],
    params: WebNoise,
    rng: np.random.Generator,
) -> None:
    """Make the rows of `near` and `exact` ({dup: source}) duplicates of their sources, in
    place (`out` holds the clean rows on entry)."""
    rows = list(out)
    for i, j in near.items():
        source = rows[j]
        left, top, right, bottom = rng.integers(0, params.near_dup_crop + 1, 4)
        look = dataclasses.replace(
            source.look,
            pixel_row=rows[i].look.pixel_row,
            crop=(int(left), int(top), int(right), int(bottom)),
            quality=int(rng.integers(params.near_dup_quality[0], params.near_dup_quality[1] + 1)),
        )
        template = _other_template(source.sample.template, rng)
        caption = render_caption(source.sample.scene, template, rows[i].sample.variant)
        sample = dataclasses.replace(
            rows[i].sample, scene=source.sample.scene, template=template, noisy_caption=caption
        )
        out[i] = dataclasses.replace(
            rows[i], sample=sample, caption=caption, noise_type="near_dup", caption_style="full",
            look=look, duplicate_of=source.sample.key,
        )  # fmt: skip
    n_wrong = fraction_count(params.exact_dup_wrong, len(exact))
    exact_set = set(exact)
    for rank, (i, j) in enumerate(exact.items()):
        source = rows[j]
        template = _other_template(source.sample.template, rng)
        caption = render_caption(source.sample.scene, template, rows[i].sample.variant)
        sample = dataclasses.replace(
            rows[i].sample, scene=source.sample.scene, template=template, noisy_caption=caption
        )
        out[i] = dataclasses.replace(
            rows[i], sample=sample, caption=caption, noise_type="dup_clean", caption_style="full",
            look=source.look, duplicate_of=source.sample.key,
        )  # fmt: skip
        if rank < n_wrong:
            donor = _sibling_caption(i, sample.scene, out, pages, exact_set, rng)
            if donor is not None:
                out[i] = _noisy(out[i], "dup_wrong", out[donor].caption)
            else:
                out[i] = _noisy(out[i], "dup_wrong", _unrelated_caption(sample, rng))


def apply_web_noise(
    rows: list[WebSample], params: WebNoise, rng: np.random.Generator
) -> list[WebSample]:
    """Give `rows` (from `draw_pages`) the web noise: duplicates, then caption noise.

    Args:
        rows: clean rows in key order.
        params: the fractions (of ``len(rows)``) per noise type.
        rng: the noise stream.

    Returns:
        New rows: ``fraction_count(f, n)`` of each noise type as far as the page structure
        allows (a row with no eligible page sibling is not made a page swap; the counts in the
        ground truth are the ones to use), the rest ``clean``.
    """
    n = len(rows)
    out = list(rows)
    pages: dict[int | None, list[int]] = {}
    for i, row in enumerate(rows):
        pages.setdefault(row.page, []).append(i)

    # Duplicates first: page swaps and donors must see the final scenes.
    near, exact = _duplicates(rows, pages, params, rng)
    _copy_images(out, near, exact, pages, params, rng)
    exact_set = set(exact)
    # Caption noise on the rows that are not duplicates, in one seeded order.
    order = [int(i) for i in rng.permutation(n) if int(i) not in near and int(i) not in exact]
    n_swap = fraction_count(params.page_swap, n)
    swapped: list[int] = []
    for i in order:
        if len(swapped) == n_swap:
            break
        donor = _sibling_caption(i, out[i].sample.scene, out, pages, exact_set, rng)
        if donor is not None:
            out[i] = _noisy(out[i], "page_swap", out[donor].caption)
            swapped.append(i)
    rest = [i for i in order if i not in set(swapped)]
    counts = [
        fraction_count(getattr(params, name), n)
        for name in ("random_swap", "boilerplate", "page_caption", "partial")
    ]
    bounds = np.cumsum([0, *counts])
    random_rows, boiler_rows, page_rows, partial_rows = (
        sorted(rest[bounds[k] : bounds[k + 1]]) for k in range(4)
    )
    samples = [row.sample for row in out]
    for i, text in _assign_donors(np.asarray(random_rows, dtype=np.int64), samples, rng).items():
        out[i] = _noisy(out[i], "random_swap", text)
    weights = 1.0 / np.arange(1, len(BOILERPLATE) + 1) ** params.boilerplate_zipf
    for i in boiler_rows:
        text = BOILERPLATE[int(rng.choice(len(BOILERPLATE), p=weights / weights.sum()))]
        sample = dataclasses.replace(out[i].sample, kind="mismatched", noisy_caption=text)
        out[i] = dataclasses.replace(
            out[i], sample=sample, noise_type="boilerplate", caption_style=None
        )
    for i in page_rows:
        sample = dataclasses.replace(out[i].sample, kind="partial", noisy_caption=out[i].topic)
        out[i] = dataclasses.replace(
            out[i], sample=sample, noise_type="page_caption", caption_style=None
        )
    for i in partial_rows:
        changed = _make_partial(out[i].sample, rng)
        out[i] = _noisy(
            out[i], "partial", changed.noisy_caption, changed_attribute=changed.changed_attribute
        )
    return out


# --------------------------------------------------------------------------------------------
# Teacher corpus, rendering, counts


def draw_teacher_rows(
    samples: list[Sample], names: tuple[str, ...] | None = None
) -> list[WebSample]:
    """The teacher corpus's rows: `samples` (clean ``ncr`` draws) with teacher captions that
    name `names` (None: shape, colour, size and background, in the six teacher templates)."""
    out = []
    for i, sample in enumerate(samples):
        caption = render_teacher_caption(sample.scene, sample.template, names)
        row = dataclasses.replace(sample, noisy_caption=caption)
        out.append(WebSample(row, caption, "clean", "teacher", Look(pixel_row=i), Style("teacher")))
    return out


def render_jpeg(row: WebSample, image_size: int, rng: np.random.Generator) -> bytes:
    """The row's JPEG: its scene and look drawn from `rng` (the stream of ``look.pixel_row``)."""
    look = row.look
    img = draw_scene(
        row.sample.scene, image_size, rng, distractors=look.distractors, contrast=look.contrast
    )
    if look.crop is not None:
        left, top, right, bottom = look.crop
        img = img.crop((left, top, image_size - right, image_size - bottom))
        img = img.resize((image_size, image_size), Image.Resampling.BICUBIC)
    return encode_jpeg(img, quality=look.quality)


def noise_type_counts(rows: list[WebSample]) -> dict[str, int]:
    """Rows per noise type, every type of NOISE_TYPES included (zeros too)."""
    counts = Counter(row.noise_type for row in rows)
    return {name: counts.get(name, 0) for name in NOISE_TYPES}
