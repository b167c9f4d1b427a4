"""Tests for pipeline.io.shards: shard patterns, streaming tar reading, safe decoding."""

from __future__ import annotations

import io
import logging
import os
import pickle
import tarfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import pytest
import shard_fixtures as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import pipeline.io.shard_patterns as shard_patterns
from pipeline.io.shards import (
    QUARANTINE_REASONS,
    DecodedSample,
    DecodeOptions,
    RawRecord,
    Rejection,
    ShardPatternError,
    ShardReadError,
    ShardReadStats,
    decode_record,
    expand_shard_patterns,
    iter_shard_records,
    shard_name,
)

# --------------------------------------------------------------------------- helpers


def _expanded(pattern: str) -> list[str]:
    """`pattern`'s brace expansion through the public function, without any file: a `pipe:`
    spec is expanded and never opened or checked."""
    commands = expand_shard_patterns(f"pipe:cat {pattern}", allow_pipe=True)
    return [c.removeprefix("pipe:cat ") for c in commands]


def _touch_tars(directory: Path, names: list[str]) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        path = directory / name
        fx.write_tar(str(path), [(f"{path.stem}.txt", b"x")])
        paths.append(str(path.resolve()))
    return paths


def _read_all(path: str, options: DecodeOptions = DecodeOptions(), **kwargs):
    """(decoded outcomes in order, stats): RawRecords are decoded, Rejections passed through."""
    stats = ShardReadStats()
    outcomes = [
        item if isinstance(item, Rejection) else decode_record(item, options)
        for item in iter_shard_records(path, stats, **kwargs)
    ]
    return outcomes, stats


@pytest.fixture
def memory_dir():
    """A unique directory on fsspec's process-global memory filesystem, removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/test-{uuid.uuid4().hex}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(scope="module")
def corrupt_shard(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("corrupt") / "00007.tar")
    expected = fx.write_corrupt_shard(path)
    outcomes, stats = _read_all(path)
    return path, expected, outcomes, stats


# --------------------------------------------------------------------------- patterns


def test_numeric_braces_keep_zero_padding_and_order(tmp_path):
    paths = _touch_tars(tmp_path, [f"{i:05d}.tar" for i in range(12)])
    got = expand_shard_patterns(str(tmp_path / "{00000..00011}.tar"))
    assert got == paths
    assert [shard_name(p) for p in got][:3] == ["00000", "00001", "00002"]


def test_brace_paths_that_do_not_exist_are_skipped_with_a_warning(tmp_path, caplog):
    paths = _touch_tars(tmp_path, ["00000.tar", "00002.tar"])
    with caplog.at_level(logging.WARNING, logger="pipeline.io.shard_patterns"):
        got = expand_shard_patterns(str(tmp_path / "{00000..00002}.tar"))
    assert got == paths
    assert "00001.tar" in caplog.text


def test_many_brace_paths_in_one_directory_are_listed_not_probed(tmp_path):
    # Above the listing threshold; half of the range is missing.
    paths = _touch_tars(tmp_path, [f"{i:03d}.tar" for i in range(0, 40, 2)])
    assert expand_shard_patterns(str(tmp_path / "{000..039}.tar")) == paths


def test_alternatives_nested_and_in_user_order(tmp_path):
    _touch_tars(tmp_path, ["b.tar", "a1.tar", "a2.tar", "c.tar"])
    got = expand_shard_patterns(str(tmp_path / "{b,a{1,2},c}.tar"))
    assert [shard_name(p) for p in got] == ["b", "a1", "a2", "c"]


def test_literal_braces_without_comma_or_range_are_kept(tmp_path):
    (tmp_path / "{x}").mkdir()
    paths = _touch_tars(tmp_path / "{x}", ["1.tar"])
    assert expand_shard_patterns(str(tmp_path / "{x}" / "{1,2}.tar")) == paths


def test_globs_are_sorted_and_skip_directories(tmp_path):
    paths = _touch_tars(tmp_path, ["00002.tar", "00000.tar", "00001.tar", "00010.tar"])
    (tmp_path / "dir.tar").mkdir()
    (tmp_path / "00000.parquet").write_bytes(b"")
    assert expand_shard_patterns(str(tmp_path / "*.tar")) == sorted(paths)
    assert expand_shard_patterns(str(tmp_path / "0000[01].tar")) == sorted(paths)[:2]
    assert expand_shard_patterns(str(tmp_path / "0001?.tar")) == [str(tmp_path / "00010.tar")]


def test_lists_keep_order_and_drop_duplicates(tmp_path, monkeypatch):
    a, b, c = _touch_tars(tmp_path, ["a.tar", "b.tar", "c.tar"])
    monkeypatch.chdir(tmp_path)
    got = expand_shard_patterns(["c.tar", str(tmp_path / "*.tar"), f"file://{a}", "b.tar"])
    # Relative paths come back absolute: Ray workers do not share the driver's cwd.
    assert got == [c, a, b]


def test_tuple_and_pathlike_specs(tmp_path):
    (a,) = _touch_tars(tmp_path, ["a.tar"])
    assert expand_shard_patterns((Path(a),)) == [a]
    assert expand_shard_patterns(Path(a)) == [a]


def test_file_urls(tmp_path):
    a, b = _touch_tars(tmp_path, ["00000.tar", "00001.tar"])
    assert expand_shard_patterns(f"file://{tmp_path}/*.tar") == [f"file://{a}", f"file://{b}"]
    assert expand_shard_patterns(f"file://{tmp_path}/{{00000..00001}}.tar") == [
        f"file://{a}",
        f"file://{b}",
    ]


def test_memory_urls_braces_globs_and_reading(memory_dir):
    fs, root = memory_dir
    for i in range(3):
        fx.write_tar(f"memory://{root}/{i:05d}.tar", fx._sample(f"{i:09d}", f"caption {i}"))
    by_braces = expand_shard_patterns(f"memory://{root}/{{00000..00003}}.tar")
    assert by_braces == [f"memory://{root}/{i:05d}.tar" for i in range(3)]
    by_glob = expand_shard_patterns(f"memory://{root}/*.tar")
    assert [shard_name(p) for p in by_glob] == ["00000", "00001", "00002"]
    assert all(p.startswith("memory://") for p in by_glob)
    outcomes, stats = _read_all(by_glob[1])
    assert [o.caption for o in outcomes] == ["caption 1"]
    assert stats.records == 1


def test_whole_spec_matching_nothing_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "{00000..00009}.tar")
    with pytest.raises(ShardPatternError, match=r"no shards match.*00009"):
        expand_shard_patterns(pattern)
    with pytest.raises(ShardPatternError, match="nothing-here"):
        expand_shard_patterns([str(tmp_path / "nothing-here*.tar"), str(tmp_path / "x.tar")])
    with pytest.raises(ShardPatternError, match="memory://"):
        expand_shard_patterns(f"memory://no-such-{uuid.uuid4().hex}/*.tar")


def test_partially_missing_explicit_list_is_an_error(tmp_path):
    (present,) = _touch_tars(tmp_path, ["00000.tar"])
    missing = [str(tmp_path / f"{i:05d}.tar") for i in range(1, 8)]
    with pytest.raises(ShardPatternError, match="7 listed shard") as info:
        expand_shard_patterns([present, *missing])
    message = str(info.value)
    assert all(m in message for m in missing[:5])
    assert missing[5] not in message and "2 more" in message


def test_pipe_urls_are_refused_unless_allowed():
    command = "pipe:curl -s https://example.com/00000.tar"
    with pytest.raises(ShardPatternError, match="pipe"):
        expand_shard_patterns(command)
    with pytest.raises(ShardPatternError, match="pipe"):
        expand_shard_patterns(["/nonexistent/a.tar", command])
    assert expand_shard_patterns(command, allow_pipe=True) == [command]


def test_shards_with_the_same_name_are_an_error(tmp_path):
    _touch_tars(tmp_path / "train", ["00000.tar"])
    _touch_tars(tmp_path / "val", ["00000.tar"])
    with pytest.raises(ShardPatternError, match="share the name '00000'"):
        expand_shard_patterns(str(tmp_path / "{train,val}" / "00000.tar"))


@pytest.mark.parametrize("spec", ["", [], ["  "]])
def test_empty_specs_are_rejected(spec):
    with pytest.raises(ShardPatternError):
        expand_shard_patterns(spec)


def test_absurd_ranges_are_rejected_before_expanding():
    with pytest.raises(ShardPatternError, match="limit"):
        expand_shard_patterns("/d/{0..999999999}.tar")


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/x/00042.tar", "00042"),
        ("00042.tar.gz", "00042"),
        ("s3://bucket/cc3m/00042.tgz", "00042"),
        ("https://host/a/00042.tar?token=abc", "00042"),
        ("memory:///d/shard-7.tar.xz", "shard-7"),
        ("pipe:curl -s https://host/00042.tar | cat", "00042"),
        ("/x/plainname", "plainname"),
    ],
)
def test_shard_name(path, name):
    assert shard_name(path) == name


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(0, 5000),
    length=st.integers(0, 300),
    extra_width=st.integers(0, 3),
)
def test_brace_range_property(start, length, extra_width):
    stop = start + length
    width = len(str(stop)) + extra_width
    first, last = f"{start:0{width}d}", f"{stop:0{width}d}"
    names = _expanded(f"/d/{{{first}..{last}}}.tar")
    assert len(names) == len(set(names)) == stop - start + 1
    numbers = [int(Path(n).stem) for n in names]
    assert numbers == list(range(start, stop + 1))
    padded = width > 1 and first.startswith("0")
    if padded:
        assert all(len(Path(n).stem) == width for n in names)
    assert _expanded(f"/d/{{{last}..{first}}}.tar") == list(reversed(names))


# --------------------------------------------------------------------------- corrupt shard


def test_every_quarantine_reason_is_documented():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "shards.md").read_text()
    for reason in QUARANTINE_REASONS:
        assert f"- `{reason}`:" in doc, reason


@pytest.mark.parametrize(
    "reason",
    sorted(
        set(QUARANTINE_REASONS) - {"truncated_shard", "member_too_large"}
    ),  # those two have their own tests
)
def test_each_reason_is_reported_on_the_corrupt_shard(corrupt_shard, reason):
    _, expected, outcomes, _ = corrupt_shard
    got = [(o.key, o.reason) for o in outcomes if isinstance(o, Rejection) and o.reason == reason]
    want = [(key, r) for key, r in expected["rejected"] if r == reason]
    assert got == want and want


def test_corrupt_shard_reconciles_exactly(corrupt_shard):
    _, expected, outcomes, stats = corrupt_shard
    good = [o for o in outcomes if isinstance(o, DecodedSample)]
    quarantined = [o for o in outcomes if isinstance(o, Rejection)]
    assert [o.key for o in good] == expected["good_keys"]
    assert len(good) + len(quarantined) == stats.records == expected["records"]
    assert stats.error is None and all(q.key is not None for q in quarantined)
    counts: dict[str, int] = {}
    for q in quarantined:
        counts[q.reason] = counts.get(q.reason, 0) + 1
    assert counts == expected["reasons"]
    assert stats.ignored_members == expected["ignored"]
    assert stats.members_total == expected["members_total"]
    assert stats.rejected == {"unsafe_member": 4, "duplicate_key": 1, "duplicate_member": 1}


def test_rejections_name_key_shard_member_and_detail(corrupt_shard):
    _, _, outcomes, _ = corrupt_shard
    for rejection in (o for o in outcomes if isinstance(o, Rejection)):
        assert rejection.reason in QUARANTINE_REASONS
        assert rejection.shard == "00007"
        assert rejection.key and rejection.detail
        if rejection.reason != "missing_image":  # nothing to name when no image exists
            assert rejection.member and rejection.member.startswith(rejection.key + ".")
        assert "BytesIO object at" not in rejection.detail


def test_good_samples_carry_caption_url_and_meta(corrupt_shard):
    _, _, outcomes, _ = corrupt_shard
    first = outcomes[0]
    assert isinstance(first, DecodedSample)
    assert first.caption == "a red square"
    assert first.url == "http://example.com/0.jpg"
    assert first.meta["status"] == "success"
    by_key = {o.key: o for o in outcomes if isinstance(o, DecodedSample)}
    assert by_key["000000002"].url is None and by_key["000000002"].meta["width"] == 16
    assert by_key["000000001"].meta == {}
    for sample in by_key.values():
        assert sample.image.mode == "RGB"
        assert sample.image.size in {(16, 16), (32, 32)}


def test_pickles_are_never_loaded(tmp_path, monkeypatch, corrupt_shard):
    path, _, reference, _ = corrupt_shard

    def refuse(*args, **kwargs):
        raise AssertionError("pickle must never be used")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    outcomes, _ = _read_all(path)
    assert outcomes == reference
    assert fx.UNPICKLED == []


def test_ignored_members_are_not_in_raw_records(corrupt_shard):
    path = corrupt_shard[0]
    for item in iter_shard_records(path):
        if isinstance(item, RawRecord):
            assert set(item.members) <= {"jpg", "jpeg", "png", "webp", "txt", "json"}


def test_dotfiles_and_extensionless_members_do_not_form_samples(tmp_path):
    path = str(tmp_path / "00000.tar")
    members = [
        *fx._sample("000000001", "one"),
        ("._000000001.jpg", b"appledouble"),
        (".DS_Store", b"x"),
        ("README", b"hello"),
        ("000000001.json", b"{}"),
    ]
    fx.write_tar(path, members)
    outcomes, stats = _read_all(path)
    assert [(o.key, type(o).__name__) for o in outcomes] == [("000000001", "DecodedSample")]
    assert stats.records == 1
    assert sum(stats.ignored_members.values()) == 3


def test_directory_prefixes_stay_in_the_key(tmp_path):
    path = str(tmp_path / "00000.tar")
    fx.write_tar(path, fx._sample("part/000000001", "nested"))
    (sample,), _ = _read_all(path)
    assert sample.key == "part/000000001" and sample.caption == "nested"


def test_member_too_large_is_never_read(tmp_path):
    path = str(tmp_path / "00000.tar")
    big = fx.jpeg_bytes(size=(256, 256))
    fx.write_tar(path, fx._sample("000000001", "big", big) + fx._sample("000000002", "ok"))
    outcomes, stats = _read_all(path, max_member_bytes=len(big) - 1)
    assert [(o.key, getattr(o, "reason", "good")) for o in outcomes] == [
        ("000000001", "member_too_large"),
        ("000000002", "good"),
    ]
    assert outcomes[0].member == "000000001.jpg"
    assert stats.rejected == {"member_too_large": 1}


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize(
    ("ext", "data", "pixel"),
    [
        ("png", fx.png_bytes("P"), (0, 153, 255)),  # palette quantisation of (0, 128, 255)
        ("png", fx.png_bytes("P_transparent"), (255, 255, 255)),
        ("png", fx.png_bytes("RGBA"), (255, 255, 255)),
        ("png", fx.png_bytes("LA"), (255, 255, 255)),
        ("png", fx.png_bytes("I;16"), (128, 128, 128)),
        ("png", fx.png_bytes("1"), (255, 255, 255)),
        ("png", fx.png_bytes("L"), (77, 77, 77)),
        ("png", fx.png_bytes("RGB"), (10, 120, 230)),
        ("webp", fx.webp_bytes(), (30, 200, 30)),
        ("jpg", fx.jpeg_bytes(color=(0, 0, 0)), (0, 0, 0)),
    ],
)
def test_modes_are_converted_to_rgb(ext, data, pixel):
    record = RawRecord(key="k", shard="s", members={ext: data, "txt": b"caption"})
    sample = decode_record(record)
    assert isinstance(sample, DecodedSample)
    assert sample.image.mode == "RGB"
    assert sample.image.getpixel((0, 0)) == pixel


def test_cmyk_jpeg_and_semi_transparent_rgba():
    buf = io.BytesIO()
    Image.new("CMYK", (8, 8), (0, 0, 0, 0)).save(buf, format="JPEG", quality=100)
    sample = decode_record(RawRecord("k", "s", {"jpg": buf.getvalue(), "txt": b"c"}))
    assert sample.image.mode == "RGB" and min(sample.image.getpixel((0, 0))) > 245

    buf = io.BytesIO()
    Image.new("RGBA", (8, 8), (0, 0, 0, 128)).save(buf, format="PNG")
    sample = decode_record(RawRecord("k", "s", {"png": buf.getvalue(), "txt": b"c"}))
    assert sample.image.getpixel((0, 0)) == (127, 127, 127)  # half black over white


def test_image_key_auto_and_explicit():
    members = {"png": fx.png_bytes("L"), "webp": fx.webp_bytes(), "txt": b"c"}
    record = RawRecord("k", "s", members)
    assert decode_record(record).image.getpixel((0, 0)) == (77, 77, 77)  # png before webp
    explicit = decode_record(record, DecodeOptions(image_key="webp"))
    assert explicit.image.getpixel((0, 0)) == (30, 200, 30)
    missing = decode_record(record, DecodeOptions(image_key="jpg"))
    assert (missing.reason, missing.member) == ("missing_image", "k.jpg")


@pytest.mark.parametrize(
    "kwargs",
    [{"image_key": "gif"}, {"caption_key": "pkl"}, {"max_image_pixels": 0}],
)
def test_bad_decode_options_fail_at_construction(kwargs):
    with pytest.raises(ValueError, match="allowed|positive"):
        DecodeOptions(**kwargs)


def test_pixel_limit_is_checked_before_decoding():
    record = RawRecord("k", "s", {"jpg": fx.jpeg_bytes(size=(40, 30)), "txt": b"c"})
    rejected = decode_record(record, DecodeOptions(max_image_pixels=40 * 30 - 1))
    assert rejected.reason == "image_too_large" and "40x30" in rejected.detail
    assert isinstance(decode_record(record, DecodeOptions(max_image_pixels=40 * 30)), DecodedSample)


def test_pil_globals_are_untouched(corrupt_shard):
    assert Image.MAX_IMAGE_PIXELS == 89_478_485
    from PIL import ImageFile

    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_caption_is_stripped_and_bom_removed():
    record = RawRecord("k", "s", {"jpg": fx.jpeg_bytes(), "txt": "\ufeff  a caption \n".encode()})
    assert decode_record(record).caption == "a caption"


def test_decode_is_pure_and_thread_safe(corrupt_shard):
    path = corrupt_shard[0]
    records = [r for r in iter_shard_records(path) if isinstance(r, RawRecord)]
    snapshot = [dict(r.members) for r in records]
    serial = [decode_record(r) for r in records]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(3):
            threaded = list(pool.map(decode_record, records * 4))
            assert threaded == serial * 4
    assert [r.members for r in records] == snapshot


# --------------------------------------------------------------------------- broken shards


@pytest.mark.parametrize("where", ["member_data", "header", "boundary"])
def test_truncated_shard_keeps_earlier_records(tmp_path, where):
    path = str(tmp_path / "00003.tar")
    expected = fx.write_truncated_shard(path, where=where)
    outcomes, stats = _read_all(path)
    *samples, last = outcomes
    assert [s.key for s in samples] == expected["good_keys"]
    assert all(isinstance(s, DecodedSample) for s in samples)
    assert last.reason == "truncated_shard" and last.key is None and last.shard == "00003"
    assert last.member == expected["last_good_member"]
    assert path in last.detail and last.detail
    assert stats.error and stats.records == expected["good"]
    assert stats.rejected == {"truncated_shard": 1}


def test_corrupt_header_mid_way_is_a_truncated_shard(tmp_path):
    members = fx._sample("000000001", "one") + fx._sample("000000002", "two")
    data = bytearray(fx.tar_bytes(members))
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        third_header = tar.getmember("000000002.jpg").offset
    data[third_header + 148 : third_header + 156] = b"9999999\x00"  # wrong header checksum
    path = tmp_path / "00000.tar"
    path.write_bytes(bytes(data))
    outcomes, stats = _read_all(str(path))
    assert [getattr(o, "reason", "good") for o in outcomes] == ["truncated_shard"]
    assert outcomes[0].member == "000000001.txt" and stats.error


def test_truncated_gzip_shard(tmp_path):
    members = []
    for i in range(3):
        members += fx._sample(f"{i:09d}", "c", fx.noisy_jpeg_bytes(seed=i))
    full = tmp_path / "full.tar.gz"
    fx.write_tar(str(full), members)
    cut = tmp_path / "00000.tar.gz"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size * 2 // 3])
    outcomes, stats = _read_all(str(cut))
    assert outcomes[-1].reason == "truncated_shard" and stats.error
    assert all(isinstance(o, DecodedSample) for o in outcomes[:-1])


def test_gzip_shards_read_like_plain_ones(tmp_path, corrupt_shard):
    _, expected, reference, _ = corrupt_shard
    path = str(tmp_path / "00007.tar.gz")
    fx.write_corrupt_shard(path)
    outcomes, stats = _read_all(path)
    assert outcomes == reference
    assert stats.records == expected["records"]


@pytest.mark.parametrize("content", [None, b"", b"this is not a tar archive" * 100])
def test_unopenable_shards_raise_shard_read_error(tmp_path, content):
    path = tmp_path / "00000.tar"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ShardReadError, match=str(path)):
        list(iter_shard_records(str(path)))


def test_empty_tar_has_no_records(tmp_path):
    path = str(tmp_path / "00000.tar")
    fx.write_tar(path, [])
    outcomes, stats = _read_all(path)
    assert outcomes == [] and stats.records == 0 and stats.error is None


def test_writer_is_deterministic(tmp_path):
    a, b = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    fx.write_corrupt_shard(str(a))
    fx.write_corrupt_shard(str(b))
    assert a.read_bytes() == b.read_bytes()


def test_pipe_shards_need_opt_in(tmp_path):
    path = tmp_path / "00000.tar"
    fx.write_tar(str(path), fx._sample("000000001", "piped"))
    command = f"pipe:cat {path}"
    with pytest.raises(ValueError, match="allow_pipe"):
        list(iter_shard_records(command))
    outcomes, _ = _read_all(command, allow_pipe=True)
    assert [(o.key, o.shard, o.caption) for o in outcomes] == [("000000001", "00000", "piped")]
    failing, stats = _read_all(f"pipe:cat {path}; exit 3", allow_pipe=True)
    assert failing[-1].reason == "truncated_shard" and "status 3" in stats.error


def test_abandoning_the_iterator_closes_the_shard(tmp_path):
    path = tmp_path / "00000.tar"
    fx.write_tar(str(path), fx._sample("000000001", "a") + fx._sample("000000002", "b"))
    iterator = iter_shard_records(str(path))
    next(iterator)
    iterator.close()  # must not raise, and must release the file
    assert os.path.exists(path)


def test_stepped_brace_ranges_stop_at_the_end_point():
    """As bash: a step never carries the range past its end point."""
    assert _expanded("{0..20..3}") == ["0", "3", "6", "9", "12", "15", "18"]
    assert _expanded("{20..0..3}") == ["20", "17", "14", "11", "8", "5", "2"]
    assert _expanded("{00..10..5}") == ["00", "05", "10"]


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("/d/{0..9..0}.tar", "step must not be 0"),
        ("/d/{00000..00003.tar", "unbalanced braces"),
        ("/d/{0..9}{0..9}{0..9}.tar", "more than 100 names"),
    ],
)
def test_bad_brace_patterns_are_refused_in_one_sentence(monkeypatch, pattern, message):
    monkeypatch.setattr(shard_patterns, "_MAX_EXPANSION", 100)  # the guard on many names
    with pytest.raises(ShardPatternError, match=message) as refused:
        expand_shard_patterns(pattern)
    assert pattern in str(refused.value) and "\n" not in str(refused.value)
    assert len(_expanded("/d/{0..9}{0..9}.tar")) == 100
