"""The label pass: distributed order statistics vs the core partitions, and the pass on Ray.

Ray tests run on synthetic embeddings tables (clustered blobs, 30 % shuffled captions, losses
from `pipeline.core.losses`), so label quality is meaningful without a trained model; the
end-to-end embed -> label test on the demo corpus is in test_labels_reader.py.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from label_fixtures import write_blob_run

from pipeline.core.partition import rcr_candidates, select_anchors, split_clean, split_sps
from pipeline.core.soft_labels import bicro_global_anchors, rcr_global
from pipeline.io.labels import LABELS_SCHEMA, labels_json_schema
from pipeline.labels import read_labels
from pipeline.stages.labels import (
    BicroParams,
    LabelSpec,
    RcrParams,
    SpsParams,
    _decide,
    _key_value,
    _masks,
    _order_keys,
    _partition_counts,
    _radix_select,
    _Scalars,
    _select_round,
    _selection_rows,
    run_label_pass,
)

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# Pure: order keys, radix select, global decisions == the in-memory core partitions
# ---------------------------------------------------------------------------------------------


def test_order_keys_sort_like_floats():
    values = np.array([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 0.5, 2.0, np.inf], np.float32)
    keys = _order_keys(values)
    assert np.all(np.diff(keys.astype(np.int64)) >= 0)
    assert keys[3] == keys[4]  # -0.0 and 0.0 are the same value
    assert [_key_value(int(k)) for k in keys] == [float(v) for v in values + np.float32(0)]


def _local_rounds(parts):
    """run_round over in-memory shards: [(keys, ids), ...]."""

    def run_round(prefix, fetch):
        return [_select_round(keys, ids, prefix, fetch) for keys, ids in parts]

    return run_round


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fetch_limit", [1, 7, 10**6])
def test_radix_select_matches_sorting(seed, fetch_limit):
    rng = np.random.default_rng(seed)
    n = 300
    values = np.round(rng.normal(size=n), 1).astype(np.float32)  # many ties
    values[rng.choice(n, 5, replace=False)] = -0.0
    ids = rng.permutation(n).astype(np.int64) * 7919 + 2**40  # wide ids: all 6 digits used
    keys = _order_keys(values)
    bounds = [0, 50, 50, 220, n]  # one empty shard
    parts = [(keys[a:b], ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    order = np.lexsort((ids, keys))
    for k in (1, 2, 17, n // 2, n):
        key, sample, n_le = _radix_select(
            _local_rounds(parts), k, n, with_id=True, fetch_limit=fetch_limit
        )
        assert (key, sample, n_le) == (int(keys[order[k - 1]]), int(ids[order[k - 1]]), k)
        key, sample, n_le = _radix_select(
            _local_rounds(parts), k, n, with_id=False, fetch_limit=fetch_limit
        )
        assert sample is None and key == int(keys[order[k - 1]])
        assert n_le == int((keys <= keys[order[k - 1]]).sum())


def _shards_of(prob, loss, alpha_i2t, alpha_t2i, bounds):
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        out.append(
            _Scalars(
                ids=np.arange(a, b, dtype=np.int64),
                loss=loss[a:b],
                loss_i2t=loss[a:b],
                loss_t2i=loss[a:b],
                prob=prob[a:b],
                alpha_i2t=alpha_i2t[a:b],
                alpha_t2i=alpha_t2i[a:b],
            )
        )
    return out


def _local_decide(spec, shards, fetch_limit):
    counts = [_partition_counts(spec, s) for s in shards]
    count = {key: sum(c[key] for c in counts) for key in counts[0]}

    def select(what, k, in_play, decisions=None, with_id=True):
        parts = [_selection_rows(spec, s, what, decisions) for s in shards]
        return _radix_select(
            _local_rounds(parts), k, in_play, with_id=with_id, fetch_limit=fetch_limit
        )

    decisions, partition = _decide(spec, count, select)
    masks = [_masks(spec, s, decisions) for s in shards]
    return partition, {name: np.concatenate([m[name] for m in masks]) for name in masks[0]}


@pytest.mark.parametrize("case", ["mixed", "all_clean", "none_clean"])
@pytest.mark.parametrize("fetch_limit", [1, 10**6])
def test_global_decisions_equal_core_partitions(case, fetch_limit):
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    n = 700
    loss = np.round(rng.gamma(2.0, 1.0, n), 1).astype(np.float32)  # tied losses
    low, high = {"mixed": (0.0, 1.0), "all_clean": (0.995, 1.0), "none_clean": (0.0, 0.3)}[case]
    prob = rng.uniform(low, high, n).astype(np.float32)
    prob[rng.choice(n, 20, replace=False)] = np.float32(high)  # tied probabilities
    prob[rng.choice(n, 9, replace=False)] = np.nan  # NaN losses upstream
    loss[np.isnan(prob)] = np.nan
    alpha_i2t = rng.uniform(low, high, n).astype(np.float32)
    alpha_t2i = rng.uniform(low, high, n).astype(np.float32)
    alpha_i2t[np.isnan(prob)] = np.nan
    shards = _shards_of(prob, loss, alpha_i2t, alpha_t2i, [0, 100, 100, 450, n])
    spec = LabelSpec(
        output="unused",
        round_index=0,
        view="a",
        shards=("x",),
        out_dir="unused",
        method="bicro",
        bicro=BicroParams(anchor_fraction=0.13),
        sps=SpsParams(eps1=0.998, eps2=0.5),
        rcr=RcrParams(delta=0.5),
    )

    partition, masks = _local_decide(spec, shards, fetch_limit)
    clean, flags = split_clean(prob, 0.5, losses=loss)
    np.testing.assert_array_equal(masks["clean"], clean)
    assert partition["clean_split"] == flags.to_dict()
    anchors = select_anchors(clean, loss, 0.13)
    np.testing.assert_array_equal(np.flatnonzero(masks["anchor"]), anchors)
    assert partition["anchors"]["n_anchors"] == anchors.size

    sps_spec = LabelSpec(**{**spec.__dict__, "method": "sps"})
    partition, masks = _local_decide(sps_spec, shards, fetch_limit)
    codes, flags = split_sps(prob, 0.998, 0.5)
    np.testing.assert_array_equal(masks["sps"], codes)
    extra = ("eps1", "n_reliable", "no_reliable_set")
    assert {k: v for k, v in partition["sps_split"].items() if k not in extra} == flags.to_dict()
    assert partition["sps_split"]["n_reliable"] == int((codes == 0).sum())

    rcr_spec = LabelSpec(**{**spec.__dict__, "method": "rcr"})
    partition, masks = _local_decide(rcr_spec, shards, fetch_limit)
    in_c, flags = rcr_candidates(alpha_i2t, alpha_t2i, 0.5)
    np.testing.assert_array_equal(masks["in_c"], in_c)
    assert partition["rcr_candidates"] == flags.to_dict()


# ---------------------------------------------------------------------------------------------
# On Ray, over synthetic embeddings
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blob_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("blobs")
    info = write_blob_run(root / "run", n=800, shards=4, noise=0.3, partial=0.1, seed=0)
    info["output"] = str(root / "run")
    return info


def _spec(info: dict, out_dir: str, **overrides) -> LabelSpec:
    options = dict(
        output=info["output"],
        round_index=0,
        view="a",
        shards=tuple(info["shards"]),
        out_dir=out_dir,
        ground_truth=info["ground_truth"],
        job_hash="test",
        seed=0,
        query_batch=64,  # several batches per shard
    )
    options.update(overrides)
    return LabelSpec(**options)


def _table(folder: str):
    return read_labels(folder).to_table().sort_by("key")


@pytest.fixture(scope="module")
def blob_labels(local_ray, blob_run, tmp_path_factory) -> dict:
    """Every method once on the blobs (index.shards=1); outputs by method."""
    out = {}
    root = tmp_path_factory.mktemp("labels")
    for method in ("bicro", "rcr", "sps", "cosine"):
        spec = _spec(blob_run, str(root / method), method=method)
        out[method] = {"spec": spec, "summary": run_label_pass(spec, log=lambda _: None)}
    return out


@pytest.mark.ray
def test_labels_table_schema_and_metadata(blob_run, blob_labels):
    for method, run in blob_labels.items():
        spec = run["spec"]
        for shard in blob_run["shards"]:
            path = f"{spec.out_dir}/{shard}.parquet"
            schema = pq.read_schema(path)
            assert schema.remove_metadata() == LABELS_SCHEMA.remove_metadata()
            meta = {k.decode(): v.decode() for k, v in schema.metadata.items()}
            assert meta["ncl.schema"] == "labels.v1" and meta["ncl.job_hash"] == "test"
            assert meta["ncl.model_id"] == "blobs" and meta["ncl.method"] == method
            assert meta["ncl.pipeline_version"]
            fits = json.loads(meta["ncl.mixture"])["fits"]
            assert {"bmm", "gmm", "gmm_i2t", "gmm_t2i"} <= set(fits)
        table = _table(spec.out_dir)
        assert table.num_rows == 800
        assert table.column("key").to_pylist() == sorted(blob_run["keys"].tolist())
        soft = table.column("soft_label").to_numpy()
        assert soft.dtype == np.float32 and np.all((soft >= 0) & (soft <= 1))
        assert table.column("soft_label").null_count == 0
        assert set(table.column("subset").to_pylist()) <= {"clean", "quasi_clean", "noisy"}
        for column in ("bicro", "rcr", "sps"):
            filled = table.column(column).null_count == 0
            assert filled == (column == method), (method, column)
        assert set(table.column("round").to_pylist()) == {0}
        mixture = json.loads(Path(blob_run["output"], "rounds/0/mixture_a.json").read_text())
        assert mixture["kind"] == "bmm" and mixture["loss"] == "infonce_sum"


@pytest.mark.ray
def test_label_quality_beats_thresholds(blob_labels):
    for method in ("bicro", "rcr", "sps"):
        quality = blob_labels[method]["summary"]["quality"]
        auroc = quality[method]["auroc"]
        assert auroc >= 0.95, (method, auroc)
        assert auroc >= quality["cosine"]["auroc"] - 0.03, (method, quality)
        assert quality[method]["precision"] >= 0.7 and quality[method]["recall"] >= 0.9
        for baseline in ("cosine", "bmm_posterior", "gmm_posterior"):
            assert quality[baseline]["auroc"] is not None


@pytest.mark.ray
def test_bicro_and_rcr_equal_the_in_memory_core(blob_run, blob_labels):
    bicro = _table(blob_labels["bicro"]["spec"].out_dir)
    rcr = _table(blob_labels["rcr"]["spec"].out_dir)
    # The stored fp16 embeddings, renormalised as the pass reads them.
    u = _unit16(blob_run["u"])
    v = _unit16(blob_run["v"])
    loss = bicro.column("loss").to_numpy()
    prob = bicro.column("clean_prob").to_numpy()
    clean, _ = split_clean(prob, 0.5, losses=loss)
    subset = np.array(bicro.column("subset").to_pylist())
    np.testing.assert_array_equal(subset == "clean", clean)
    core = bicro_global_anchors(u, v, loss, clean, fraction=0.1)
    np.testing.assert_array_equal(bicro.column("bicro").to_numpy(), core["bicro"])
    np.testing.assert_array_equal(bicro.column("soft_label").to_numpy(), core["bicro_star"])
    keys = bicro.column("key").to_numpy(False)
    named = bicro.column("image_anchor_key").to_numpy(False)
    has = core["image_anchor"] >= 0
    assert np.all(named[has] == keys[core["image_anchor"][has]])
    assert np.all(named[~has] == None)  # noqa: E711 - anchors name no anchor

    weights = rcr_global(u, v, k=10)["w"]
    np.testing.assert_allclose(rcr.column("rcr").to_numpy(), weights, atol=1e-6)


def _unit16(x: np.ndarray) -> np.ndarray:
    rows = x.astype(np.float16).astype(np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.ray
def test_sps_proxies_and_anchor_keys(blob_run, blob_labels):
    spec = blob_labels["sps"]["spec"]
    table = _table(spec.out_dir)
    subset = np.array(table.column("subset").to_pylist())
    soft = table.column("soft_label").to_numpy()
    prob = table.column("clean_prob").to_numpy()
    assert np.all(soft[subset == "clean"] == 1.0) and np.all(soft[subset == "noisy"] == 0.0)
    quasi = subset == "quasi_clean"
    assert np.all(soft[quasi] >= prob[quasi] - 1e-6)
    proxies = pq.read_table(Path(spec.output, "rounds/0/sps_proxies_a")).sort_by("key")
    noisy_keys = table.column("key").to_numpy(False)[subset == "noisy"]
    assert proxies.column("key").to_pylist() == noisy_keys.tolist()
    reliable = set(table.column("key").to_numpy(False)[subset == "clean"])
    assert set(proxies.column("image_proxy_key").to_pylist()) <= reliable
    y = proxies.column("y_p_img").to_numpy()
    assert np.all((y == 0) | (y >= 0.5)) and np.all(y <= 1)


@pytest.mark.ray
def test_sharded_index_gives_identical_labels(blob_run, blob_labels, tmp_path):
    """index.shards=2 (and a radix select run to its last digit) == one shard, bit for bit;
    an IVF index probing every list is exact after re-scoring, with codebooks trained once."""
    reference = _table(blob_labels["bicro"]["spec"].out_dir)
    spec = _spec(
        blob_run,
        str(tmp_path / "bicro"),
        method="bicro",
        index_shards=2,
        select_fetch_limit=1,
        query_batch=1000,
        ground_truth=None,
    )
    run_label_pass(spec, log=lambda _: None)
    assert _table(spec.out_dir).equals(reference)

    reference = _table(blob_labels["rcr"]["spec"].out_dir)
    ivf = _spec(
        blob_run,
        str(tmp_path / "rcr"),
        method="rcr",
        index_factory="IVF4,Flat",
        index_shards=2,
        nprobe=4,
        ground_truth=None,
    )
    summary = run_label_pass(ivf, log=lambda _: None)
    assert summary["index"]["factory"] == "IVF4,Flat" and summary["index"]["rows"] == 800
    table = _table(ivf.out_dir)
    for name in ("rcr", "soft_label"):
        np.testing.assert_allclose(table[name].to_numpy(), reference[name].to_numpy(), atol=1e-6)
    assert table.drop(["rcr", "soft_label"]).equals(reference.drop(["rcr", "soft_label"]))


@pytest.mark.ray
def test_rerun_is_deterministic_and_skips_when_complete(blob_run, blob_labels, tmp_path):
    first = blob_labels["sps"]
    again = _spec(blob_run, str(tmp_path / "again"), method="sps", ground_truth=None)
    run_label_pass(again, log=lambda _: None)
    assert _table(again.out_dir).equals(_table(first["spec"].out_dir))
    lines = []
    summary = run_label_pass(first["spec"], log=lines.append)
    assert summary["skipped"] and any("already complete" in line for line in lines)
    assert summary["subsets"] == first["summary"]["subsets"]


@pytest.mark.ray
def test_in_batch_anchors(blob_run, blob_labels, tmp_path):
    spec = _spec(
        blob_run,
        str(tmp_path / "in_batch"),
        method="bicro",
        bicro=BicroParams(anchors="in_batch", batch_size=64),
    )
    summary = run_label_pass(spec, log=lambda _: None)
    assert summary["index"]["role"] is None
    # The released per-batch anchors: usable, but the global anchors are better (the ablation).
    in_batch = summary["quality"]["bicro"]["auroc"]
    assert 0.8 <= in_batch <= blob_labels["bicro"]["summary"]["quality"]["bicro"]["auroc"]
    table = _table(spec.out_dir)
    assert table["image_anchor_key"].null_count == table.num_rows


def test_label_spec_validation():
    with pytest.raises(ValueError, match="eps1 > eps2"):
        LabelSpec("o", 0, "a", ("x",), "d", sps=SpsParams(eps1=0.4, eps2=0.5))
    with pytest.raises(ValueError, match="method"):
        LabelSpec("o", 0, "a", ("x",), "d", method="ncr")
    with pytest.raises(ValueError, match="at least one shard"):
        LabelSpec("o", 0, "a", (), "d")


def test_committed_labels_schema_is_current():
    committed = json.loads((ROOT / "schemas" / "labels.v1.json").read_text())
    assert committed == labels_json_schema()
    assert [c["name"] for c in committed["columns"]] == LABELS_SCHEMA.names
    assert committed["file_metadata"]["ncl.schema"] == "labels.v1"
