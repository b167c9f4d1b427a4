"""`ncl-pipeline export` read back by the real clients: webdataset, numpy, DuckDB, open_clip.

Fast tests use label tables made from a synthetic corpus's ground truth (real tars, no model);
the `slow` ones export a run of the real pipeline and train open_clip on the exported shards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from export_fixtures import truth_labelled_corpus

from pipeline.clients.read import labels_folder
from pipeline.stages.export.driver import ExportConflictError, ExportSpec, export_run

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
MIN_LABEL = 0.4
SUBSETS = ("clean", "quasi_clean")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    return truth_labelled_corpus(tmp_path_factory.mktemp("export_corpus"))


def _kept(labels, min_label=MIN_LABEL, subsets=SUBSETS) -> dict[str, dict]:
    """{key: row} of the rows an export must keep, computed in plain Python."""
    rows = labels.to_pylist()
    return {r["key"]: r for r in rows if r["soft_label"] >= min_label and r["subset"] in subsets}


def _input_members(corpus: Path) -> dict[str, dict[str, bytes]]:
    """{key: {ext: bytes}} of every input tar, read with the standard library."""
    members: dict[str, dict[str, bytes]] = {}
    for path in sorted(corpus.glob("*.tar")):
        with tarfile.open(path) as tar:
            for info in tar.getmembers():
                key, ext = info.name.split(".", 1)
                members.setdefault(key, {})[ext] = tar.extractfile(info).read()
    return members


def _read_wds(out: Path) -> list[dict]:
    import webdataset as wds

    sizes = json.loads((out / "sizes.json").read_text())
    urls = [str(out / name) for name in sorted(sizes)]
    return list(wds.WebDataset(urls, shardshuffle=False))


def _duckdb_row(sql: str) -> tuple:
    import duckdb

    with duckdb.connect() as connection:  # in-memory
        (row,) = connection.execute(sql).fetchall()
    return row


def _export(corpus: dict, out: Path, **options) -> dict:
    options = {"min_label": MIN_LABEL, "subsets": SUBSETS, **options}
    return export_run(ExportSpec(run=str(corpus["run"]), out=str(out), **options))


def test_webdataset_reads_exactly_the_kept_pairs_byte_identical(local_ray, corpus, tmp_path):
    out = tmp_path / "wds"
    summary = _export(corpus, out, samples_per_shard=37)  # shards straddle input shards
    kept = _kept(corpus["labels"])
    assert 0 < len(kept) < corpus["labels"].num_rows  # the filter drops something
    samples = _read_wds(out)
    keys = [s["__key__"] for s in samples]
    assert len(keys) == len(set(keys)) == len(kept) == summary["kept"]
    assert set(keys) == set(kept)
    inputs = _input_members(corpus["corpus"])
    for sample in samples:
        source = inputs[sample["__key__"]]
        assert sample["jpg"] == source["jpg"]  # no re-encoding
        assert sample["txt"] == source["txt"]
        meta, original = json.loads(sample["json"]), json.loads(source["json"])
        row = kept[sample["__key__"]]
        assert {k: meta[k] for k in original} == original  # input fields kept as they were
        assert np.float32(meta["ncl_soft_label"]) == np.float32(row["soft_label"])
        assert (meta["ncl_subset"], meta["ncl_round"]) == (row["subset"], row["round"])
        assert meta["uid"] == row["uid"]
    # Resharded: full shards of 37 then the rest, named in order, with the readers' files.
    sizes = json.loads((out / "sizes.json").read_text())
    counts = [sizes[name] for name in sorted(sizes)]
    assert counts[:-1] == [37] * (len(counts) - 1) and 0 < counts[-1] <= 37
    assert sorted(sizes) == [f"{i:05d}.tar" for i in range(len(sizes))]
    for name, count in sizes.items():
        stats = json.loads((out / name.replace(".tar", "_stats.json")).read_text())
        assert stats["successes"] == stats["count"] == count
    assert not (out / "_parts").exists()
    # open_clip's trainer sizes an epoch from sizes.json; its own reader agrees.
    from open_clip_train.data import get_dataset_size

    assert get_dataset_size(summary["pattern"]) == (len(kept), len(sizes))
    assert summary["subsets"]["noisy"] == 0
    assert summary["subsets"]["clean"] == sum(r["subset"] == "clean" for r in kept.values())


def test_uid_file_is_a_sorted_u8u8_array_and_repeats_by_label(local_ray, corpus, tmp_path):
    labels = corpus["labels"]
    kept = _kept(labels)
    plain = _export(corpus, tmp_path / "plain", format="uid")
    array = np.load(tmp_path / "plain" / "uids.npy")
    assert array.dtype == np.dtype("u8,u8") and array.shape == (len(kept),) == (plain["kept"],)
    assert array.tolist() == sorted(array.tolist())  # sorted as DataComp's searchsorted needs
    hexes = {f"{int(hi):016x}{int(lo):016x}" for hi, lo in array.tolist()}
    assert hexes == {row["uid"] for row in kept.values()}

    everything = ("clean", "quasi_clean", "noisy")
    rows = _kept(labels, 0.0, everything)
    repeat = 3.0
    summary = _export(
        corpus, tmp_path / "r", format="uid", min_label=0.0, subsets=everything,
        repeat_by_label=repeat, seed=5,
    )  # fmt: skip
    repeated = np.load(tmp_path / "r" / "uids.npy")
    assert repeated.dtype == np.dtype("u8,u8")
    assert repeated.tolist() == sorted(repeated.tolist())
    assert len(repeated) == summary["entries"]
    counts = {}
    for row in rows.values():  # how many times DataComp's resharder would write each uid
        u = np.array([divmod(int(row["uid"], 16), 2**64)], dtype="u8,u8")[0]
        found = np.searchsorted(repeated, u, "right") - np.searchsorted(repeated, u, "left")
        expected = repeat * np.float64(row["soft_label"])
        assert np.floor(expected) <= found <= np.ceil(expected), row["key"]
        counts[row["key"]] = (int(found), expected)
    assert sum(c for c, _ in counts.values()) == len(repeated)
    # Stochastic rounding: the total is R·Σlabel up to the binomial spread of the fractions.
    total_expected = sum(e for _, e in counts.values())
    assert abs(len(repeated) - total_expected) <= 4 * np.sqrt(len(rows) / 4) + 1
    assert any(c == 0 for c, _ in counts.values())  # mismatched pairs drop out
    again = _export(
        corpus, tmp_path / "r2", format="uid", min_label=0.0, subsets=everything,
        repeat_by_label=repeat, seed=5,
    )  # fmt: skip
    assert again["entries"] == summary["entries"]
    assert np.array_equal(np.load(tmp_path / "r2" / "uids.npy"), repeated)  # seeded


def test_duckdb_filtered_count_equals_the_exported_count(local_ray, corpus, tmp_path):
    summary = _export(corpus, tmp_path / "keys", format="keys")
    labels = f"{labels_folder(corpus['run'])[1]}/*.parquet"
    (count,) = _duckdb_row(
        f"SELECT count(*) FROM read_parquet('{labels}') "
        f"WHERE soft_label >= {MIN_LABEL} AND subset IN ('clean', 'quasi_clean')"
    )
    assert count == summary["kept"] == len(_kept(corpus["labels"]))
    keys = tmp_path / "keys" / "keys.parquet"
    (listed, distinct) = _duckdb_row(
        f"SELECT count(*), count(DISTINCT key) FROM read_parquet('{keys}')"
    )
    assert listed == distinct == count


def test_nonempty_out_is_refused_unless_overwrite(local_ray, corpus, tmp_path):
    out = tmp_path / "out"
    first = _export(corpus, out, samples_per_shard=50)
    assert _export(corpus, out, samples_per_shard=50)["skipped"]  # same export: nothing to do
    with pytest.raises(ExportConflictError, match="--overwrite"):
        _export(corpus, out, samples_per_shard=20)
    second = _export(corpus, out, samples_per_shard=20, overwrite=True)
    assert second["kept"] == first["kept"] and second["shards"] > first["shards"]
    assert len(_read_wds(out)) == first["kept"]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportConflictError, match="did not write"):
        _export(corpus, out, samples_per_shard=50, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.slow  # starts a second local Ray in the killed CLI (~1 min on 2 cores)
def test_a_killed_export_rerun_leaves_every_kept_key_once(local_ray, corpus, tmp_path):
    """SIGKILL the CLI (its own local Ray) mid-export, rerun, compare with a clean export."""
    out = tmp_path / "killed"
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable, "-m", "pipeline", "export", str(corpus["run"]), "--out", str(out),
        "--min-label", str(MIN_LABEL), "--subset", ",".join(SUBSETS),
        "--samples-per-shard", "37",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    parts = out / "_parts"
    deadline = time.monotonic() + 120
    try:
        # Kill as soon as the first part is being written: phase 1 has begun, nothing is done.
        while not (parts.is_dir() and any(parts.iterdir())):
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "the export never started writing parts"
            time.sleep(0.002)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the CLI and the Ray it started
        process.wait()
    assert not (out / "_export.json").exists(), "the export finished before the kill"
    assert any((out / "_parts").iterdir())

    summary = _export(corpus, out, samples_per_shard=37)  # resumes: same run, same options
    assert summary["skipped"] is False
    keys = [s["__key__"] for s in _read_wds(out)]
    assert len(keys) == len(set(keys)) == len(_kept(corpus["labels"]))
    clean = tmp_path / "uninterrupted"
    _export(corpus, clean, samples_per_shard=37)
    tars = sorted(p.name for p in clean.glob("*.tar"))
    assert tars == sorted(p.name for p in out.glob("*.tar"))
    for name in tars:  # deterministic plan: the resumed shards are the same bytes
        assert (out / name).read_bytes() == (clean / name).read_bytes()
    assert not list(out.rglob("*.tmp-*"))


# ------------------------------------------------------------------------ the real pipeline


@pytest.fixture(scope="module")
def real_run(pipeline_run) -> dict:
    return pipeline_run


@pytest.mark.slow
def test_published_labels_carry_uid_and_image_sha256(real_run, tmp_path):
    import pyarrow.parquet as pq

    from pipeline.clients.read import read_labels
    from pipeline.io.labels import uid_of

    table = read_labels(real_run["run"]).to_table()
    truth = pq.read_table(real_run["corpus"] / "ground_truth.parquet").to_pylist()
    metas = {
        key: json.loads(members["json"])
        for key, members in _input_members(real_run["corpus"]).items()
        if "json" in members
    }
    intact = {row["key"] for row in truth if row["corrupt"] is None}
    rows = table.to_pylist()
    assert rows and all(r["uid"] == uid_of(r["key"]) for r in rows)  # the corpus has no uid
    checked = [r for r in rows if r["key"] in intact]
    assert checked and all(r["image_sha256"] == metas[r["key"]]["sha256"] for r in checked)
    meta = pq.read_schema(next(Path(labels_folder(real_run["run"])[1]).glob("*.parquet"))).metadata
    assert meta[b"ncl.schema"] == b"labels.v4"

    summary = export_run(
        ExportSpec(run=str(real_run["run"]), out=str(tmp_path / "o"), subsets=("clean", "noisy"),
                   min_label=0.3, samples_per_shard=64)
    )  # fmt: skip
    (count,) = _duckdb_row(
        f"SELECT count(*) FROM read_parquet('{labels_folder(real_run['run'])[1]}/*.parquet') "
        "WHERE soft_label >= 0.3 AND subset IN ('clean', 'noisy')"
    )
    assert count == summary["kept"] == len(_read_wds(tmp_path / "o"))


@pytest.mark.slow
def test_open_clip_trains_on_the_exported_shards(local_ray, corpus, tmp_path):
    """open_clip's own trainer (open_clip_train) on a wds export, with ncl-tiny registered."""
    out = tmp_path / "wds"
    summary = _export(corpus, out, samples_per_shard=16)
    logs = tmp_path / "logs"
    command = [
        sys.executable, "-m", "pipeline.clients.open_clip",
        "--train-data", summary["pattern"], "--dataset-type", "webdataset",
        "--model", "ncl-tiny", "--batch-size", "8", "--epochs", "1", "--workers", "1",
        "--lr", "1e-4", "--warmup", "1", "--device", "cpu", "--precision", "fp32",
        "--logs", str(logs), "--name", "export-test", "--log-every-n-steps", "1",
        "--seed", "0", "--train-num-samples", "24",  # 3 steps of 8 on CPU
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    log_file = logs / "export-test" / "out.log"
    text = log_file.read_text() if log_file.exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + text[-3000:]
    steps = [line for line in text.splitlines() if "Train Epoch: 0" in line and "Loss:" in line]
    assert len(steps) == 3 and "[24/24 (100%)]" in steps[-1], text[-3000:]
    losses = [float(line.split("Contrastive_loss: ")[1].split()[0]) for line in steps]
    assert all(np.isfinite(losses))
    assert (logs / "export-test" / "checkpoints" / "epoch_1.pt").exists()


@pytest.fixture(scope="module")
def tied(corpus, tmp_path_factory) -> dict:
    """The corpus's label tables with soft_label rounded to 0.1: many pairs tie."""
    import shutil

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    run = Path(shutil.copytree(corpus["run"], tmp_path_factory.mktemp("tied") / "run"))
    for path in sorted(Path(labels_folder(run)[1]).glob("*.parquet")):
        table = pq.read_table(path)
        rounded = pc.cast(pc.round(table.column("soft_label"), 1), pa.float32())
        table = table.set_column(table.schema.get_field_index("soft_label"), "soft_label", rounded)
        pq.write_table(table, path)
    labels = pa.concat_tables(
        pq.read_table(p) for p in sorted(Path(labels_folder(run)[1]).glob("*.parquet"))
    )
    return {"run": run, "labels": labels}


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7, 1 / 3])
def test_keep_fraction_is_exact_to_one_pair_ties_broken_by_key(local_ray, tied, tmp_path, fraction):
    rows = tied["labels"].to_pylist()
    ranked = sorted(rows, key=lambda r: (-r["soft_label"], r["key"]))
    expected = ranked[: int(np.floor(fraction * len(rows) + 0.5))]
    assert len({r["soft_label"] for r in rows}) < 12  # ties at the cut
    spec = ExportSpec(run=str(tied["run"]), out=str(tmp_path / "uid"), format="uid",
                      keep_fraction=fraction)  # fmt: skip
    summary = export_run(spec)
    assert summary["kept"] == len(expected)
    array = np.load(tmp_path / "uid" / "uids.npy")
    hexes = {f"{int(hi):016x}{int(lo):016x}" for hi, lo in array.tolist()}
    assert hexes == {r["uid"] for r in expected}
    assert summary["cut"]["key"] == expected[-1]["key"]
    keys = export_run(ExportSpec(run=str(tied["run"]), out=str(tmp_path / "keys"),
                                 format="keys", keep_fraction=fraction))  # fmt: skip
    import pyarrow.parquet as pq

    written = pq.read_table(tmp_path / "keys" / "keys.parquet").column("key").to_pylist()
    assert keys["kept"] == len(expected) and set(written) == {r["key"] for r in expected}


def test_keep_fraction_by_cosine_writes_those_pairs_as_webdataset(local_ray, corpus, tmp_path):
    rows = corpus["labels"].to_pylist()
    ranked = sorted(rows, key=lambda r: (-r["cosine"], r["key"]))
    expected = {r["key"] for r in ranked[: int(np.floor(0.5 * len(rows) + 0.5))]}
    spec = ExportSpec(run=str(corpus["run"]), out=str(tmp_path / "wds"), keep_fraction=0.5,
                      rank_by="cosine")  # fmt: skip
    assert export_run(spec)["kept"] == len(expected)
    assert {sample["__key__"] for sample in _read_wds(tmp_path / "wds")} == expected


@pytest.mark.parametrize("fraction", [0.3, 0.7])
def test_keep_fraction_by_fusion_keeps_the_best_mean_rank_in_every_format(
    local_ray, tied, tmp_path, fraction
):
    from scipy.stats import rankdata

    rows = tied["labels"].to_pylist()
    # brute force: the sum of the two mean ranks (exact half-integers), larger first, then key
    fused = rankdata([r["soft_label"] for r in rows]) + rankdata([r["cosine"] for r in rows])
    ranked = sorted(zip(fused, rows, strict=True), key=lambda t: (-t[0], t[1]["key"]))
    expected = [r["key"] for _, r in ranked[: int(np.floor(fraction * len(rows) + 0.5))]]
    assert len(set(fused)) < len(rows)  # ties at the cut are possible
    common = {"run": str(tied["run"]), "keep_fraction": fraction, "rank_by": "fusion"}
    summary = export_run(ExportSpec(out=str(tmp_path / "keys"), format="keys", **common))
    import pyarrow.parquet as pq

    written = pq.read_table(tmp_path / "keys" / "keys.parquet").column("key").to_pylist()
    assert summary["kept"] == len(expected) and set(written) == set(expected)
    assert summary["cut"]["key"] == expected[-1] and summary["cut"]["rank_by"] == "fusion"
    export_run(ExportSpec(out=str(tmp_path / "wds"), **common))
    assert {sample["__key__"] for sample in _read_wds(tmp_path / "wds")} == set(expected)


def test_keep_fraction_refuses_a_threshold_beside_it():
    for options in ({"min_label": 0.5}, {"subsets": ("clean",)}):
        with pytest.raises(ValueError, match="leave out --min-label and --subset"):
            ExportSpec(run="r", out="o", keep_fraction=0.3, **options)
    with pytest.raises(ValueError, match="--rank-by applies with --keep-fraction only"):
        ExportSpec(run="r", out="o", rank_by="cosine")
    with pytest.raises(ValueError, match="--rank-by 'nope'"):
        ExportSpec(run="r", out="o", keep_fraction=0.3, rank_by="nope")
