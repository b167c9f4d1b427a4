"""SPS made a fair competitor: the reliable-set fallback (`labels.sps.reliable_fallback`) and
IN2R-style prototype proxies (`labels.sps.proxy: prototype`), against brute-force numpy
references on small inputs, and independent of shards and index stores."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.config import SpsLabelsConfig
from pipeline.core.labels.in_memory import label_in_memory
from pipeline.core.labels.sps import prototype_proxy
from pipeline.core.partition.decisions import CLEAN, NOISY


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _reference_prototype(query, same, other, found, scale, gamma, beta):
    """One query at a time, with plain loops over its candidates."""
    out = []
    for q, s_rows, o_rows, ok in zip(query, same, other, found, strict=True):
        rows = [r for r in range(len(ok)) if ok[r]]
        if not rows:
            out.append((-1, 0.0, 0.0, 0.0))
            continue
        sims = np.array([float(np.dot(q, s_rows[r])) for r in rows])
        w = np.exp(scale * (sims - sims.max()))
        w /= w.sum()
        proto = sum(wi * o_rows[r].astype(np.float64) for wi, r in zip(w, rows, strict=True))
        fits = [float(np.dot(o_rows[r], proto)) for r in rows]
        choice = rows[int(np.argmax(fits))]
        s_bar = float(np.dot(w, sims))
        label = gamma * np.linalg.norm(proto) * s_bar
        label = 0.0 if label < beta or s_bar <= 0 else min(label, 1.0)
        out.append((choice, label, s_bar, float(np.linalg.norm(proto))))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_prototype_proxy_matches_a_loop(seed):
    rng = np.random.default_rng(seed)
    q, k, d = 25, 5, 6
    query = _unit(rng.standard_normal((q, d)))
    same = _unit(rng.standard_normal((q, k, d)) + 2 * query[:, None, :])  # near the query
    other = _unit(rng.standard_normal((q, k, d)))
    other[::3, :3] = other[::3, :1]  # three identical captions: a consensus to find
    found = rng.random((q, k)) < 0.8
    found[4] = False  # no candidate at all
    out = prototype_proxy(query, same, other, found, logit_scale=3.0, gamma=1.2, beta=0.2)
    expected = _reference_prototype(query, same, other, found, 3.0, 1.2, 0.2)
    np.testing.assert_array_equal(out["choice"], [e[0] for e in expected])
    np.testing.assert_allclose(out["label"], [e[1] for e in expected], atol=1e-6)
    np.testing.assert_allclose(out["similarity"], [e[2] for e in expected], atol=1e-6)
    np.testing.assert_allclose(out["consensus"], [e[3] for e in expected], atol=1e-6)
    assert out["label"][4] == 0 and out["choice"][4] == -1
    assert ((out["label"] == 0) | (out["label"] >= 0.2)).all()


def _corpus(n=900, dim=16, clusters=30, seed=0):
    """Clustered pairs; a third of the captions rotated among themselves (the noisy pairs)."""
    rng = np.random.default_rng(seed)
    centers = _unit(rng.standard_normal((clusters, dim)))
    cluster = rng.integers(0, clusters, n)
    u = _unit(centers[cluster] + 0.5 * rng.standard_normal((n, dim)) / math.sqrt(dim))
    v = _unit(centers[cluster] + 0.5 * rng.standard_normal((n, dim)) / math.sqrt(dim))
    noisy = rng.choice(n, n // 3, replace=False)
    v[noisy] = v[np.roll(noisy, 1)]
    is_noisy = np.zeros(n, dtype=bool)
    is_noisy[noisy] = True
    loss = (1.0 - (u * v).sum(axis=1)).astype(np.float32)
    # A posterior that never passes eps1 = 0.99 (the overlap that empties SPS's reliable set).
    prob = np.where(is_noisy, 0.2, 0.6 + 0.3 * rng.random(n)).astype(np.float32)
    captions = np.array([f"caption {i}" for i in range(n)], dtype=object)
    return dict(u=u, v=v, loss=loss, prob=prob, captions=captions), cluster, is_noisy


@pytest.fixture(scope="module")
def corpus():
    return _corpus()


def test_reliable_fallback_takes_the_top_posteriors(corpus):
    arrays, _, _ = corpus
    prob = arrays["prob"]
    empty = label_in_memory("sps", SpsLabelsConfig(), **arrays)
    assert empty.partition["sps_split"]["no_reliable_set"]
    assert not (empty.labels.subset == CLEAN).any()
    params = SpsLabelsConfig(reliable_fallback=0.1)
    out = label_in_memory("sps", params, shard_sizes=[300, 250, 350], **arrays)
    report = out.partition["sps_split"]
    assert report["reliable_fallback"] and report["n_reliable"] == 90
    top = np.lexsort((np.arange(prob.size), -prob))[:90]  # highest posterior, ties by id
    np.testing.assert_array_equal(np.flatnonzero(out.labels.subset == CLEAN), np.sort(top))
    assert (out.labels.soft_label[top] == 1).all()
    found = out.labels.proxies["image_proxy_key"]
    assert all(int(key) in set(top) for key in found)
    # A non-empty reliable set leaves the fallback unused.
    arrays = {**arrays, "prob": np.where(np.arange(prob.size) < 5, 0.995, prob)}
    kept = label_in_memory("sps", params, **arrays)
    assert not kept.partition["sps_split"]["reliable_fallback"]
    assert (kept.labels.subset == CLEAN).sum() == 5


def test_prototype_proxies_in_memory_match_a_brute_force_search(corpus):
    arrays, cluster, is_noisy = corpus
    params = SpsLabelsConfig(reliable_fallback=0.3, proxy="prototype", proxy_k=6)
    out = label_in_memory("sps", params, logit_scale=10.0, **arrays)
    reliable = np.flatnonzero(out.labels.subset == CLEAN)
    noisy = np.flatnonzero(out.labels.subset == NOISY)
    proxies = out.labels.proxies
    np.testing.assert_array_equal(proxies["rows"], noisy)
    u, v = arrays["u"], arrays["v"]
    for side, query, same, other, key in (
        ("img", u, u, v, "image_proxy_key"),
        ("txt", v, v, u, "text_proxy_key"),
    ):
        order = np.argsort(-(query[noisy] @ same[reliable].T), axis=1, kind="stable")
        nn = reliable[order[:, :6]]  # (Q, 6): ties by id, as the index orders them
        expected = prototype_proxy(
            query[noisy], same[nn], other[nn], np.ones(nn.shape, bool), logit_scale=10.0
        )
        np.testing.assert_array_equal(
            proxies[key].astype(int), nn[np.arange(len(noisy)), expected["choice"]]
        )
        np.testing.assert_allclose(proxies[f"y_p_{side}"], expected["label"], atol=1e-6)
        np.testing.assert_allclose(proxies[f"p_hat_{side}"], expected["consensus"], atol=1e-6)
    chosen = proxies["image_proxy_key"].astype(int)
    assert proxies["image_proxy_caption"].tolist() == arrays["captions"][chosen].tolist()
    trained = proxies["y_p_img"] > 0
    # Trained proxy captions come from the noisy image's own cluster.
    assert (cluster[chosen[trained]] == cluster[noisy[trained]]).mean() > 0.95
    # The nearest proxy's P^ (in-batch, 128 proxies) rarely passes beta; the consensus does.
    params = params.model_copy(update={"proxy": "nearest"})
    nearest = label_in_memory("sps", params, logit_scale=10.0, **arrays)
    assert (nearest.labels.proxies["y_p_img"] > 0).mean() < 0.2 < 0.9 < trained.mean()


def test_prototype_proxies_do_not_depend_on_shards_or_index_stores(corpus):
    arrays, _, _ = corpus
    params = SpsLabelsConfig(reliable_fallback=0.2, proxy="prototype", proxy_k=4)
    one = label_in_memory("sps", params, **arrays)
    split = label_in_memory(
        "sps", params, shard_sizes=[400, 500], shard_seeds=[0, 1], index_stores=3, **arrays
    )
    for name in ("image_proxy_key", "text_proxy_key", "y_p_img", "y_p_txt", "s_img"):
        np.testing.assert_array_equal(split.labels.proxies[name], one.labels.proxies[name])
