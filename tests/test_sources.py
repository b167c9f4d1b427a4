"""Several sources in one run (`input.sources`, issue 36 item 3): two img2dataset downloads
whose shard names and keys collide.

Pure parts first (expansion, names, the reader's keys, the config and the stage keys), then one
real run over two tiny synthetic corpora made with the same shard names (`00000.tar`,
`00001.tar`) and the same keys (`000000000`...), one pair of the first also copied into the
second under another key: labels (read with the client reader) hold every pair once under its
source-qualified key, the copy is quarantined as `duplicate_pair`, webdataset's `.select` with
`LabelSelect(source=...)` picks a source's pairs from its original tars, and a WebDataset export
holds exactly the kept pairs, each with its own source's bytes.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from shard_fixtures import jpeg_bytes, write_tar

from pipeline.config import JobConfigError, load_job
from pipeline.io.labels import uid_of
from pipeline.io.shards import (
    RawRecord,
    ShardPatternError,
    expand_shard_patterns,
    expand_sources,
    iter_shard_records,
    shard_name,
    split_source,
)
from pipeline.run.state import stage_config


def _sample(key: str, caption: str) -> list[tuple[str, bytes]]:
    return [(f"{key}.jpg", jpeg_bytes()), (f"{key}.txt", caption.encode())]


@pytest.fixture()
def two_downloads(tmp_path: Path) -> tuple[Path, Path]:
    """Two folders, each with 00000.tar and 00001.tar holding keys 000000000, 000000001."""
    for folder in ("cc3m", "cc12m"):
        for shard in ("00000", "00001"):
            write_tar(
                str(tmp_path / folder / f"{shard}.tar"),
                _sample("000000000", f"{folder} {shard} a") + _sample("000000001", "b"),
            )
    return tmp_path / "cc3m", tmp_path / "cc12m"


def test_sources_qualify_shard_names_and_keys(two_downloads):
    cc3m, cc12m = two_downloads
    locations = expand_sources(
        [("cc3m", f"{cc3m}/{{00000..00001}}.tar"), ("cc12m", str(cc12m / "*.tar"))]
    )
    assert [shard_name(p) for p in locations] == [
        "cc3m-00000",
        "cc3m-00001",
        "cc12m-00000",
        "cc12m-00001",
    ]
    assert split_source(locations[2]) == ("cc12m", str(cc12m / "00000.tar"))
    records = list(iter_shard_records(locations[2]))
    assert all(isinstance(r, RawRecord) for r in records)
    assert [(r.key, r.shard) for r in records] == [
        ("cc12m/000000000", "cc12m-00000"),
        ("cc12m/000000001", "cc12m-00000"),
    ]
    assert records[0].members["txt"] == b"cc12m 00000 a"

    # One unnamed source is input.shards as before: the same locations, names and keys.
    plain = expand_sources([(None, str(cc3m / "*.tar"))])
    assert plain == expand_shard_patterns(str(cc3m / "*.tar"))
    assert [shard_name(p) for p in plain] == ["00000", "00001"]
    assert [r.key for r in iter_shard_records(plain[0])] == ["000000000", "000000001"]


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([("cc-3m", "{a}")], "source name 'cc-3m' must be an identifier"),
        ([("3m", "{a}")], "source name '3m' must be an identifier"),
        ([("x", "{a}"), ("x", "{b}")], "source name 'x' must be an identifier .* one source"),
        ([("x", "{a}"), ("y", "{a}")], "is in source 'x' and in source 'y'"),
        ([("x", "{a}"), ("y", "{b}/nothing*.tar")], "source 'y': no shards match"),
    ],
)
def test_bad_sources_are_refused_in_one_sentence(two_downloads, sources, message):
    cc3m, cc12m = two_downloads
    given = [(n, s.format(a=f"{cc3m}/*.tar", b=cc12m)) for n, s in sources]
    with pytest.raises(ShardPatternError, match=message):
        expand_sources(given)


def _job(tmp_path: Path, input_yaml: str):
    path = tmp_path / "job.yaml"
    path.write_text(
        f"name: j\ninput: {input_yaml}\noutput: {tmp_path}/run\nmodel: {{name: ncl-tiny}}\n"
        "embed: {decode: cpu}\n"
    )
    return load_job(path)


def test_the_config_takes_exactly_one_of_shards_and_sources(tmp_path):
    both = "{shards: a.tar, sources: [{name: x, shards: b.tar}]}"
    for bad in (both, "{}", "{sources: []}"):
        with pytest.raises(JobConfigError, match="input"):
            _job(tmp_path, bad)
    job = _job(tmp_path, "{sources: [{name: x, shards: b.tar}, {name: y, shards: [c.tar]}]}")
    assert job.input.shard_specs() == [("x", "b.tar"), ("y", ["c.tar"])]


def test_sources_are_part_of_the_stage_keys_and_input_shards_keys_are_unchanged(tmp_path):
    plain = _job(tmp_path, "{shards: a.tar}")
    assert all("input.sources" not in stage_config(plain, k) for k in ("embed", "keys"))
    assert stage_config(plain, "keys") == {}  # as before sources existed
    named = _job(tmp_path, "{sources: [{name: x, shards: a.tar}, {name: y, shards: b.tar}]}")
    renamed = _job(tmp_path, "{sources: [{name: x, shards: a.tar}, {name: z, shards: b.tar}]}")
    moved = _job(tmp_path, "{sources: [{name: x, shards: /m/a.tar}, {name: y, shards: b.tar}]}")
    assert stage_config(named, "embed")["input.sources"] == ["x", "y"]
    assert stage_config(named, "embed") != stage_config(renamed, "embed")
    assert stage_config(named, "keys") != stage_config(renamed, "keys")
    # Paths are not results (as under input.shards): moving a download keeps the keys.
    assert stage_config(named, "embed") == stage_config(moved, "embed")


# --------------------------------------------------------------------------- one real run

JOB = """
name: sources
input:
  sources:
    - {{name: cc3m, shards: "{a}/{{00000..00001}}.tar"}}
    - {{name: cc12m, shards: "{b}/*.tar"}}
output: {output}
model: {{name: ncl-tiny, pretrained: null}}
embed: {{batch_size: 16, gpus_per_worker: 0, cpus_per_worker: 1, decode_threads: 1, concurrency: 1}}
mixture: {{kind: gmm}}
labels: {{method: bicro}}
index: {{factory: Flat, shards: 1}}
train: {{rounds: 0, warmup_epochs: 0, torch_threads: 1}}
seed: 3
"""


def _tar_members(path: Path) -> dict[str, dict[str, bytes]]:
    """{key: {extension: bytes}} of a tar, in the reader's sense of keys."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for info in tar.getmembers():
            key, ext = info.name.rsplit(".", 1)
            out.setdefault(key, {})[ext] = tar.extractfile(info).read()
    return out


@pytest.mark.ray
def test_two_colliding_downloads_run_through_labels_and_export(local_ray, tmp_path):
    import pyarrow.parquet as pq

    from pipeline.clients.read import read_labels
    from pipeline.data.synthetic import make_corpus
    from pipeline.run.runner import run_job
    from pipeline.stages.export.driver import ExportSpec, export_run

    a, b = tmp_path / "cc3m", tmp_path / "cc12m"
    for folder, seed in ((a, 1), (b, 2)):
        make_corpus(
            folder, samples=48, samples_per_shard=24, test_samples=0, image_size=32, seed=seed
        )
    originals = {
        (source, shard): _tar_members(folder / f"{shard}.tar")
        for source, folder in (("cc3m", a), ("cc12m", b))
        for shard in ("00000", "00001")
    }
    assert originals["cc3m", "00000"].keys() == originals["cc12m", "00000"].keys()  # collide
    # The second download also holds the first's pair 000000005, under a key of its own.
    copied = originals["cc3m", "00000"]["000000005"]
    write_tar(str(b / "00002.tar"), [(f"copy0005.{e}", data) for e, data in copied.items()])

    job_file = tmp_path / "job.yaml"
    job_file.write_text(JOB.format(a=a, b=b, output=tmp_path / "run"))
    metrics = run_job(load_job(job_file))
    assert metrics["rounds"]["0"]["keys"]["duplicates"] == 0  # the same keys, other sources
    assert metrics["rounds"]["0"]["keys"]["pairs_by_shard"] == {"cc12m-00002": 1}

    labels = read_labels(tmp_path / "run").to_table().to_pylist()
    keys = [row["key"] for row in labels]
    want = {
        f"{source}/{key}": shard
        for (source, shard), members in originals.items()
        for key in members
    }
    assert sorted(keys) == sorted(want)  # every pair once; the copy is not labelled
    for row in labels:
        source = row["key"].split("/")[0]
        assert row["shard"] == f"{source}-{want[row['key']]}"
        assert row["uid"] == uid_of(row["key"])
    quarantine = pq.read_table(tmp_path / "run" / "quarantine" / "cc12m-00002.parquet")
    assert quarantine.column("key").to_pylist() == ["cc12m/copy0005"]
    assert quarantine.column("reason").to_pylist() == ["duplicate_pair"]
    assert "cc3m-00000" in quarantine.column("detail")[0].as_py()

    # webdataset over one source's original tars, with that source's labels.
    import webdataset as wds

    from pipeline.clients.loaders import LabelSelect

    select = LabelSelect(tmp_path / "run", min_label=0.5, source="cc12m")
    urls = [str(b / f"{shard}.tar") for shard in ("00000", "00001")]
    picked = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False).select(select)]
    labels_by_key = {row["key"]: row["soft_label"] for row in labels}
    assert sorted(f"cc12m/{k}" for k in picked) == sorted(
        k for k, v in labels_by_key.items() if k.startswith("cc12m/") and v >= 0.5
    )

    out = tmp_path / "export"
    summary = export_run(ExportSpec(run=str(tmp_path / "run"), out=str(out), min_label=0.5))
    kept = {
        row["key"]
        for row in labels
        if row["soft_label"] >= 0.5 and row["subset"] in ("clean", "quasi_clean")
    }
    assert 0 < len(kept) < len(labels) and summary["kept"] == len(kept)
    exported: dict[str, dict[str, bytes]] = {}
    for tar in sorted(out.glob("*.tar")):
        exported.update(_tar_members(tar))
    assert set(exported) == kept
    for key, members in exported.items():
        source, raw = key.split("/")
        original = originals[source, want[key]][raw]
        assert members["jpg"] == original["jpg"] and members["txt"] == original["txt"]
        assert json.loads(members["json"])["key"] == key  # img2dataset's own key was `raw`
