"""The label pass on Ray: tables, quality, equality with the in-memory back-end, sharding.

Ray tests run on synthetic embeddings tables (clustered blobs, 30 % shuffled captions, losses
from `pipeline.core.losses.per_sample`), so label quality is meaningful without a trained model; the
end-to-end embed -> label test on the demo corpus is in test_labels_reader.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from label_fixtures import table_quality, truth_quality, write_blob_run

from pipeline.clients.read import read_labels
from pipeline.config import EmbedConfig, IndexConfig, LabelsConfig
from pipeline.core.labels.in_memory import label_in_memory
from pipeline.core.mixture.fit import MixtureFit, clean_posterior
from pipeline.io.labels import LABELS_SCHEMA, SPS_PROXIES_SCHEMA, labels_json_schema
from pipeline.stages.labels import LabelSpec, run_label_pass

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# On Ray, over synthetic embeddings
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blob_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("blobs")
    info = write_blob_run(root / "run", n=800, shards=4, noise=0.3, partial=0.1, seed=0)
    info["output"] = str(root / "run")
    return info


def _spec(info: dict, out_dir: str, *, labels=None, index=None, **overrides) -> LabelSpec:
    """A pass over the blob run; `labels` / `index` are config sections as dicts."""
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
        labels=LabelsConfig.model_validate(labels or {}),
        index=IndexConfig.model_validate(index or {}),
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
        spec = _spec(blob_run, str(root / method), labels={"method": method})
        out[method] = {"spec": spec, "summary": run_label_pass(spec)}
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
            assert meta["ncl.schema"] == "labels.v4" and meta["ncl.job_hash"] == "test"
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
def test_label_quality_beats_thresholds(blob_run, blob_labels):
    from pipeline.core.mixture.fit import clean_posterior

    fits = _fits(blob_run)
    for method in ("bicro", "rcr", "sps"):
        quality = blob_labels[method]["summary"]["quality"]
        auroc = quality[method]["auroc"]
        assert auroc >= 0.95, (method, auroc)
        assert auroc >= quality["cosine"]["auroc"] - 0.03, (method, quality)
        assert quality[method]["precision"] >= 0.7 and quality[method]["recall"] >= 0.9
        # The baselines the pass reports: the written table's cosine, and each mixture's
        # clean posterior of the written losses.
        table = _table(blob_labels[method]["spec"].out_dir)
        truth = blob_run["ground_truth"]
        want = table_quality(table, truth, "cosine")["auroc"]
        assert quality["cosine"]["auroc"] == pytest.approx(want), method
        loss = table.column("loss").to_numpy()
        for kind in ("bmm", "gmm"):
            posterior = clean_posterior(fits[kind], loss)
            want = truth_quality(table.column("key").to_pylist(), posterior, truth)["auroc"]
            assert quality[f"{kind}_posterior"]["auroc"] == pytest.approx(want), (method, kind)


def _fits(info: dict) -> dict[str, MixtureFit]:
    mixture = json.loads(Path(info["output"], "rounds/0/mixture_a.json").read_text())
    return {name: MixtureFit.from_dict(fit) for name, fit in mixture["fits"].items()}


@pytest.mark.ray
@pytest.mark.parametrize("method", ["bicro", "rcr", "sps", "cosine"])
def test_ray_pass_equals_the_in_memory_back_end(blob_run, blob_labels, method):
    """The same core functions over the Ray actors and over in-process index stores give the
    same labels bit for bit: one implementation, two back-ends."""
    _assert_in_memory_equal(blob_run, blob_labels[method]["spec"])


def _assert_in_memory_equal(blob_run: dict, spec: LabelSpec) -> None:
    """The pass's tables equal `label_in_memory` over the same posteriors and embeddings."""
    method = spec.labels.method
    table = _table(spec.out_dir)  # keys sort like global ids in this fixture
    u, v = _unit16(blob_run["u"]), _unit16(blob_run["v"])  # the stored fp16, renormalised
    loss = table.column("loss").to_numpy()
    fits = _fits(blob_run)
    embeddings = pq.read_table(Path(blob_run["output"], "rounds/0/embeddings")).sort_by("key")
    i2t = embeddings.column("loss_i2t_a").to_numpy()
    t2i = embeddings.column("loss_t2i_a").to_numpy()
    from pipeline.stages.labels.shard_tasks import shard_seed

    out = label_in_memory(
        method,
        spec.params,
        u=u,
        v=v,
        loss=loss,
        prob=clean_posterior(fits[spec.mixture_kind], loss),
        loss_i2t=i2t,
        loss_t2i=t2i,
        alpha_i2t=clean_posterior(fits["gmm_i2t"], i2t),
        alpha_t2i=clean_posterior(fits["gmm_t2i"], t2i),
        keys=table.column("key").to_numpy(False),
        captions=embeddings.column("caption").to_numpy(False),
        shard_sizes=[200] * 4,
        shard_seeds=[shard_seed(spec, s) for s in blob_run["shards"]],
        query_batch=64,
    )
    np.testing.assert_array_equal(table.column("soft_label").to_numpy(), out.labels.soft_label)
    subsets = np.array(["clean", "quasi_clean", "noisy"])[out.labels.subset]
    assert table.column("subset").to_pylist() == subsets.tolist()
    for name, values in out.labels.scores.items():
        np.testing.assert_array_equal(table.column(name).to_numpy(), values)
    for column in ("image_anchor_key", "text_anchor_key"):
        expected = getattr(out.labels, column)
        expected = [None] * len(u) if expected is None else expected.tolist()
        assert table.column(column).to_pylist() == expected


@pytest.mark.ray
def test_centred_bicro_equals_the_in_memory_back_end(blob_run, tmp_path):
    """labels.bicro.centre: the driver's corpus means (exact per-shard sums) and the centred
    index over two actors give the in-memory labels bit for bit."""
    spec = _spec(
        blob_run,
        str(tmp_path / "centred"),
        labels={"method": "bicro", "bicro": {"centre": True, "label": "fused"}},
        index={"shards": 2},
        ground_truth=None,
    )
    summary = run_label_pass(spec)
    assert 0 < summary["centring"]["image_mean_norm"] < 1
    _assert_in_memory_equal(blob_run, spec)


def _unit16(x: np.ndarray) -> np.ndarray:
    rows = x.astype(np.float16).astype(np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.ray
def test_sps_proxies_and_anchor_keys(blob_run, blob_labels):
    spec = blob_labels["sps"]["spec"]
    table = _table(spec.out_dir)
    # SPS partitions with the GMM (its paper and code), whatever mixture.kind says (bmm here).
    assert spec.mixture.kind == "bmm" and blob_labels["sps"]["summary"]["mixture_kind"] == "gmm"
    gmm = clean_posterior(_fits(blob_run)["gmm"], table.column("loss").to_numpy())
    np.testing.assert_array_equal(table.column("clean_prob").to_numpy(), gmm)
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
    # The proxy caption travels with the proxy key (the fixture's captions name their keys).
    named = proxies.column("image_proxy_key").to_pylist()
    assert proxies.column("image_proxy_caption").to_pylist() == [f"caption of {k}" for k in named]
    assert proxies.schema.names == SPS_PROXIES_SCHEMA.names
    y = proxies.column("y_p_img").to_numpy()
    assert np.all((y == 0) | (y >= 0.5)) and np.all(y <= 1)
    # v2: the noisy pair's own caption T_n rides along for the text-direction proxy pair
    # (Ï, T_n), and the P^ behind each label is published.
    first = next(Path(spec.output, "rounds/0/sps_proxies_a").glob("*.parquet"))
    assert pq.read_schema(first).metadata[b"ncl.schema"] == b"sps_proxies.v2"
    keys = proxies.column("key").to_pylist()
    assert proxies.column("caption").to_pylist() == [f"caption of {k}" for k in keys]
    for direction in ("img", "txt"):
        p_hat = proxies.column(f"p_hat_{direction}").to_numpy()
        s = proxies.column(f"s_{direction}").to_numpy()
        label = proxies.column(f"y_p_{direction}").to_numpy()
        assert np.all((p_hat >= 0) & (p_hat <= 1))
        trained = label > 0
        np.testing.assert_allclose(label[trained], np.clip(p_hat * s, 0, 1)[trained], rtol=1e-5)


@pytest.mark.ray
def test_sharded_index_gives_identical_labels(blob_run, blob_labels, tmp_path):
    """index.shards=2 (and a radix select run to its last digit) == one shard, bit for bit;
    an IVF index probing every list is exact after re-scoring, with codebooks trained once."""
    reference = _table(blob_labels["bicro"]["spec"].out_dir)
    spec = _spec(
        blob_run,
        str(tmp_path / "bicro"),
        labels={"method": "bicro"},
        index={"shards": 2},
        select_fetch_limit=1,
        query_batch=1000,
        ground_truth=None,
    )
    run_label_pass(spec)
    assert _table(spec.out_dir).equals(reference)

    reference = _table(blob_labels["rcr"]["spec"].out_dir)
    ivf = _spec(
        blob_run,
        str(tmp_path / "rcr"),
        labels={"method": "rcr"},
        index={"factory": "IVF4,Flat", "shards": 2, "nprobe": 4},
        ground_truth=None,
    )
    summary = run_label_pass(ivf)
    assert summary["index"]["factory"] == "IVF4,Flat" and summary["index"]["rows"] == 800
    table = _table(ivf.out_dir)
    for name in ("rcr", "soft_label"):
        np.testing.assert_allclose(table[name].to_numpy(), reference[name].to_numpy(), atol=1e-6)
    assert table.drop(["rcr", "soft_label"]).equals(reference.drop(["rcr", "soft_label"]))


@pytest.mark.ray
def test_rerun_is_deterministic(blob_run, blob_labels, tmp_path):
    first = blob_labels["sps"]
    again = _spec(blob_run, str(tmp_path / "again"), labels={"method": "sps"}, ground_truth=None)
    summary = run_label_pass(again)
    assert _table(again.out_dir).equals(_table(first["spec"].out_dir))
    assert summary["subsets"] == first["summary"]["subsets"]


@pytest.mark.ray
def test_in_batch_anchors(blob_run, blob_labels, tmp_path):
    spec = _spec(
        blob_run,
        str(tmp_path / "in_batch"),
        labels={"method": "bicro", "bicro": {"anchors": "in_batch", "batch_size": 64}},
    )
    summary = run_label_pass(spec)
    assert summary["index"]["role"] is None
    # The released per-batch anchors: usable, but the global anchors are better (the ablation).
    in_batch = summary["quality"]["bicro"]["auroc"]
    assert 0.8 <= in_batch <= blob_labels["bicro"]["summary"]["quality"]["bicro"]["auroc"]
    table = _table(spec.out_dir)
    assert table["image_anchor_key"].null_count == table.num_rows


def test_label_spec_validation():
    with pytest.raises(ValueError, match="eps1 > eps2"):
        LabelsConfig.model_validate({"sps": {"eps1": 0.4, "eps2": 0.5}})
    with pytest.raises(ValueError, match="method"):
        LabelsConfig.model_validate({"method": "ncr"})
    with pytest.raises(ValueError, match="at least one shard"):
        LabelSpec("o", 0, "a", (), "d")
    spec = LabelSpec("o", 0, "a", ("x",), "d")
    assert spec.with_labels(method="rcr").params == LabelsConfig().rcr
    with pytest.raises(ValueError, match="anchor_fraction"):
        spec.with_labels(bicro={"anchor_fraction": 0})


def test_committed_labels_schemas_are_current():
    committed = json.loads((ROOT / "schemas" / "labels.v4.json").read_text())
    assert committed == labels_json_schema()
    assert [c["name"] for c in committed["columns"]] == LABELS_SCHEMA.names
    assert committed["file_metadata"]["ncl.schema"] == "labels.v4"
    # The previous versions stay for readers of old runs: each only appended columns.
    for version in ("labels.v1", "labels.v2", "labels.v3"):
        previous = json.loads((ROOT / "schemas" / f"{version}.json").read_text())
        assert previous == labels_json_schema(version)
        names = [c["name"] for c in previous["columns"]]
        assert LABELS_SCHEMA.names[: len(names)] == names
    assert LABELS_SCHEMA.names[17:] == ["assign"]  # v3 = v2 + the assign score


# ---------------------------------------------------------------------------------------------
# Persisted indexes, RCR image de-duplication and SPS two-view labelling
# ---------------------------------------------------------------------------------------------


def _merged_top1(indexes, queries: np.ndarray) -> np.ndarray:
    """Top-1 global id over several persisted index shards (highest score, then lowest id)."""
    best_score = np.full(queries.shape[0], -np.inf)
    best_id = np.full(queries.shape[0], -1, dtype=np.int64)
    for index in indexes:
        scores, ids = index.search(queries, 1)
        better = (scores[:, 0] > best_score) | (
            (scores[:, 0] == best_score) & (ids[:, 0] < best_id)
        )
        best_score = np.where(better, scores[:, 0], best_score)
        best_id = np.where(better, ids[:, 0], best_id)
    return best_id


@pytest.mark.ray
def test_index_shards_are_persisted(local_ray, tmp_path):
    """The BiCro anchor index (two actors) lands under rounds/0/index_a/: the files answer
    global sample ids and name the same nearest anchors as the label table."""
    import faiss

    info = write_blob_run(tmp_path / "run", n=300, shards=3, seed=3)
    info["output"] = str(tmp_path / "run")
    spec = _spec(info, str(tmp_path / "labels"), labels={"method": "bicro"}, index={"shards": 2})
    summary = run_label_pass(spec)
    folder = tmp_path / "run" / "rounds" / "0" / "index_a"
    assert summary["index"]["dir"] == str(folder)
    description = json.loads((folder / "_index.json").read_text())
    assert description["role"] == "anchors" and description["shards"] == 2
    assert description["factory"] == "Flat" and description["dim"] == 32
    assert description["embedding_shards"] == info["shards"]
    assert description["files"]["image"] == ["anchors_image_000.faiss", "anchors_image_001.faiss"]
    assert sum(description["rows_per_shard"]) == summary["anchors"] > 0

    table = _table(spec.out_dir)  # keys sort like global ids in this fixture
    keys = table.column("key").to_numpy(False)
    assert keys.tolist() == info["keys"].tolist()
    for modality, vectors, column in (
        ("image", _unit16(info["u"]), "image_anchor_key"),
        ("text", _unit16(info["v"]), "text_anchor_key"),
    ):
        indexes = [faiss.read_index(str(folder / name)) for name in description["files"][modality]]
        assert [index.ntotal for index in indexes] == description["rows_per_shard"]
        for shard, index in enumerate(indexes):
            ids = faiss.vector_to_array(faiss.downcast_index(index).id_map)
            assert np.all(ids % 2 == shard)
        named = table.column(column).to_numpy(False)
        queries = np.flatnonzero(named != None)  # noqa: E711 - anchors name no anchor
        assert queries.size == 300 - summary["anchors"]
        nearest = _merged_top1(indexes, vectors[queries])
        np.testing.assert_array_equal(keys[nearest], named[queries])


def _duplicate_image_corpus(root: Path) -> list[str]:
    """Two tar shards from the synthetic corpus where image files repeat, as in F30K/COCO:
    runs of 1, 2, 3 and 5 consecutive samples share the bytes of the run's first image, and
    shard 1's first sample reuses shard 0's first image (a duplicate across shards)."""
    from shard_fixtures import write_tar

    from pipeline.data.synthetic import make_corpus
    from pipeline.io.shards import iter_shard_records

    corpus = make_corpus(
        root / "source", samples=120, samples_per_shard=60, test_samples=0, seed=7, noise=0.3
    )
    runs = [1, 2, 3, 5]
    paths, first_image = [], None
    for s, source in enumerate(corpus.shards):
        members, run, left, image = [], 0, 0, b""
        for i, record in enumerate(iter_shard_records(str(source))):
            if left == 0:
                image, left, run = record.members["jpg"], runs[run % len(runs)], run + 1
            if s == 0 and i == 0:
                first_image = image
            jpg = first_image if (s == 1 and i == 0) else image
            left -= 1
            members += [(f"{record.key}.jpg", jpg)]
            members += [(f"{record.key}.{ext}", record.members[ext]) for ext in ("txt", "json")]
        path = root / "dup" / f"{s:05d}.tar"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tar(str(path), members)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def two_view_run(local_ray, tmp_path_factory) -> dict:
    """The duplicate-image corpus embedded in one pass by two random ncl-tiny views (a, b)."""
    import pyarrow as pa

    from pipeline.io.shards import shard_name
    from pipeline.models import ModelSpec
    from pipeline.stages.embed import EmbedSpec, run_embed_pass

    root = tmp_path_factory.mktemp("two_views")
    paths = _duplicate_image_corpus(root)
    spec = EmbedSpec(
        output=str(root / "run"),
        round_index=0,
        views={"a": ModelSpec("ncl-tiny", None, seed=1), "b": ModelSpec("ncl-tiny", None, seed=2)},
        seed=0,
        embed=EmbedConfig(
            batch_size=16, decode_threads=2, concurrency=1, cpus_per_worker=1, gpus_per_worker=0
        ),
    )
    summary = run_embed_pass(spec, paths)
    assert summary["embedded"] == 120 and not summary["shards_failed"]
    shards = [shard_name(p) for p in paths]
    tables = [
        pq.read_table(Path(spec.output, "rounds", "0", "embeddings", f"{s}.parquet"))
        for s in shards
    ]
    return {
        "output": spec.output,
        "shards": shards,
        "paths": paths,
        "embeddings": pa.concat_tables(tables),  # in global-id order
    }


def _view_matrix(table, column: str) -> np.ndarray:
    rows = np.stack(table.column(column).to_numpy(zero_copy_only=False)).astype(np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def _labels_in_id_order(out_dir: str, shards: list[str]):
    import pyarrow as pa

    return pa.concat_tables([pq.read_table(f"{out_dir}/{s}.parquet") for s in shards])


@pytest.mark.ray
def test_embeddings_carry_the_image_hash(two_view_run):
    import hashlib

    from pipeline.io.shards import iter_shard_records

    expected = {}
    for path in two_view_run["paths"]:
        for record in iter_shard_records(path):
            expected[record.key] = hashlib.sha256(record.members["jpg"]).hexdigest()
    embeddings = two_view_run["embeddings"]
    hashes = embeddings.column("image_sha256").to_pylist()
    assert hashes == [expected[k] for k in embeddings.column("key").to_pylist()]
    assert 30 < len(set(hashes)) < 120  # the corpus does repeat images
    assert hashes[0] == hashes[60]  # across shards
    # Byte-identical images, identical embeddings: the copies really are one image.
    u = _view_matrix(embeddings, "image_embedding_a")
    first = {h: i for i, h in reversed(list(enumerate(hashes)))}
    np.testing.assert_array_equal(u, u[[first[h] for h in hashes]])


@pytest.mark.ray
@pytest.mark.parametrize("include_self", [True, False])
def test_rcr_ranks_unique_images(two_view_run, tmp_path, include_self):
    """Distributed RCR (two index actors) == the core with image groups from the hashes, and
    differs from ranking pair rows (the copies would fill the image lists)."""
    run = two_view_run
    spec = LabelSpec(
        output=run["output"],
        round_index=0,
        view="a",
        shards=tuple(run["shards"]),
        out_dir=str(tmp_path / "rcr"),
        labels=LabelsConfig.model_validate(
            {"method": "rcr", "rcr": {"k": 5, "include_self": include_self}}
        ),
        index=IndexConfig(shards=2),
        query_batch=16,
        job_hash="dedup",
    )
    run_label_pass(spec)
    weights = _labels_in_id_order(spec.out_dir, run["shards"]).column("rcr").to_numpy()
    embeddings = run["embeddings"]
    options = dict(
        u=_view_matrix(embeddings, "image_embedding_a"),
        v=_view_matrix(embeddings, "text_embedding_a"),
        loss=np.zeros(len(weights), np.float32),
        prob=np.ones(len(weights), np.float32),
        alpha_i2t=np.ones(len(weights), np.float32),
        alpha_t2i=np.ones(len(weights), np.float32),
    )
    hashes = embeddings.column("image_sha256").to_pylist()
    deduplicated = label_in_memory("rcr", spec.params, image_hashes=hashes, **options)
    np.testing.assert_array_equal(weights, deduplicated.labels.scores["rcr"])
    rows = label_in_memory("rcr", spec.params, **options).labels.scores["rcr"]
    assert np.abs(weights - rows).max() > 1e-3


@pytest.mark.ray
def test_sps_labels_from_the_trainee_view(two_view_run, tmp_path):
    """Partition from view a (the peer), P^ and proxies from view b (the model trained)."""
    import faiss

    from pipeline.core.labels.sps import sps_quasi_clean_label

    run = two_view_run
    common = dict(
        output=run["output"],
        round_index=0,
        view="a",
        shards=tuple(run["shards"]),
        # random models: posteriors stay below the default eps1 of 0.99
        labels=LabelsConfig.model_validate({"method": "sps", "sps": {"eps1": 0.7}}),
        query_batch=16,
        job_hash="trainee",
    )
    alone = LabelSpec(**common, out_dir=str(tmp_path / "a"), proxies_dir=str(tmp_path / "pa"))
    run_label_pass(alone)
    spec = LabelSpec(
        **common,
        out_dir=str(tmp_path / "ab"),
        proxies_dir=str(tmp_path / "pab"),
        trainee_view="b",
    )
    summary = run_label_pass(spec)
    assert summary["labelling_view"] == "b"
    one = _labels_in_id_order(alone.out_dir, run["shards"])
    two = _labels_in_id_order(spec.out_dir, run["shards"])
    for column in ("key", "subset", "clean_prob", "loss", "cosine"):
        assert two.column(column).equals(one.column(column)), column
    meta = pq.read_schema(f"{spec.out_dir}/{run['shards'][0]}.parquet").metadata
    assert meta[b"ncl.labelling_view"] == b"b" and meta[b"ncl.view"] == b"a"
    alone_meta = pq.read_schema(f"{alone.out_dir}/{run['shards'][0]}.parquet").metadata
    assert alone_meta[b"ncl.labelling_view"] == b"a"

    embeddings = run["embeddings"]
    subset = np.array(two.column("subset").to_pylist())
    prob = two.column("clean_prob").to_numpy()
    soft = two.column("soft_label").to_numpy()
    quasi, noisy, reliable = subset == "quasi_clean", subset == "noisy", subset == "clean"
    assert quasi.any() and noisy.any() and reliable.any(), summary["subsets"]
    i2t_b = embeddings.column("loss_i2t_b").to_numpy()
    t2i_b = embeddings.column("loss_t2i_b").to_numpy()
    np.testing.assert_array_equal(soft[quasi], sps_quasi_clean_label(prob, i2t_b, t2i_b)[quasi])
    i2t_a = embeddings.column("loss_i2t_a").to_numpy()
    t2i_a = embeddings.column("loss_t2i_a").to_numpy()
    assert not np.array_equal(soft[quasi], sps_quasi_clean_label(prob, i2t_a, t2i_a)[quasi])
    assert np.all(soft[reliable] == 1.0) and np.all(soft[noisy] == 0.0)

    # Noisy rows name the reliable pair nearest in view b's image space.
    keys = two.column("key").to_numpy(False)
    u_b = _view_matrix(embeddings, "image_embedding_b")
    named = two.column("image_anchor_key").to_numpy(False)
    position = {key: i for i, key in enumerate(keys)}
    chosen = np.array([position[k] for k in named[noisy]])
    scores = u_b[noisy] @ u_b[reliable].T
    np.testing.assert_allclose(
        np.sum(u_b[noisy] * u_b[chosen], axis=1), scores.max(axis=1), atol=1e-5
    )

    # The proxies carry the proxy caption: the caption of the pair named by image.
    proxies = pq.read_table(str(tmp_path / "pab")).sort_by("key")
    captions = dict(
        zip(
            embeddings.column("key").to_pylist(),
            embeddings.column("caption").to_pylist(),
            strict=True,
        )
    )
    proxy_keys = proxies.column("image_proxy_key").to_pylist()
    assert proxies.column("image_proxy_caption").to_pylist() == [captions[k] for k in proxy_keys]

    # The persisted reliable-set index is view b's, over exactly the reliable pairs.
    folder = Path(run["output"], "rounds", "0", "index_a")
    description = json.loads((folder / "_index.json").read_text())
    assert description["role"] == "reliable" and description["embeddings_view"] == "b"
    index = faiss.read_index(str(folder / description["files"]["image"][0]))
    assert index.ntotal == int(reliable.sum()) == summary["partition"]["sps_split"]["n_reliable"]
    top = _merged_top1([index], u_b[noisy])
    np.testing.assert_array_equal(keys[top], named[noisy])


# ---------------------------------------------------------------------------------------------
# labels.loss_negatives: competitors (docs/methods.md §1.7)
# ---------------------------------------------------------------------------------------------


def test_competitor_negatives_need_the_infonce_loss():
    with pytest.raises(ValueError, match="loss_negatives"):
        LabelsConfig.model_validate({"loss": "triplet", "loss_negatives": "competitors"})
    assert LabelsConfig().loss_negatives == "batch"


@pytest.mark.ray
def test_competitor_negatives_feed_the_mixture(tmp_path):
    """The pass's `loss` is each pair's InfoNCE against its corpus competitors (the core
    function over in-process stores, whatever the number of index actors), the mixture is fitted
    on it, and the tables stay readable."""
    from pipeline.core.losses.competitors import competitor_losses
    from pipeline.core.search.neighbours import build_local_neighbours
    from pipeline.io.tables import embedding_matrix

    info = write_blob_run(tmp_path / "run", n=300, shards=3, noise=0.3, partial=0.1, seed=2)
    info["output"] = str(tmp_path / "run")  # its own run: the pass rewrites mixture_a.json
    labels = {"method": "cosine", "loss_negatives": "competitors", "loss_competitors": 6}
    spec = _spec(info, str(tmp_path / "labels"), labels=labels, index={"shards": 2})
    summary = run_label_pass(spec)
    assert summary["seconds"]["competitors"] >= 0
    us, vs = [], []
    for shard in info["shards"]:
        table = pq.read_table(spec.embeddings_path(shard))
        us.append(embedding_matrix(table.column("image_embedding_a")))
        vs.append(embedding_matrix(table.column("text_embedding_a")))
    u, v = np.vstack(us), np.vstack(vs)
    ids = np.arange(len(u), dtype=np.int64)
    scale = float(pq.read_schema(spec.embeddings_path("00000")).metadata[b"ncl.logit_scale.a"])
    neighbours = build_local_neighbours([{"ids": ids, "u": u, "v": v}])
    i2t, t2i = competitor_losses(neighbours, u, v, ids, 6, scale)
    table = _table(spec.out_dir)  # keys sort like global ids in this fixture
    np.testing.assert_allclose(table.column("loss").to_numpy(), i2t + t2i, rtol=1e-5)
    fits = json.loads(Path(info["output"], "rounds/0/mixture_a.json").read_text())["fits"]
    prob = clean_posterior(MixtureFit.from_dict(fits["bmm"]), (i2t + t2i).astype(np.float32))
    np.testing.assert_allclose(table.column("clean_prob").to_numpy(), prob, rtol=1e-5, atol=1e-6)
    assert table.num_rows == len(u)
    assert len(list(Path(spec.out_dir, "_competitor_loss").glob("*.parquet"))) == 3
