"""Tiny img2dataset-style tar shards written on the fly, for tests of the shard reader.

Plain functions only (no pytest fixtures), so any test module can import them. Every writer is
deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import struct
import tarfile
import zlib
from collections.abc import Sequence

import fsspec
from PIL import Image

# Filled only if something ever unpickles the canary payload below; tests assert it stays empty.
UNPICKLED: list[str] = []


def mark_unpickled(*args: object) -> None:
    """Target of the pickle canary: records that a ``.pkl`` member was unpickled."""
    UNPICKLED.append(repr(args))


def pickle_canary() -> bytes:
    """Protocol-0 pickle that calls :func:`mark_unpickled` when loaded (hand-written opcodes)."""
    return f"c{__name__}\nmark_unpickled\n(tR.".encode()


# A member is (name, data) for a regular file, or (name, data, tar type) where data is the link
# target for tarfile.SYMTYPE / tarfile.LNKTYPE and ignored for tarfile.DIRTYPE.
Member = tuple[str, bytes] | tuple[str, bytes, bytes]


def tar_bytes(members: Sequence[Member]) -> bytes:
    """Serialise ``members`` as an uncompressed tar with fixed metadata (mtime 0, uid 0)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for member in members:
            name, data = member[0], member[1]
            kind = member[2] if len(member) == 3 else tarfile.REGTYPE  # type: ignore[misc]
            info = tarfile.TarInfo(name)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = kind
            if kind == tarfile.REGTYPE:
                info.mode = 0o644
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o777
                if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                    info.linkname = data.decode()
                tar.addfile(info)
    return buf.getvalue()


def _write_bytes(path: str, data: bytes) -> None:
    if path.endswith((".gz", ".tgz")):
        data = gzip.compress(data, mtime=0)  # mtime=0 keeps the gzip header deterministic
    with fsspec.open(path, "wb") as f:
        f.write(data)


def write_tar(path: str, members: Sequence[Member]) -> None:
    """Write a deterministic tar (gzip-compressed when ``path`` ends in .gz/.tgz).

    Args:
        path: Local path or fsspec URL (e.g. ``memory://d/00000.tar``).
        members: ``(name, bytes)`` regular files in order; ``(name, target, tarfile.SYMTYPE)``
            etc. for special members.
    """
    _write_bytes(path, tar_bytes(members))


def _noise_image(mode: str, size: tuple[int, int], seed: int = 0) -> Image.Image:
    rng = random.Random(seed)
    bands = len(mode)
    return Image.frombytes(
        mode, size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * bands))
    )


def jpeg_bytes(
    size: tuple[int, int] = (32, 32), color: tuple[int, int, int] = (200, 30, 30)
) -> bytes:
    """A baseline JPEG of one colour."""
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def noisy_jpeg_bytes(size: tuple[int, int] = (64, 64), seed: int = 0) -> bytes:
    """A JPEG of random noise: its entropy-coded data spans the file, so a cut breaks it."""
    buf = io.BytesIO()
    _noise_image("RGB", size, seed).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def png_bytes(mode: str = "RGB", size: tuple[int, int] = (16, 16)) -> bytes:
    """A PNG in ``mode`` with a predictable RGB conversion.

    * ``RGB``/``L``/``1``/``P``: a mid colour, opaque.
    * ``RGBA``/``LA``: fully transparent red/black, which decodes to white.
    * ``P`` with transparency: use :func:`png_bytes` with ``mode="P_transparent"``: palette index
      0 transparent, decodes to white.
    * ``I;16``: constant 0x8000, which decodes to grey 128.
    """
    if mode == "RGBA":
        image = Image.new("RGBA", size, (255, 0, 0, 0))
    elif mode == "LA":
        image = Image.new("LA", size, (0, 0))
    elif mode == "I;16":
        image = Image.new("I;16", size, 0x8000)
    elif mode == "P":
        image = Image.new("RGB", size, (0, 128, 255)).convert("P")
    elif mode == "P_transparent":
        image = Image.new("P", size, 0)
        image.putpalette([0, 0, 0] * 256)
        image.info["transparency"] = 0
    elif mode == "1":
        image = Image.new("1", size, 1)
    elif mode == "L":
        image = Image.new("L", size, 77)
    else:
        image = Image.new(mode, size, (10, 120, 230))
    buf = io.BytesIO()
    save_kwargs = {"transparency": 0} if mode == "P_transparent" else {}
    image.save(buf, format="PNG", **save_kwargs)
    return buf.getvalue()


def webp_bytes(
    size: tuple[int, int] = (16, 16), color: tuple[int, int, int] = (30, 200, 30)
) -> bytes:
    """A lossless WEBP of one colour."""
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="WEBP", lossless=True)
    return buf.getvalue()


def gif_bytes(size: tuple[int, int] = (8, 8)) -> bytes:
    """A GIF: a real image in a format the decoder must refuse."""
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format="GIF")
    return buf.getvalue()


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))
        + kind
        + payload
        + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)
    )


def png_header_bytes(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` greyscale with one row of data.

    Costs a few hundred bytes and no memory to build; decoding it would need width*height
    bytes, which is what the pixel limit must prevent.
    """
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    one_row = zlib.compress(b"\x00" * (width + 1))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", one_row)
        + _png_chunk(b"IEND", b"")
    )


def _sample(key: str, caption: str, image: bytes | None = None, ext: str = "jpg") -> list[Member]:
    members: list[Member] = [(f"{key}.{ext}", image if image is not None else jpeg_bytes())]
    members.append((f"{key}.txt", caption.encode()))
    return members


def write_corrupt_shard(path: str) -> dict:
    """Write one shard mixing good samples with one of each failure the reader must handle.

    Returns:
        ``{"good": int, "reasons": {reason: count}, "records": int, "good_keys": [...],
        "ignored": {ext or "<type>": count}, "rejected": [(key, reason), ...],
        "members_total": int}`` where records
        counts sample groups, so ``good + sum(reasons.values()) == records``.
    """
    meta0 = {"url": "http://example.com/0.jpg", "key": "000000000", "status": "success"}
    members: list[Member] = []
    # ---- good samples
    members += _sample("000000000", "a red square", jpeg_bytes())
    members.append(("000000000.json", json.dumps(meta0).encode()))
    members += _sample("000000001", "a palette image", png_bytes("P"), "png")
    members += _sample("000000002", "a transparent image", png_bytes("RGBA"), "png")
    members.append(("000000002.json", b'{"url": null, "width": 16}'))
    members += _sample("000000003", "a green webp", webp_bytes(), "webp")
    members += [
        ("000000003.npy", b"\x93NUMPY not really"),
        ("000000003.pth", pickle_canary()),
        ("000000003.cls", b"7"),
        ("000000003.meta", b"/etc/passwd", tarfile.SYMTYPE),  # link, not a sample member
    ]
    members += _sample("000000004", "a sample with pickles attached", jpeg_bytes(color=(1, 2, 3)))
    members += [("000000004.pkl", pickle_canary()), ("000000004.pyd", b"MZ\x90\x00binary")]
    members += _sample("000000005", "sixteen bit grey", png_bytes("I;16"), "png")
    members += _sample("000000006", "grey with alpha", png_bytes("LA"), "png")
    members.append(("extras/", b"", tarfile.DIRTYPE))
    # ---- one of each bad case
    rejected: list[tuple[str, str]] = []  # (key, reason) in tar order

    def bad(key: str, reason: str, group: list[Member]) -> None:
        rejected.append((key, reason))
        members.extend(group)

    truncated = noisy_jpeg_bytes()
    bad(
        "000000010",
        "undecodable_image",
        _sample("000000010", "cut jpeg", truncated[: len(truncated) // 2]),
    )
    bad("000000011", "empty_image", _sample("000000011", "zero bytes", b""))
    bad("000000012", "missing_caption", [("000000012.jpg", jpeg_bytes())])
    bad(
        "000000013",
        "invalid_utf8",
        [("000000013.jpg", jpeg_bytes()), ("000000013.txt", b"caf\xe9 \xff\xfe")],
    )
    bad(
        "000000014",
        "empty_caption",
        [("000000014.jpg", jpeg_bytes()), ("000000014.txt", b"  \n\t ")],
    )
    bad("../evil", "unsafe_member", [("../evil.jpg", jpeg_bytes())])
    bad("/abs/evil", "unsafe_member", _sample("/abs/evil", "absolute path"))
    bad("000000016", "missing_image", [("000000016.pkl", pickle_canary())])
    bad("000000000", "duplicate_key", _sample("000000000", "the same key again"))
    bad(
        "000000017",
        "image_too_large",
        _sample("000000017", "20000 x 20000", png_header_bytes(20000, 20000), "png"),
    )
    bad(
        "000000018",
        "image_too_large",
        _sample("000000018", "9000 x 9000", png_header_bytes(9000, 9000), "png"),
    )
    bad(
        "000000019",
        "invalid_json",
        _sample("000000019", "bad json") + [("000000019.json", b"{not json")],
    )
    bad(
        "000000020",
        "invalid_json",
        _sample("000000020", "json list") + [("000000020.json", b"[1, 2]")],
    )
    bad(
        "000000021",
        "duplicate_member",
        [
            ("000000021.jpg", jpeg_bytes()),
            ("000000021.jpg", jpeg_bytes()),
            ("000000021.txt", b"two"),
        ],
    )
    bad(
        "000000022",
        "unsafe_member",
        [("000000022.jpg", b"/etc/passwd", tarfile.SYMTYPE), ("000000022.txt", b"symlinked image")],
    )
    bad(
        "000000023",
        "undecodable_image",
        _sample("000000023", "garbage png", b"\x89PNG\r\n\x1a\n garbage", "png"),
    )
    bad("000000024", "undecodable_image", _sample("000000024", "a gif named jpg", gif_bytes()))
    bad(
        "000000026",
        "unsafe_member",
        [("000000026.jpg", jpeg_bytes()), ("000000026.txt", b"000000000.txt", tarfile.LNKTYPE)],
    )
    write_tar(path, members)

    reasons: dict[str, int] = {}
    for _, reason in rejected:
        reasons[reason] = reasons.get(reason, 0) + 1
    good_keys = [f"00000000{i}" for i in range(7)]
    return {
        "good": len(good_keys),
        "good_keys": good_keys,
        "reasons": reasons,
        "records": len(good_keys) + len(rejected),
        "rejected": rejected,
        "ignored": {"npy": 1, "pth": 1, "cls": 1, "pkl": 2, "pyd": 1, "<symlink>": 1, "<dir>": 1},
        "members_total": len(members),
    }


def write_truncated_shard(path: str, where: str = "member_data") -> dict:
    """Write a valid three-sample shard (jpg + txt each), then cut it.

    Args:
        path: Local path or fsspec URL.
        where: ``"member_data"`` cuts inside the third sample's image bytes; ``"header"`` inside
            the third sample's first header; ``"boundary"`` exactly at that header, leaving a
            tar without end-of-archive marker.

    Returns:
        ``{"good": int, "good_keys": [...], "last_good_member": str, "size": bytes written}``.
        A sample is only yielded once the next key's header proves it complete, so the second
        sample survives a cut in the third one's data but not one at or in its header.
    """
    members: list[Member] = []
    for i in range(3):
        members += _sample(f"{i:09d}", f"caption {i}", noisy_jpeg_bytes(seed=i))
    data = tar_bytes(members)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        third = tar.getmember(f"{2:09d}.jpg")
    if where == "member_data":
        cut = third.offset_data + third.size // 2
        good_keys = [f"{0:09d}", f"{1:09d}"]
    elif where == "header":
        cut = third.offset + 100
        good_keys = [f"{0:09d}"]
    elif where == "boundary":
        cut = third.offset
        good_keys = [f"{0:09d}"]
    else:
        raise ValueError(f"where={where!r}; use member_data, header or boundary")
    _write_bytes(path, data[:cut])
    return {
        "good": len(good_keys),
        "good_keys": good_keys,
        "last_good_member": f"{1:09d}.txt",
        "size": cut,
    }
