"""Assign (L2RM-style partial OT over FAISS neighbourhoods) against brute-force references.

Pure numpy except the last test (one small label pass on Ray). References: a plain
exponential-domain Sinkhorn on the extended matrix, Python sets for the candidate sets,
numpy top-k for the competitor search.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from label_fixtures import write_blob_run
from sklearn.metrics import roc_auc_score

from pipeline.config import AssignLabelsConfig, LabelsConfig
from pipeline.core.labels.assign import (
    assign_block,
    assign_label,
    candidate_sets,
    competitors,
    partial_sinkhorn,
)
from pipeline.core.labels.in_memory import label_in_memory
from pipeline.core.partition.decisions import NOISY
from pipeline.core.search.neighbours import build_local_neighbours


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _dense_partial_ot(logits, mass, epsilon, iterations, forbid=None):
    """Textbook Sinkhorn scaling on the (n + 1) x (n + 1) extended problem."""
    n = logits.shape[0]
    kernel = np.ones((n + 1, n + 1))
    kernel[:n, :n] = np.exp(logits / epsilon)
    kernel[n, n] = 0.0
    if forbid is not None:
        kernel[:n, :n][forbid] = 0.0
    marginal = np.r_[np.full(n, 1.0 / n), 1.0 - mass]
    col = np.ones(n + 1)
    for _ in range(iterations):
        row = marginal / (kernel @ col)
        col = marginal / (kernel.T @ row)
    return row[:, None] * kernel * col[None, :]


def _padded_blocks(rng, sizes, width, scale=5.0):
    """Random (Q, width, width) logits with `sizes` valid candidates per block, scattered."""
    logits = scale * rng.standard_normal((len(sizes), width, width))
    valid = np.zeros((len(sizes), width), dtype=bool)
    for q, size in enumerate(sizes):
        valid[q, np.sort(rng.choice(width, size, replace=False))] = True
    return logits, valid


@pytest.mark.parametrize("mass", [0.4, 0.8, 1.0])
def test_partial_sinkhorn_matches_a_dense_reference(mass):
    rng = np.random.default_rng(0)
    logits, valid = _padded_blocks(rng, [1, 3, 7, 9], 9)
    plan = partial_sinkhorn(logits, valid, mass, epsilon=0.7, iterations=30)
    assert plan.shape == (4, 10, 10) and plan.dtype == np.float64
    for q in range(4):
        keep = np.flatnonzero(valid[q])
        reference = _dense_partial_ot(logits[q][np.ix_(keep, keep)], mass, 0.7, 30)
        rows = np.r_[keep, 9]  # real candidates, then the dummy
        np.testing.assert_allclose(plan[q][np.ix_(rows, rows)], reference, rtol=1e-9, atol=1e-15)
        padded = np.setdiff1d(np.arange(9), keep)
        assert np.all(plan[q][padded] == 0) and np.all(plan[q][:, padded] == 0)


def test_partial_sinkhorn_respects_marginals_and_mass():
    rng = np.random.default_rng(1)
    logits, valid = _padded_blocks(rng, [2, 5, 8], 8, scale=3.0)
    mass = 0.6
    plan = partial_sinkhorn(logits, valid, mass, epsilon=1.0, iterations=500)
    for q in range(3):
        n = valid[q].sum()
        expected = np.r_[np.where(valid[q], 1.0 / n, 0.0), 1.0 - mass]
        np.testing.assert_allclose(plan[q].sum(axis=1), expected, atol=1e-8)  # rows
        np.testing.assert_allclose(plan[q].sum(axis=0), expected, atol=1e-12)  # columns (last)
        assert plan[q][:-1, :-1].sum() == pytest.approx(mass, abs=1e-8)  # real mass = m
        assert plan[q][-1, -1] == 0.0
    # A forbidden entry carries nothing, and the dense reference agrees.
    forbid = np.zeros((3, 8, 8), dtype=bool)
    first = np.argmax(valid, axis=1)
    forbid[np.arange(3), first, first] = True
    masked = partial_sinkhorn(logits, valid, mass, epsilon=1.0, iterations=40, forbid=forbid)
    assert np.all(masked[np.arange(3), first, first] == 0)
    keep = np.flatnonzero(valid[2])
    reference = _dense_partial_ot(
        logits[2][np.ix_(keep, keep)], mass, 1.0, 40, forbid=forbid[2][np.ix_(keep, keep)]
    )
    rows = np.r_[keep, 8]
    np.testing.assert_allclose(masked[2][np.ix_(rows, rows)], reference, rtol=1e-9, atol=1e-15)


def test_matrix_scaling_and_the_log_domain_give_the_same_plans(monkeypatch):
    """Blocks of a CLIP-like logit range take the fast scaling form; forcing every block into
    the log domain changes nothing beyond rounding (a mass-1 block and forbidden entries too)."""
    import pipeline.core.labels.assign as assign

    rng = np.random.default_rng(5)
    logits, valid = _padded_blocks(rng, [1, 4, 12, 33, 33], 33, scale=40.0)
    forbid = np.zeros((5, 33, 33), dtype=bool)
    forbid[:, np.arange(33), np.arange(33)] = True
    for mass, mask in ((0.7, None), (1.0, None), (0.5, forbid)):
        fast = partial_sinkhorn(logits, valid, mass, iterations=50, forbid=mask)
        monkeypatch.setattr(assign, "_SCALING_SPAN", -1.0)
        slow = partial_sinkhorn(logits, valid, mass, iterations=50, forbid=mask)
        monkeypatch.undo()
        np.testing.assert_allclose(fast, slow, rtol=1e-9, atol=1e-14)


def test_sinkhorn_is_stable_at_sharp_temperatures():
    """Log domain: logits / epsilon of several thousand neither overflow nor give NaN."""
    rng = np.random.default_rng(2)
    logits, valid = _padded_blocks(rng, [6], 6, scale=100.0)
    plan = partial_sinkhorn(logits, valid, 0.5, epsilon=0.01, iterations=200)
    assert np.isfinite(plan).all()
    np.testing.assert_allclose(plan[0].sum(axis=0), np.r_[np.full(6, 1 / 6), 0.5], atol=1e-12)


def test_candidate_sets_match_python_sets():
    rng = np.random.default_rng(3)
    self_ids = rng.integers(0, 30, 50)
    text_ids = rng.integers(-1, 30, (50, 4))
    image_ids = rng.integers(-1, 30, (50, 3))
    ids, position = candidate_sets(self_ids, text_ids, image_ids)
    assert ids.shape == (50, 8)
    for q in range(50):
        expected = sorted({int(self_ids[q]), *text_ids[q].tolist(), *image_ids[q].tolist()} - {-1})
        row = ids[q]
        assert row[: len(expected)].tolist() == expected
        assert np.all(row[len(expected) :] == -1)
        assert row[position[q]] == self_ids[q]


@pytest.mark.parametrize("stores", [1, 3])
def test_competitors_match_exact_topk(stores):
    rng = np.random.default_rng(4)
    n, dim, k = 60, 8, 5
    u = _unit(rng.standard_normal((n, dim)))
    v = _unit(rng.standard_normal((n, dim)))
    u[10], v[11] = u[3], v[4]  # exact ties: broken by id
    ids = np.arange(n, dtype=np.int64)
    neighbours = build_local_neighbours([{"ids": ids, "u": u, "v": v}], stores=stores)
    text_ids, image_ids = competitors(neighbours, u, v, k)
    for queries, database, found in ((u, v, text_ids), (v, u, image_ids)):
        scores = queries.astype(np.float64) @ database.T.astype(np.float64)
        expected = np.lexsort((np.broadcast_to(ids, scores.shape), -scores), axis=1)[:, :k]
        np.testing.assert_array_equal(found, expected)


def _corpus(seed=5, n=300, dim=16, noise=0.3, spread=2.0):
    """Random pairs (caption = image + noise of norm about `spread`), a `noise` share of them
    with the caption of the noisy pair before them (a rotation)."""
    rng = np.random.default_rng(seed)
    u = _unit(rng.standard_normal((n, dim)))
    v = _unit(u + spread * rng.standard_normal((n, dim)) / np.sqrt(dim))
    noisy = rng.permutation(n)[: int(noise * n)]
    v[noisy] = v[np.roll(noisy, 1)]
    donor = np.full(n, -1, dtype=np.int64)  # the pair whose image the caption describes
    donor[noisy] = np.roll(noisy, 1)
    cos = (u * v).sum(axis=1)
    prob = np.clip(0.5 + 2 * (cos - np.median(cos)), 0, 1).astype(np.float32)
    return u, v, donor >= 0, (1 - cos).astype(np.float32), prob, donor


def _scores(u, v, mass, **options) -> np.ndarray:
    """The raw assignment score a of every pair (the `assign` column): the fused label with
    posterior 0."""
    params = AssignLabelsConfig(label="fused", mass=mass, **options)
    zeros = np.zeros(len(u), dtype=np.float32)
    labels = label_in_memory("assign", params, u=u, v=v, loss=zeros, prob=zeros).labels
    np.testing.assert_array_equal(labels.scores["assign"], labels.soft_label)
    return labels.scores["assign"]


def test_labels_do_not_depend_on_index_stores_or_shards():
    u, v, _, loss, prob, _ = _corpus()
    params = AssignLabelsConfig(k=6, iterations=20, mass=0.7)
    keys = np.array([f"k{i}" for i in range(len(u))], dtype=object)
    base = label_in_memory("assign", params, u=u, v=v, loss=loss, prob=prob, keys=keys)
    other = label_in_memory(
        "assign",
        params,
        u=u,
        v=v,
        loss=loss,
        prob=prob,
        keys=keys,
        index_stores=2,
        shard_sizes=[101, 199],
        query_batch=17,
    )
    np.testing.assert_array_equal(base.labels.soft_label, other.labels.soft_label)
    np.testing.assert_array_equal(base.labels.scores["assign"], other.labels.scores["assign"])
    for name, values in base.labels.proxies.items():
        np.testing.assert_array_equal(values, other.labels.proxies[name])


@pytest.mark.parametrize("score", ["share", "relative"])
def test_assign_block_equals_a_per_query_reference(score):
    """The batched block gives, for each query alone, the dense reference's |P| pi_ii (share)
    or pi_ii over the largest real entry of its row and column (relative)."""
    rng = np.random.default_rng(6)
    u_p = _unit(rng.standard_normal((3, 5, 4)))
    v_p = _unit(rng.standard_normal((3, 5, 4)))
    valid = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [0, 1, 1, 0, 0]], dtype=bool)
    position = np.array([2, 3, 1])
    out = assign_block(
        u_p, v_p, valid, position, logit_scale=10.0, mass=0.7, iterations=25, score=score
    )
    assert out["assign"].shape == (3,)
    for q in range(3):
        keep = np.flatnonzero(valid[q])
        logits = 10.0 * u_p[q][keep].astype(np.float64) @ v_p[q][keep].T.astype(np.float64)
        plan = _dense_partial_ot(logits, 0.7, 1.0, 25)
        own = int(np.flatnonzero(keep == position[q])[0])
        n = keep.size
        if score == "share":
            want = min(1.0, n * plan[own, own])
        else:
            want = plan[own, own] / max(plan[own, :n].max(), plan[:n, own].max())
        assert out["assign"][q] == pytest.approx(want, rel=1e-6)


def test_planted_page_swap_ranks_below_its_true_pair():
    """Image A carries the caption of its sibling B (a page swap): its cosine beats a hard
    clean pair C, but B's image takes that caption in the assignment, so A keeps little."""
    rng = np.random.default_rng(7)
    dim = 32
    background = _unit(rng.standard_normal((40, dim)))  # unrelated clean pairs
    background_v = _unit(background + 0.1 * rng.standard_normal((40, dim)))
    page = _unit(rng.standard_normal(dim))
    b_img = _unit(page + 0.5 * _unit(rng.standard_normal(dim)))
    a_img = _unit(page + 0.5 * _unit(rng.standard_normal(dim)))
    b_cap = _unit(b_img + 0.05 * rng.standard_normal(dim))
    c_img = _unit(rng.standard_normal(dim))
    c_cap = _unit(c_img + 0.9 * _unit(rng.standard_normal(dim)))  # hard but correct
    u = np.vstack([background, a_img, b_img, c_img]).astype(np.float32)
    v = np.vstack([background_v, b_cap, b_cap, c_cap]).astype(np.float32)
    a, b, c = 40, 41, 42
    cos = (u * v).sum(axis=1)
    assert cos[a] > cos[c]  # the raw cosine keeps the swap above the clean pair
    prob = np.ones(len(u), dtype=np.float32)
    params = AssignLabelsConfig(k=8, mass=0.9)
    out = label_in_memory("assign", params, u=u, v=v, loss=1 - cos, prob=prob)
    score = _scores(u, v, 0.9, k=8)
    assert score[a] < score[b] and score[a] < score[c]
    assert out.labels.soft_label[a] < out.labels.soft_label[c]  # min(p, a) demotes it


def test_rematch_proxies_point_at_the_better_partner():
    """A noisy pair whose caption belongs to another image gets that image as its text-side
    rematch, and the anchor-key columns name the rematches."""
    u, v, is_noisy, loss, prob, donor = _corpus(seed=8, spread=0.5)
    keys = np.array([f"k{i}" for i in range(len(u))], dtype=object)
    captions = np.array([f"caption {i}" for i in range(len(u))], dtype=object)
    prob = np.where(is_noisy, 0.0, 1.0).astype(np.float32)
    params = AssignLabelsConfig(k=6, mass=0.7)
    out = label_in_memory(
        "assign", params, u=u, v=v, loss=loss, prob=prob, keys=keys, captions=captions
    )
    proxies = out.labels.proxies
    rows = proxies["rows"]
    np.testing.assert_array_equal(rows, np.flatnonzero(out.labels.subset == NOISY))
    hits = [proxies["text_proxy_key"][j] == f"k{donor[i]}" for j, i in enumerate(rows)]
    assert np.mean(hits) > 0.8
    assert all(key != f"k{i}" for key, i in zip(proxies["text_proxy_key"], rows, strict=True))
    assert np.all((proxies["y_p_img"] >= 0) & (proxies["y_p_img"] <= 1))
    for j in range(rows.size):
        if proxies["image_proxy_key"][j] is not None:
            assert (
                proxies["image_proxy_caption"][j] == "caption " + proxies["image_proxy_key"][j][1:]
            )
    assert list(out.labels.text_anchor_key[rows]) == list(proxies["text_proxy_key"])


def test_assign_separates_swaps_better_than_the_cosine():
    """Clustered blobs with in-cluster swaps: the assignment score's AUROC beats the cosine's."""
    rng = np.random.default_rng(9)
    n, dim, clusters = 600, 16, 30
    centres = _unit(rng.standard_normal((clusters, dim)))
    member = rng.integers(0, clusters, n)
    u = _unit(centres[member] + 0.25 * rng.standard_normal((n, dim)))
    v = _unit(u + 0.15 * rng.standard_normal((n, dim)))
    swapped = np.zeros(n, dtype=bool)
    for cluster in range(clusters):
        rows = np.flatnonzero(member == cluster)
        pick = rows[: max(2, rows.size // 3)] if rows.size >= 4 else rows[:0]
        v[pick] = v[np.roll(pick, 1)]  # captions of siblings
        swapped[pick] = True
    cos = (u * v).sum(axis=1)
    a = _scores(u, v, float(1 - swapped.mean()), k=8)
    # At least half of the cosine's ranking errors go away.
    assert 1 - roc_auc_score(~swapped, a) < 0.5 * (1 - roc_auc_score(~swapped, cos))


def test_label_forms_and_config():
    p = np.array([0.9, 0.2, np.nan])
    a = np.array([0.1, 0.5, 0.7])
    np.testing.assert_allclose(assign_label(p, a, "min"), [0.1, 0.2, 0.0], atol=1e-7)
    np.testing.assert_allclose(assign_label(p, a, "fused"), [0.91, 0.6, 0.7], atol=1e-6)
    with pytest.raises(ValueError, match="min"):
        assign_label(p, a, "max")
    with pytest.raises(ValueError, match="label"):
        LabelsConfig.model_validate({"method": "assign", "assign": {"label": "max"}})
    with pytest.raises(ValueError, match="mass"):
        LabelsConfig.model_validate({"assign": {"mass": 0}})
    assert LabelsConfig(method="assign").assign.mass is None


@pytest.mark.ray
def test_label_pass_writes_assign_tables(local_ray, tmp_path):
    """One small pass on Ray: min(p, a) labels that rank well and the proxies table."""
    from pipeline.clients.read import read_labels
    from pipeline.io.labels import SPS_PROXIES_SCHEMA
    from pipeline.stages.labels import LabelSpec, run_label_pass

    info = write_blob_run(tmp_path / "run", n=240, shards=2, noise=0.3, partial=0.0, seed=1)
    labels = LabelsConfig.model_validate({"method": "assign", "assign": {"k": 6}})
    spec = LabelSpec(
        output=str(tmp_path / "run"),
        round_index=0,
        view="a",
        shards=tuple(info["shards"]),
        out_dir=str(tmp_path / "labels"),
        ground_truth=info["ground_truth"],
        job_hash="test",
        labels=labels,
        proxies_dir=str(tmp_path / "proxies"),
        query_batch=50,
    )
    summary = run_label_pass(spec)
    table = read_labels(spec.out_dir).to_table().sort_by("key")
    soft = table.column("soft_label").to_numpy()
    prob = table.column("clean_prob").to_numpy()
    score = table.column("assign").to_numpy()  # labels.v3: the raw score a
    assert table.column("assign").null_count == 0 and np.all((score >= 0) & (score <= 1))
    np.testing.assert_allclose(soft, np.minimum(prob, score), atol=1e-6)  # min(p, a)
    clean = info["kind"][np.argsort(info["keys"])] == "clean"
    assert roc_auc_score(clean, soft) > 0.9
    for shard in info["shards"]:
        proxies = pq.read_table(f"{tmp_path}/proxies/{shard}.parquet")
        assert proxies.schema.equals(SPS_PROXIES_SCHEMA, check_metadata=False)
    assert summary["partition"]["clean_split"]["n_selected"] > 0
