"""Decoding one sample's members: image, caption and metadata, with checks in a fixed order.

Contract (part of :mod:`pipeline.io.shards`, docs/architecture.md §4.1):

* :func:`decode_record` turns each :class:`RawRecord` into exactly one :class:`DecodedSample`
  or :class:`Rejection`. Checks run in the order of the decoder reasons in
  :data:`QUARANTINE_REASONS` (cheap checks before the image is decoded); the first failing one
  wins.
* Images are decoded by PIL restricted to JPEG/PNG/WEBP whatever the file extension says, with a
  pixel limit checked from the header before any pixel is decoded; no PIL global is modified.
  Text is strict UTF-8, metadata a JSON object. Nothing is ever unpickled.
* Every mode becomes RGB: transparency is composited onto white, 16-bit greyscale is scaled to
  8 bits, EXIF orientation is not applied (as in open_clip's training loaders).
* ``pixels=False`` runs every check but the pixel decode (the header is read for the format
  and the pixel limit) and keeps the image's bytes, for a caller that decodes them elsewhere
  (on a GPU: :func:`pipeline.models.encode.decode_pixels`) and records its failures itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from pipeline.io.records import (
    IMAGE_EXTENSIONS,
    META_EXTENSIONS,
    TEXT_EXTENSIONS,
    RawRecord,
    Rejection,
)

__all__ = [
    "DecodeOptions",
    "DecodedSample",
    "decode_image",
    "decode_record",
    "sample_pixels",
    "undecodable",
]

# PIL format names tried for every image member: img2dataset's extension reflects the
# requested output format, not necessarily the bytes, so any allowed format is accepted for
# any image extension, and nothing else (GIF, TIFF, EPS, ...) is ever parsed.
_PIL_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP")


@dataclass(frozen=True)
class DecodeOptions:
    """How :func:`decode_record` picks and checks members."""

    image_key: str = "auto"  # "auto": first of IMAGE_EXTENSIONS present; else one explicit ext
    caption_key: str = "txt"  # img2dataset writes captions as {key}.txt
    max_image_pixels: int = 50_000_000  # decompression-bomb guard, read from the header

    def __post_init__(self) -> None:
        if self.image_key != "auto" and self.image_key not in IMAGE_EXTENSIONS:
            raise ValueError(
                f"image_key={self.image_key!r} is not allowed; use 'auto' or one of "
                f"{', '.join(IMAGE_EXTENSIONS)}"
            )
        if self.caption_key not in TEXT_EXTENSIONS:
            raise ValueError(
                f"caption_key={self.caption_key!r} is not allowed; use one of "
                f"{', '.join(TEXT_EXTENSIONS)}"
            )
        if self.max_image_pixels <= 0:
            raise ValueError(
                f"max_image_pixels={self.max_image_pixels} must be a positive pixel count"
            )


@dataclass(frozen=True)
class DecodedSample:
    """A usable image-text pair."""

    key: str
    shard: str
    image: Image.Image | None  # mode RGB, pixels loaded; None when decoded with pixels=False
    caption: str  # UTF-8 decoded, surrounding whitespace stripped
    url: str | None  # from the sample's json "url" when present
    meta: dict[str, Any]  # the parsed json object, {} when the sample has no json
    # hex sha256 of the image member's raw bytes (as stored in the tar): identical files, the
    # same image (RCR ranks unique images, docs/methods.md §6.3); "" when not computed.
    image_sha256: str = ""
    image_bytes: bytes = b""  # pixels=False: the member's bytes, undecoded
    image_format: str = ""  # pixels=False: "JPEG", "PNG" or "WEBP", from the header
    image_ext: str = ""  # the image member's extension (its name is f"{key}.{image_ext}")


# --------------------------------------------------------------------------- checks


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to a new, loaded RGB image (alpha composited onto white)."""
    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        array = np.asarray(image).astype(np.int64)
        # PNG 16-bit greyscale spans 0..65535; keep the top byte rather than clipping to 255.
        grey = (np.clip(array, 0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")  # returns a copy even for RGB, detached from the source bytes


def _reject(record: RawRecord, ext: str | None, reason: str, detail: str) -> Rejection:
    member = f"{record.key}.{ext}" if ext is not None else None
    return Rejection(
        key=record.key, shard=record.shard, member=member, reason=reason, detail=detail
    )


def _image_member(record: RawRecord, options: DecodeOptions) -> str | Rejection:
    """The extension of the image member to decode (``missing_image`` / ``empty_image``)."""
    members = record.members
    if options.image_key == "auto":
        image_ext = next((ext for ext in IMAGE_EXTENSIONS if ext in members), None)
    else:
        image_ext = options.image_key if options.image_key in members else None
    if image_ext is None:
        wanted = IMAGE_EXTENSIONS if options.image_key == "auto" else (options.image_key,)
        present = ", ".join(sorted(members)) or "none"
        return _reject(
            record,
            None if options.image_key == "auto" else options.image_key,
            "missing_image",
            f"no image member ({'/'.join(wanted)}); allow-listed members present: {present}",
        )
    if not members[image_ext]:
        return _reject(record, image_ext, "empty_image", "image member has zero bytes")
    return image_ext


def _caption(record: RawRecord, caption_ext: str) -> str | Rejection:
    """The stripped caption (``missing_caption`` / ``invalid_utf8`` / ``empty_caption``)."""
    if caption_ext not in record.members:
        return _reject(record, caption_ext, "missing_caption", f"no .{caption_ext} member")
    try:
        caption = record.members[caption_ext].decode("utf-8")
    except UnicodeDecodeError as exc:
        return _reject(record, caption_ext, "invalid_utf8", f"caption is not UTF-8: {exc}")
    caption = caption.lstrip("\ufeff").strip()  # a BOM or trailing newline is not caption text
    if not caption:
        return _reject(record, caption_ext, "empty_caption", "caption is empty or whitespace only")
    return caption


def _metadata(record: RawRecord) -> tuple[dict[str, Any], str | None] | Rejection:
    """(parsed json object or {}, its string ``url`` or None) (``invalid_json``)."""
    meta: dict[str, Any] = {}
    url: str | None = None
    for meta_ext in META_EXTENSIONS:
        if meta_ext not in record.members:
            continue
        try:
            parsed = json.loads(record.members[meta_ext])
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
            return _reject(record, meta_ext, "invalid_json", f"not valid JSON: {exc}")
        if not isinstance(parsed, dict):
            kind = type(parsed).__name__
            return _reject(record, meta_ext, "invalid_json", f"JSON is a {kind}, not an object")
        meta = parsed
        url = parsed.get("url") if isinstance(parsed.get("url"), str) else None
    return meta, url


def _image(
    record: RawRecord, image_ext: str, max_image_pixels: int, load: bool = True
) -> Image.Image | str | Rejection:
    """The decoded RGB image, or with `load` False its format name after the header checks
    (``image_too_large`` / ``undecodable_image``)."""
    image_bytes = record.members[image_ext]
    try:
        with Image.open(BytesIO(image_bytes), formats=list(_PIL_FORMATS)) as image:
            width, height = image.size
            if width * height > max_image_pixels:
                return _reject(
                    record,
                    image_ext,
                    "image_too_large",
                    f"{width}x{height} = {width * height} pixels exceeds "
                    f"max_image_pixels={max_image_pixels}",
                )
            if not load:
                return str(image.format)
            image.load()
            return _to_rgb(image)
    except Image.DecompressionBombError as exc:  # PIL's own limit, hit while reading the header
        return _reject(record, image_ext, "image_too_large", str(exc))
    except UnidentifiedImageError:  # its message names a BytesIO address, useless in a table
        return _reject(
            record,
            image_ext,
            "undecodable_image",
            f"not a {'/'.join(_PIL_FORMATS)} image (first bytes {image_bytes[:8]!r})",
        )
    except Exception as exc:  # UnidentifiedImageError, truncated data, codec errors
        return _reject(record, image_ext, "undecodable_image", f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- decoding


def decode_image(data: bytes) -> Image.Image:
    """The RGB image of bytes that passed :func:`decode_record`'s checks with ``pixels=False``
    (the same formats and mode conversions); raises what PIL raises on a bad file."""
    with Image.open(BytesIO(data), formats=list(_PIL_FORMATS)) as image:
        image.load()
        return _to_rgb(image)


def undecodable(sample: DecodedSample, detail: str) -> Rejection:
    """The ``undecodable_image`` rejection of a sample whose image failed after its checks
    (a device decoder's failure, named by `detail`)."""
    member = f"{sample.key}.{sample.image_ext}"
    return Rejection(sample.key, sample.shard, member, "undecodable_image", detail)


def sample_pixels(sample: DecodedSample, to_pixels: Callable, keep_jpeg: bool):
    """`to_pixels` of the sample's RGB image; with `keep_jpeg` and a sample decoded with
    ``pixels=False`` whose image is a JPEG, its bytes instead (a device decodes them); the
    sample's `undecodable` rejection when PIL cannot decode an image whose header passed."""
    if sample.image is not None:
        return to_pixels(sample.image)
    if keep_jpeg and sample.image_format == "JPEG":
        return sample.image_bytes
    try:
        image = decode_image(sample.image_bytes)
    except Exception as exc:  # truncated data, codec errors: as decode_record reports them
        return undecodable(sample, f"{type(exc).__name__}: {exc}")
    return to_pixels(image)


def decode_record(
    record: RawRecord, options: DecodeOptions = DecodeOptions(), *, pixels: bool = True
) -> DecodedSample | Rejection:
    """Decode one sample's members into an RGB image, a caption and metadata.

    Pure and thread-safe: no globals are read or written beyond PIL's own constants, so the
    embed stage may call it from a thread pool.

    Args:
        record: Members from :func:`iter_shard_records`.
        options: Which members to use and the pixel limit.
        pixels: False: check the header only and keep the image bytes (module docstring).

    Returns:
        A :class:`DecodedSample`, or a :class:`Rejection` naming the key, shard, member and the
        first failing check (order in the module docstring).
    """
    # Each check returns its value or the Rejection that ends decoding; order as documented.
    image_ext = _image_member(record, options)
    if isinstance(image_ext, Rejection):
        return image_ext
    caption = _caption(record, options.caption_key)
    if isinstance(caption, Rejection):
        return caption
    metadata = _metadata(record)
    if isinstance(metadata, Rejection):
        return metadata
    rgb = _image(record, image_ext, options.max_image_pixels, load=pixels)
    if isinstance(rgb, Rejection):
        return rgb
    meta, url = metadata
    image_bytes = record.members[image_ext]
    return DecodedSample(
        key=record.key,
        shard=record.shard,
        image=rgb if pixels else None,
        caption=caption,
        url=url,
        meta=meta,
        image_sha256=hashlib.sha256(image_bytes).hexdigest(),
        image_bytes=b"" if pixels else image_bytes,
        image_format="" if pixels else rgb,
        image_ext=image_ext,
    )
