"""Reading img2dataset WebDataset tar shards: shard patterns, streaming members, safe decoding.

Contract (docs/architecture.md §4.1):

* **Shard specs.** :func:`expand_shard_patterns` accepts brace patterns
  (``/d/{00000..00331}.tar``, ``{a,b}``, nested), globs (``*``, ``?``, ``[..]``) on local paths
  and fsspec URLs, plain paths, fsspec URLs (``s3://``, ``gs://``, ``memory://``, ``file://``,
  chained ``simplecache::s3://``) and lists of any of these. Local paths come back absolute (Ray
  workers do not share the driver's working directory); URLs keep their protocol. Order is the
  user's order, sorted within each glob, first occurrence wins. Missing brace-expanded paths are
  skipped with a warning, missing plainly listed paths are an error, a spec matching nothing is an
  error, two shards with the same :func:`shard_name` are an error (outputs are keyed by it).
  ``pipe:`` commands are refused unless the job opts in with ``allow_pipe=True``.
  :func:`expand_sources` does this per named source (``input.sources``) and tags each location
  with its source: such a shard is named ``<source>-<name>`` and its keys read ``<source>/<key>``.
* **Grouping.** Members are grouped into samples webdataset-style: consecutive members sharing a
  key, the member name up to the first ``.`` of its basename (``dir/000000001.jpg`` has key
  ``dir/000000001`` and extension ``jpg``). Extensions are compared lower-cased. Keys are kept as
  given. Members with an empty key (dotfiles such as ``._x.jpg``, ``.DS_Store``) or no extension
  do not form samples; they are ignored and counted.
* **Allow-list.** Only :data:`IMAGE_EXTENSIONS`, :data:`TEXT_EXTENSIONS` and
  :data:`META_EXTENSIONS` members are read into memory. Every other member (``.pkl``, ``.pyd``,
  ``.npy``, ``.pth``, ``.cls``, ...) is skipped unread and counted in
  :attr:`ShardReadStats.ignored_members` by extension; a sample consisting only of such members
  still counts as a sample (and is quarantined as ``missing_image``). Images are decoded by PIL
  restricted to JPEG/PNG/WEBP whatever the file extension says, with a pixel limit checked from
  the header before any pixel is decoded. Text is strict UTF-8, metadata is JSON. Nothing is ever
  unpickled, nothing is ever extracted to the filesystem, and no PIL global is modified.
* **Member safety.** Names that are absolute or contain a ``..`` component, and symlinks or
  hardlinks that would provide an allow-listed member, make their sample ``unsafe_member``. Other
  non-regular members (directories, devices, fifos, links with other extensions) are ignored and
  counted under ``"<dir>"``, ``"<symlink>"``, ``"<hardlink>"``, ``"<device>"``, ``"<fifo>"``,
  ``"<other>"``.
* **Reconciliation.** :func:`iter_shard_records` yields exactly one item per sample group, either
  a :class:`RawRecord` or a :class:`Rejection` with a key, and counts groups in
  :attr:`ShardReadStats.records`. :func:`decode_record` turns each :class:`RawRecord` into exactly
  one :class:`DecodedSample` or :class:`Rejection`. Hence ``good + quarantined == records``.
  A shard that breaks mid-way additionally yields one final ``truncated_shard`` row with
  ``key=None`` that is not a sample; the partly read sample in progress is discarded because its
  completeness cannot be established. A shard that cannot be opened at all raises
  :class:`ShardReadError`.

Quarantine reasons (:data:`QUARANTINE_REASONS`). Reader reasons, one per sample group:

* ``unsafe_member``: an absolute or ``..`` member name, or a symlink/hardlink member with an
  allow-listed extension.
* ``duplicate_member``: the same extension twice within one sample group.
* ``duplicate_key``: a key already seen earlier in the shard (the earlier group is kept). The
  same reason marks a key found in an earlier shard (sorted by name), with that shard in
  ``detail``: the run's corpus-wide key check (:mod:`pipeline.stages.keys`) writes those rows,
  not this reader.
* ``member_too_large``: an allow-listed member bigger than ``max_member_bytes`` (never read).
* ``truncated_shard``: the tar broke mid-way (truncated data, corrupt header, missing
  end-of-archive marker, decompression or transport error); ``key`` is None, ``member`` is the
  last member read completely, ``detail`` the error.

Decode reasons, checked in this order (the first failing check wins; cheap checks run before the
image is decoded):

* ``missing_image``: no image member (or not the configured ``image_key``).
* ``empty_image``: the image member has zero bytes.
* ``missing_caption``: no ``caption_key`` member.
* ``invalid_utf8``: the caption is not valid UTF-8.
* ``empty_caption``: the caption is empty or whitespace after stripping.
* ``invalid_json``: the ``.json`` member is not valid JSON or not an object.
* ``image_too_large``: width * height from the header exceeds ``max_image_pixels`` (or PIL's
  own decompression-bomb limit, twice ``PIL.Image.MAX_IMAGE_PIXELS``, whichever is lower).
* ``undecodable_image``: PIL cannot identify or decode the image as JPEG/PNG/WEBP.

Colour handling: every mode becomes RGB. Transparency (alpha channels, palette or single-colour
``tRNS`` transparency) is composited onto white, so transparent logos do not turn into black
squares. 16-bit greyscale is scaled to 8 bits (``>> 8``) instead of being clipped. EXIF
orientation is not applied, matching how open_clip's training loaders read images.

This module is the public entry point and holds the contract; the code lives in
:mod:`pipeline.io.shard_patterns` (shard specs and names), :mod:`pipeline.io.tar_reader`
(streaming and grouping), :mod:`pipeline.io.decode` (decoding) and :mod:`pipeline.io.records`
(the allow-list and the types they exchange).
"""

from __future__ import annotations

from pipeline.io.decode import DecodedSample, DecodeOptions, decode_record
from pipeline.io.records import (
    IMAGE_EXTENSIONS,
    META_EXTENSIONS,
    QUARANTINE_REASONS,
    TEXT_EXTENSIONS,
    RawRecord,
    Rejection,
)
from pipeline.io.shard_patterns import (
    ShardPatternError,
    expand_shard_patterns,
    expand_sources,
    qualify_key,
    shard_name,
    source_location,
    split_source,
)
from pipeline.io.tar_reader import (
    DEFAULT_MAX_MEMBER_BYTES,
    ShardReadError,
    ShardReadStats,
    iter_shard_records,
)

__all__ = [
    "DEFAULT_MAX_MEMBER_BYTES",
    "IMAGE_EXTENSIONS",
    "META_EXTENSIONS",
    "QUARANTINE_REASONS",
    "TEXT_EXTENSIONS",
    "DecodeOptions",
    "DecodedSample",
    "RawRecord",
    "Rejection",
    "ShardPatternError",
    "ShardReadError",
    "ShardReadStats",
    "decode_record",
    "expand_shard_patterns",
    "expand_sources",
    "iter_shard_records",
    "qualify_key",
    "shard_name",
    "source_location",
    "split_source",
]
