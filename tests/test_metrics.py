"""Label-quality and retrieval metrics against brute-force references (docs/methods.md §11)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import spearmanr

from pipeline.core.metrics import (
    histogram_quantiles,
    label_quality,
    retrieval_recall,
    similarity_for_eval,
)

# ------------------------------------------------------------------------------------------
# Brute-force references
# ------------------------------------------------------------------------------------------


def _stable_order(values) -> list[int]:
    """Indices by decreasing value, ties by increasing index (the documented order)."""
    return sorted(range(len(values)), key=lambda j: (-values[j], j))


def _naive_recall(sim: np.ndarray, t2i: np.ndarray, ks=(1, 5, 10)) -> dict[str, float]:
    n_images, n_texts = sim.shape
    i2t_ranks, t2i_ranks = [], []
    for i in range(n_images):
        captions = {t for t in range(n_texts) if t2i[t] == i}
        if not captions:
            continue
        order = _stable_order(list(sim[i]))
        i2t_ranks.append(min(order.index(t) for t in captions))
    for t in range(n_texts):
        order = _stable_order(list(sim[:, t]))
        t2i_ranks.append(order.index(t2i[t]))
    out = {}
    for k in ks:
        out[f"i2t_r{k}"] = 100.0 * sum(r < k for r in i2t_ranks) / len(i2t_ranks)
    for k in ks:
        out[f"t2i_r{k}"] = 100.0 * sum(r < k for r in t2i_ranks) / len(t2i_ranks)
    out["rsum"] = sum(out.values())
    out["i2t_medr"] = float(sorted(i2t_ranks)[(len(i2t_ranks) - 1) // 2] + 1)
    out["t2i_medr"] = float(sorted(t2i_ranks)[(len(t2i_ranks) - 1) // 2] + 1)
    return out


def _random_case(n_images: int, captions: int, seed: int, ties: bool):
    rng = np.random.default_rng(seed)
    t2i = np.repeat(np.arange(n_images), captions)  # F30K layout: 5 consecutive captions
    rng.shuffle(t2i)
    sim = rng.standard_normal((n_images, t2i.shape[0])).astype(np.float32)
    if ties:
        sim = np.round(sim * 2) / 2  # few distinct values, so ties are everywhere
    return sim, t2i


# ------------------------------------------------------------------------------------------
# Retrieval
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("captions", [1, 5])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
def test_recall_matches_brute_force(captions, ties, chunk_size):
    for seed in range(4):
        sim, t2i = _random_case(13, captions, seed, ties)
        got = retrieval_recall(sim, t2i, chunk_size=chunk_size)
        want = _naive_recall(sim, t2i)
        for key, value in want.items():
            assert got[key] == pytest.approx(value), key
        assert got["n_image_queries"] == 13 and got["n_text_queries"] == 13 * captions


def test_recall_any_caption_counts_for_image_to_text():
    # Image 0 has captions 0 and 1; caption 1 is its top text, caption 0 is ranked last.
    sim = np.array([[0.0, 0.9, 0.5, 0.4], [0.1, 0.2, 0.8, 0.3]])
    t2i = np.array([0, 0, 1, 1])
    got = retrieval_recall(sim, t2i, ks=(1,))
    assert got["i2t_r1"] == 100.0  # both images find one of their captions first
    # Text->image: texts 1 and 2 find their image first; text 0 (0.0 < 0.1) and text 3
    # (0.4 > 0.3, but it belongs to image 1) do not.
    assert got["t2i_r1"] == 50.0


def test_recall_ties_follow_stable_order():
    # All scores equal: the order is by index, so only the lowest-index candidate is rank 0.
    sim = np.zeros((3, 3), dtype=np.float32)
    got = retrieval_recall(sim, np.array([0, 1, 2]), ks=(1, 2, 3))
    assert got["i2t_r1"] == pytest.approx(100 / 3)
    assert got["i2t_r2"] == pytest.approx(200 / 3)
    assert got["i2t_r3"] == 100.0


@pytest.mark.parametrize("captions", [1, 5])
def test_perfect_retrieval_gives_100_and_rsum_600(captions):
    n_images = 20
    t2i = np.repeat(np.arange(n_images), captions)
    sim = (t2i[None, :] == np.arange(n_images)[:, None]).astype(np.float32)
    got = retrieval_recall(torch.from_numpy(sim), torch.from_numpy(t2i), chunk_size=3)
    for key in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10"):
        assert got[key] == 100.0
    assert got["rsum"] == 600.0
    assert got["i2t_medr"] == 1.0 and got["t2i_medr"] == 1.0


def test_images_without_captions_are_not_image_queries():
    sim = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # image 2 has no caption
    got = retrieval_recall(sim, np.array([0, 1]), ks=(1,))
    assert got["n_image_queries"] == 2
    assert got["i2t_r1"] == 100.0 and got["t2i_r1"] == 100.0


@given(
    n_images=st.integers(1, 12),
    captions=st.integers(1, 5),
    seed=st.integers(0, 10_000),
    ks=st.lists(st.integers(1, 70), min_size=1, max_size=5, unique=True),
)
@settings(max_examples=60, deadline=None)
def test_recall_monotone_in_k_and_in_range(n_images, captions, seed, ks):
    sim, t2i = _random_case(n_images, captions, seed, ties=seed % 2 == 0)
    ks = tuple(sorted(ks))
    got = retrieval_recall(sim, t2i, ks=ks, chunk_size=5)
    for direction in ("i2t", "t2i"):
        values = [got[f"{direction}_r{k}"] for k in ks]
        assert all(0.0 <= v <= 100.0 for v in values)
        assert values == sorted(values)
        if ks[-1] >= sim.shape[0 if direction == "t2i" else 1]:
            assert values[-1] == 100.0  # K covers every candidate
    assert got["rsum"] == pytest.approx(sum(v for k, v in got.items() if "_r" in k))


@given(
    n_images=st.integers(1, 12),
    captions=st.integers(1, 5),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_recall_invariant_to_consistent_permutations(n_images, captions, seed):
    sim, t2i = _random_case(n_images, captions, seed, ties=False)  # no ties: order is canonical
    rng = np.random.default_rng(seed + 1)
    base = retrieval_recall(sim, t2i)
    text_perm = rng.permutation(sim.shape[1])
    permuted_texts = retrieval_recall(sim[:, text_perm], t2i[text_perm])
    image_perm = rng.permutation(n_images)  # new row r holds old image image_perm[r]
    new_index = np.argsort(image_perm)  # old image -> new row
    permuted_images = retrieval_recall(sim[image_perm], new_index[t2i])
    for key in base:
        assert permuted_texts[key] == pytest.approx(base[key]), key
        assert permuted_images[key] == pytest.approx(base[key]), key


def test_recall_rejects_bad_inputs():
    sim = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="text_to_image has"):
        retrieval_recall(sim, np.array([0, 1]))
    with pytest.raises(ValueError, match="rows of sim"):
        retrieval_recall(sim, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="NaN"):
        retrieval_recall(np.full((2, 3), np.nan), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="ks"):
        retrieval_recall(sim, np.array([0, 1, 1]), ks=(0,))


def test_recall_handles_a_5k_by_25k_matrix_in_chunks():
    # The F30K/COCO-5k test-set size; must run in seconds on CPU within a small working set.
    n_images, captions = 5000, 5
    gen = torch.Generator().manual_seed(0)
    t2i = torch.arange(n_images).repeat_interleave(captions)
    sim = torch.randn(n_images, n_images * captions, generator=gen)
    sim[t2i, torch.arange(t2i.shape[0])] += 4.0  # strong diagonal: high but imperfect recall
    got = retrieval_recall(sim, t2i, chunk_size=512)
    assert 50.0 < got["t2i_r1"] < 100.0 and 50.0 < got["i2t_r1"] <= 100.0


def _unit(rows: int, dim: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.normalize(x, dim=1)


def test_similarity_for_eval_averages_the_two_networks():
    u_a, v_a, u_b, v_b = _unit(4, 8, 0), _unit(6, 8, 1), _unit(4, 16, 2), _unit(6, 16, 3)
    torch.testing.assert_close(similarity_for_eval(u_a, v_a), u_a @ v_a.T)
    torch.testing.assert_close(
        similarity_for_eval(u_a, v_a, u_b, v_b), 0.5 * (u_a @ v_a.T + u_b @ v_b.T)
    )
    got = similarity_for_eval(u_a.numpy(), v_a.numpy(), u_b.half().numpy(), v_b.half().numpy())
    assert got.dtype == torch.float32 and got.shape == (4, 6)
    with pytest.raises(ValueError, match="both"):
        similarity_for_eval(u_a, v_a, u_b)
    with pytest.raises(ValueError, match="same items"):
        similarity_for_eval(u_a, v_a, u_b[:3], v_b)


# ------------------------------------------------------------------------------------------
# Label quality
# ------------------------------------------------------------------------------------------


def test_auroc_matches_hand_computed_case_and_ignores_partial():
    # Clean scores {0.9, 0.8, 0.3} vs mismatched {0.5, 0.1}: 5 of the 6 pairs ordered -> 5/6.
    scores = np.array([0.9, 0.8, 0.3, 0.5, 0.1, 0.0, 1.0])
    kind = np.array(["clean"] * 3 + ["mismatched"] * 2 + ["partial"] * 2)
    degree = np.array([1, 1, 1, 0, 0, 0.5, 0.5])
    out = label_quality(scores, kind, degree)
    assert out["auroc"] == pytest.approx(5 / 6)
    assert out["n_clean"] == 3 and out["n_mismatched"] == 2 and out["n_partial"] == 2
    assert out["spearman"] == pytest.approx(spearmanr(scores, degree).statistic)


def test_auroc_ties_count_half():
    out = label_quality(np.array([0.5, 0.5]), np.array(["clean", "mismatched"]), None)
    assert out["auroc"] == pytest.approx(0.5)


def test_nan_scores_are_excluded_and_counted():
    scores = np.array([0.9, np.nan, 0.1, 0.8, np.nan])
    kind = np.array(["clean", "mismatched", "mismatched", "clean", "clean"])
    degree = np.array([1.0, 0.0, 0.0, 1.0, 1.0])
    out = label_quality(scores, kind, degree, subset_clean=np.array([1, 0, 0, 1, 0], bool))
    assert out["n_nan_scores"] == 2
    assert out["auroc"] == 1.0
    assert out["spearman"] == pytest.approx(spearmanr([0.9, 0.1, 0.8], [1, 0, 1]).statistic)
    # Precision/recall use every pair: the NaN-scored clean pair 4 was not selected -> a miss.
    assert out["precision"] == 1.0 and out["recall"] == pytest.approx(2 / 3)


def test_precision_recall_count_partial_as_not_clean():
    kind = np.array(["clean", "clean", "partial", "mismatched"])
    subset = np.array([True, False, True, False])
    out = label_quality(np.array([0.9, 0.7, 0.6, 0.1]), kind, None, subset)
    assert out["precision"] == 0.5 and out["recall"] == 0.5 and out["f1"] == 0.5
    assert out["n_subset"] == 2
    assert out["spearman"] is None and "degree" in out["reasons"]["spearman"]


def test_degenerate_inputs_give_none_with_reason_not_errors():
    kind = np.array(["clean", "clean", "partial"])
    out = label_quality(np.array([0.2, 0.4, 0.3]), kind, np.ones(3), np.zeros(3, bool))
    assert out["auroc"] is None and "mismatched" in out["reasons"]["auroc"]
    assert out["spearman"] is None and "constant" in out["reasons"]["spearman"]
    assert out["precision"] is None and "empty" in out["reasons"]["precision"]
    assert out["recall"] == 0.0 and out["f1"] is None

    out = label_quality(np.full(2, np.nan), np.array(["clean", "mismatched"]), np.array([1, 0]))
    assert out["auroc"] is None and out["spearman"] is None and out["n_nan_scores"] == 2

    out = label_quality(np.array([0.5, 0.5]), np.array(["clean", "mismatched"]), np.array([1, 0]))
    assert out["spearman"] is None and "scores are constant" in out["reasons"]["spearman"]

    out = label_quality(np.array([]), np.array([], dtype=str), np.array([]))
    assert out["n_pairs"] == 0 and out["auroc"] is None and out["spearman"] is None
    assert out["precision"] is None and set(out["reasons"]) >= {"auroc", "precision", "recall"}

    out = label_quality(np.array([0.1]), np.array(["mismatched"]), np.array([0.0]), [True])
    assert out["precision"] == 0.0 and out["recall"] is None


def test_label_quality_rejects_malformed_input():
    with pytest.raises(ValueError, match="unknown kind"):
        label_quality(np.array([0.1]), np.array(["noisy"]), None)
    with pytest.raises(ValueError, match="entries"):
        label_quality(np.array([0.1, 0.2]), np.array(["clean"]), None)


@given(seed=st.integers(0, 10_000), n=st.integers(4, 60))
@settings(max_examples=40, deadline=None)
def test_label_quality_is_json_ready_and_bounded(seed, n):
    rng = np.random.default_rng(seed)
    kind = rng.choice(["clean", "partial", "mismatched"], size=n)
    degree = np.where(kind == "clean", 1.0, np.where(kind == "partial", 0.5, 0.0))
    scores = np.where(rng.random(n) < 0.1, np.nan, rng.random(n))
    out = label_quality(scores, kind, degree, rng.random(n) < 0.5)
    for key in ("auroc", "precision", "recall", "f1"):
        value = out[key]
        assert value is None or (isinstance(value, float) and 0.0 <= value <= 1.0)
    assert out["spearman"] is None or -1.0 - 1e-12 <= out["spearman"] <= 1.0 + 1e-12
    for key, value in out.items():
        if value is not None and key != "reasons":
            assert isinstance(value, int | float) and not isinstance(value, np.generic)
            assert not (isinstance(value, float) and math.isnan(value))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=200),
    st.sampled_from([10, 100]),
)
def test_histogram_quantiles_are_within_one_bin_of_the_sample_quantiles(values, bins):
    """Against numpy's quantile of the values themselves (the inverted CDF: the smallest value
    with at least q of the sample at or below it)."""
    counts = torch.histc(torch.tensor(values), bins=bins, min=0.0, max=1.0).tolist()
    quantiles = (0.1, 0.5, 0.9)
    width = 1.0 / bins
    for q, got in zip(quantiles, histogram_quantiles(counts, quantiles), strict=True):
        exact = float(np.quantile(np.asarray(values, np.float32), q, method="inverted_cdf"))
        assert got - width - 1e-6 <= exact <= got + 1e-6, (q, exact, got)
    assert histogram_quantiles([0.0] * bins, quantiles) == [None, None, None]
