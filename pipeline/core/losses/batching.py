"""Seeded fixed-size batches for per-sample scores: pure numpy (docs/methods.md §1.1).

Every per-sample score that depends on its batch (the InfoNCE losses of the embed pass, SPS's
in-batch match probability P^) is computed over batches of exactly b pairs, so every score sees
the same number of negatives whatever N is.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fixed_size_loss_batches"]


def fixed_size_loss_batches(
    num_samples: int, batch_size: int, rng: np.random.Generator
) -> list[tuple[np.ndarray, int]]:
    """Split samples into seeded, fixed-size loss batches (docs/methods.md §1.1).

    The last batch is filled up to `batch_size` with samples drawn from outside it (without
    replacement), so every scored sample shares its batch with exactly b-1 others. When fewer
    than `batch_size` samples exist at all, the only batch is all of them (short, unavoidable).

    Args:
        num_samples: N, the number of samples to score.
        batch_size: b.
        rng: seeded generator; the permutation and the filler draw come from it.

    Returns:
        A list of (indices, n_scored): indices (len b, or N when N < b) into 0..N-1; the first
        n_scored entries are the samples whose losses count, the rest are filler.
    """
    if num_samples <= 0:
        return []
    order = rng.permutation(num_samples)
    if num_samples <= batch_size:
        return [(order, num_samples)]
    batches = [
        (order[start : start + batch_size], batch_size)
        for start in range(0, num_samples - num_samples % batch_size, batch_size)
    ]
    remainder = num_samples % batch_size
    if remainder:
        tail = order[-remainder:]
        others = order[:-remainder]
        filler = rng.choice(others, size=batch_size - remainder, replace=False)
        batches.append((np.concatenate([tail, filler]), remainder))
    return batches
