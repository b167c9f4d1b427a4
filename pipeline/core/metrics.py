"""Evaluation metrics: label quality against ground truth, and cross-modal retrieval recall.
Pure numpy / torch / scipy / scikit-learn; no Ray, no I/O, no config objects.

Contract:
- `label_quality` scores estimated correspondence labels against a corpus's ground truth
  (AUROC clean-vs-mismatched, Spearman with the true degree, precision/recall of a clean
  subset). It never raises on degenerate data: the metric is `None` and `reasons[name]` says why.
- `retrieval_recall`: image->text and text->image Recall@K in percent and rSum; an image hits
  when ANY of its captions is in the top K. Ranks are exact, counted chunk by chunk (no top-K
  list). Tie rule: decreasing similarity, then increasing index (deterministic, unlike
  `torch.topk`); a hit at K means rank < K.
- `similarity_for_eval`: the mean of the two networks' cosine-similarity matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "LABEL_KINDS",
    "histogram_quantiles",
    "label_quality",
    "retrieval_recall",
    "similarity_for_eval",
]

LABEL_KINDS = ("clean", "partial", "mismatched")  # ground-truth pair kinds of a synthetic corpus


def histogram_quantiles(
    counts: Sequence[float] | np.ndarray,
    quantiles: Sequence[float],
    low: float = 0.0,
    high: float = 1.0,
) -> list[float | None]:
    """Quantiles of values known only by their histogram (e.g. pooled over training workers).

    Args:
        counts: (K,) counts of K equal bins over [low, high].
        quantiles: each in [0, 1].

    Returns:
        Per quantile q, the upper edge of the first bin whose cumulative count reaches q times
        the total: at most one bin width above the sample quantile. None for an empty histogram.
    """
    counts = np.asarray(counts, dtype=np.float64)  # (K,)
    total = counts.sum()
    if total <= 0:
        return [None for _ in quantiles]
    cumulative = np.cumsum(counts)  # (K,)
    width = (high - low) / len(counts)
    # A small tolerance: pooled float sums must not miss the bin that holds exactly q * total.
    bins = [int(np.searchsorted(cumulative, q * total - 1e-9 * total)) for q in quantiles]
    return [low + width * (min(b, len(counts) - 1) + 1) for b in bins]


# --------------------------------------------------------------------------------------------
# Label quality
# --------------------------------------------------------------------------------------------


def label_quality(
    scores: np.ndarray,
    kind: np.ndarray,
    degree: np.ndarray | None,
    subset_clean: np.ndarray | None = None,
) -> dict[str, Any]:
    """Quality of estimated correspondence labels against the ground truth.

    Args:
        scores: (N,) float, the estimate per pair; higher means "more likely a true pair"
            (clean posterior, soft label, weight). NaN marks a pair that got no score.
        kind: (N,) str, each one of `LABEL_KINDS`: "clean", "partial" (caption only partly
            describes the image) or "mismatched".
        degree: (N,) float, the true degree of correspondence (e.g. 1 clean, 0 mismatched,
            in between for partial), or None when the corpus has none.
        subset_clean: (N,) bool, the pairs a method selected as clean, or None.

    Returns:
        A dict of plain Python values (JSON-ready):
        - `n_pairs`, `n_nan_scores`, `n_clean`, `n_partial`, `n_mismatched`, `n_subset`
          (None without a subset);
        - `auroc`: ROC AUC of `scores` separating clean (positive) from mismatched pairs;
          partial pairs are excluded because they belong to neither class;
        - `spearman`: Spearman rank correlation of `scores` with `degree` over all pairs
          (partial included) with a finite score and degree;
        - `precision`, `recall`, `f1` of `subset_clean` against the truly clean pairs. A partial
          pair counts as NOT clean: a method that keeps it is charged a false positive, since
          it trains on a caption that does not fully describe the image. These use every pair,
          NaN-scored ones included (a truly clean pair left out of the subset is a miss
          whatever its score);
        - `reasons`: {metric name: why it is None} for every metric that is None.

    Raises:
        ValueError: on mismatched lengths or an unknown kind (malformed input, not degenerate
            data).
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)  # (N,)
    kind = np.asarray(kind).astype(str).reshape(-1)  # (N,)
    n = scores.shape[0]
    if kind.shape[0] != n:
        raise ValueError(f"kind has {kind.shape[0]} entries but scores has {n}; pass one per pair")
    unknown = sorted(set(np.unique(kind).tolist()) - set(LABEL_KINDS))
    if unknown:
        raise ValueError(f"unknown kind values {unknown}; use only {list(LABEL_KINDS)}")
    if degree is not None:
        degree = np.asarray(degree, dtype=np.float64).reshape(-1)  # (N,)
        if degree.shape[0] != n:
            raise ValueError(f"degree has {degree.shape[0]} entries but scores has {n}")
    if subset_clean is not None:
        subset_clean = np.asarray(subset_clean, dtype=bool).reshape(-1)  # (N,)
        if subset_clean.shape[0] != n:
            raise ValueError(f"subset_clean has {subset_clean.shape[0]} entries but scores has {n}")

    is_clean = kind == "clean"  # (N,) bool
    is_mismatched = kind == "mismatched"  # (N,) bool
    finite = ~np.isnan(scores)  # (N,) bool; +-inf is a valid (extreme) score for ranking
    reasons: dict[str, str] = {}
    out: dict[str, Any] = {
        "n_pairs": int(n),
        "n_nan_scores": int(n - finite.sum()),
        "n_clean": int(is_clean.sum()),
        "n_partial": int((kind == "partial").sum()),
        "n_mismatched": int(is_mismatched.sum()),
        "n_subset": None if subset_clean is None else int(subset_clean.sum()),
    }

    out["auroc"] = _auroc(scores, is_clean, is_mismatched, finite, reasons)
    out["spearman"] = _spearman(scores, degree, finite, reasons)
    precision, recall, f1 = _subset_precision_recall(subset_clean, is_clean, reasons)
    out.update(precision=precision, recall=recall, f1=f1, reasons=reasons)
    return out


def _auroc(
    scores: np.ndarray,
    is_clean: np.ndarray,
    is_mismatched: np.ndarray,
    finite: np.ndarray,
    reasons: dict[str, str],
) -> float | None:
    from sklearn.metrics import roc_auc_score

    keep = finite & (is_clean | is_mismatched)
    n_pos = int((keep & is_clean).sum())
    n_neg = int((keep & is_mismatched).sum())
    if n_pos == 0 or n_neg == 0:
        reasons["auroc"] = (
            f"needs both classes with a finite score; got {n_pos} clean and {n_neg} mismatched"
        )
        return None
    return float(roc_auc_score(is_clean[keep], scores[keep]))


def _spearman(
    scores: np.ndarray,
    degree: np.ndarray | None,
    finite: np.ndarray,
    reasons: dict[str, str],
) -> float | None:
    from scipy.stats import spearmanr

    if degree is None:
        reasons["spearman"] = "no true degree given"
        return None
    keep = finite & np.isfinite(degree)
    x, y = scores[keep], degree[keep]
    if x.shape[0] < 2:
        reasons["spearman"] = f"needs at least 2 pairs with a finite score and degree; got {len(x)}"
        return None
    # A constant input has no ranks to correlate; scipy would warn and return NaN.
    if np.all(x == x[0]):
        reasons["spearman"] = "scores are constant"
        return None
    if np.all(y == y[0]):
        reasons["spearman"] = "true degree is constant"
        return None
    return float(spearmanr(x, y).statistic)


def _subset_precision_recall(
    subset_clean: np.ndarray | None, is_clean: np.ndarray, reasons: dict[str, str]
) -> tuple[float | None, float | None, float | None]:
    if subset_clean is None:
        for name in ("precision", "recall", "f1"):
            reasons[name] = "no clean subset given"
        return None, None, None
    true_pos = int((subset_clean & is_clean).sum())
    n_selected = int(subset_clean.sum())
    n_truly_clean = int(is_clean.sum())
    precision = recall = f1 = None
    if n_selected == 0:
        reasons["precision"] = "the clean subset is empty"
    else:
        precision = true_pos / n_selected
    if n_truly_clean == 0:
        reasons["recall"] = "no truly clean pairs"
    else:
        recall = true_pos / n_truly_clean
    if precision is None or recall is None:
        reasons["f1"] = "precision or recall is undefined"
    elif precision + recall == 0:
        f1 = 0.0
    else:
        f1 = 2 * precision * recall / (precision + recall)
    return precision, recall, f1


# --------------------------------------------------------------------------------------------
# Retrieval
# --------------------------------------------------------------------------------------------


def similarity_for_eval(
    image_emb_a: torch.Tensor | np.ndarray,
    text_emb_a: torch.Tensor | np.ndarray,
    image_emb_b: torch.Tensor | np.ndarray | None = None,
    text_emb_b: torch.Tensor | np.ndarray | None = None,
) -> torch.Tensor:
    """Cross-modal similarity matrix used for retrieval evaluation.

    With one network it is S = u vᵀ; with the co-teaching pair A, B it is (S_A + S_B)/2, the
    inference rule of BiCro / NCR / SPS (docs/methods.md §9.4).

    Args:
        image_emb_a: (n_images, D) L2-normalised image embeddings of network A.
        text_emb_a: (n_texts, D) L2-normalised text embeddings of network A.
        image_emb_b: (n_images, D') image embeddings of network B, or None.
        text_emb_b: (n_texts, D') text embeddings of network B, or None (with image_emb_b).

    Returns:
        (n_images, n_texts) float32 tensor on the device of image_emb_a.

    Raises:
        ValueError: when only one of the B embeddings is given, or row counts disagree.
    """
    if (image_emb_b is None) != (text_emb_b is None):
        raise ValueError("pass both image_emb_b and text_emb_b (network B), or neither")
    u_a = torch.as_tensor(image_emb_a).float()  # (n_images, D)
    v_a = torch.as_tensor(text_emb_a, device=u_a.device).float()  # (n_texts, D)
    sim = u_a @ v_a.T  # (n_images, n_texts)
    if image_emb_b is None:
        return sim
    u_b = torch.as_tensor(image_emb_b, device=u_a.device).float()  # (n_images, D')
    v_b = torch.as_tensor(text_emb_b, device=u_a.device).float()  # (n_texts, D')
    if u_b.shape[0] != u_a.shape[0] or v_b.shape[0] != v_a.shape[0]:
        raise ValueError(
            f"networks A and B must embed the same items: A has {tuple(sim.shape)} "
            f"(images, texts), B has ({u_b.shape[0]}, {v_b.shape[0]})"
        )
    sim.add_(u_b @ v_b.T).mul_(0.5)  # in place: the full matrix can be large
    return sim


def retrieval_recall(
    sim: torch.Tensor | np.ndarray,
    text_to_image: torch.Tensor | np.ndarray,
    ks: tuple[int, ...] = (1, 5, 10),
    chunk_size: int = 1024,
) -> dict[str, float | int]:
    """Image->text and text->image Recall@K (percent) and rSum.

    Args:
        sim: (n_images, n_texts) float similarity; higher = better match. Computed on its own
            device (pass a CUDA tensor to use the GPU). Must not contain NaN.
        text_to_image: (n_texts,) int, the image index (row of `sim`) each text describes.
        ks: the cut-offs K, each >= 1.
        chunk_size: queries ranked at once; the working set is (chunk_size, n_candidates).

    Returns:
        {"i2t_r{K}": %, "t2i_r{K}": % for each K, "rsum": sum of all of them (600 at best with
        the default ks), "i2t_medr", "t2i_medr": median 1-based rank of the first correct
        candidate (the lower middle value for an even count), "n_image_queries",
        "n_text_queries"}. Images without any caption are not image->text queries (there is
        nothing to retrieve); they remain text->image candidates.

    Raises:
        ValueError: on shape mismatches, out-of-range image indices, NaN similarities, bad ks,
            or when no image has a caption.
    """
    sim = torch.as_tensor(sim)
    if sim.ndim != 2:
        raise ValueError(f"sim must be (n_images, n_texts); got shape {tuple(sim.shape)}")
    n_images, n_texts = sim.shape
    t2i = torch.as_tensor(text_to_image, device=sim.device).long().reshape(-1)  # (n_texts,)
    if t2i.shape[0] != n_texts:
        raise ValueError(f"text_to_image has {t2i.shape[0]} entries but sim has {n_texts} texts")
    if n_texts == 0:
        raise ValueError("no texts to evaluate")
    if int(t2i.min()) < 0 or int(t2i.max()) >= n_images:
        raise ValueError(f"text_to_image must index rows of sim, i.e. lie in [0, {n_images})")
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must be a non-empty list of cut-offs >= 1; got {ks}")
    if bool(torch.isnan(sim).any()):
        raise ValueError("sim contains NaN; the ranking would be undefined")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")

    has_caption = torch.zeros(n_images, dtype=torch.bool, device=sim.device)
    has_caption[t2i] = True
    image_queries = torch.nonzero(has_caption).reshape(-1)  # (n_image_queries,)
    i2t_ranks = _image_to_text_ranks(sim, t2i, image_queries, chunk_size)  # (n_image_queries,)
    t2i_ranks = _text_to_image_ranks(sim, t2i, chunk_size)  # (n_texts,)

    out: dict[str, float | int] = {}
    for k in ks:
        out[f"i2t_r{k}"] = 100.0 * float((i2t_ranks < k).double().mean())
    for k in ks:
        out[f"t2i_r{k}"] = 100.0 * float((t2i_ranks < k).double().mean())
    out["rsum"] = float(sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in ks))
    # torch.median takes the lower middle value for even counts, so medr is always a rank.
    out["i2t_medr"] = float(torch.median(i2t_ranks) + 1)
    out["t2i_medr"] = float(torch.median(t2i_ranks) + 1)
    out["n_image_queries"] = int(image_queries.shape[0])
    out["n_text_queries"] = int(n_texts)
    return out


def _stable_rank(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """0-based position of `target` in each row sorted by decreasing score, ties by index.

    Args:
        scores: (Q, C) float, one row per query.
        target: (Q,) int64 column of the correct candidate of each row.

    Returns:
        (Q,) int64 rank: #{c: s_c > s_t} + #{c < t: s_c == s_t}.
    """
    rows = torch.arange(scores.shape[0], device=scores.device)
    target_score = scores[rows, target][:, None]  # (Q, 1)
    columns = torch.arange(scores.shape[1], device=scores.device)[None, :]  # (1, C)
    above = scores > target_score  # (Q, C)
    tied_before = (scores == target_score) & (columns < target[:, None])  # (Q, C)
    return above.sum(dim=1) + tied_before.sum(dim=1)


def _image_to_text_ranks(
    sim: torch.Tensor, t2i: torch.Tensor, image_queries: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Rank of the best-placed caption of each query image, (n_image_queries,) int64."""
    ranks = []
    for start in range(0, image_queries.shape[0], chunk_size):
        images = image_queries[start : start + chunk_size]  # (q,)
        scores = sim[images].float()  # (q, n_texts)
        own = t2i[None, :] == images[:, None]  # (q, n_texts): the image's captions
        # The best-placed caption is the highest-scoring own caption, the lowest index among
        # equals (the stable order); its rank is the smallest over all own captions.
        best = scores.masked_fill(~own, float("-inf")).amax(dim=1, keepdim=True)  # (q, 1)
        is_best = own & (scores == best)  # (q, n_texts); an own caption at -inf still counts
        target = is_best.to(torch.uint8).argmax(dim=1)  # (q,) first True (argmax takes the first)
        ranks.append(_stable_rank(scores, target))
    return torch.cat(ranks)


def _text_to_image_ranks(sim: torch.Tensor, t2i: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Rank of each text's own image among all images, (n_texts,) int64."""
    ranks = []
    for start in range(0, sim.shape[1], chunk_size):
        scores = sim[:, start : start + chunk_size].T.float()  # (q, n_images)
        ranks.append(_stable_rank(scores, t2i[start : start + chunk_size]))
    return torch.cat(ranks)
