"""Brute-force top-k with torch: the reference that tests and benchmarks compare FAISS with.

Pure module (torch, numpy). On a GPU it is also a fast exact search for databases that fit in
memory; ties come out in whatever order `torch.topk` leaves them (not canonical).
"""

from __future__ import annotations

import numpy as np

__all__ = ["exact_topk_torch"]


def exact_topk_torch(
    queries: np.ndarray,
    database: np.ndarray,
    k: int,
    *,
    device: str | None = None,
    max_chunk_bytes: int = 256 * 2**20,
) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force reference: float32 matmul + `torch.topk`, chunked over queries.

    Ties come out in whatever order `torch.topk` leaves them (not canonical); tests compare
    scores, and ids only where neighbours are not tied.

    Args:
        queries: (Q, D) float32 array or tensor.
        database: (N, D) float32 array or tensor.
        k: neighbours (clipped to N).
        device: torch device; None -> "cuda" when available, else "cpu".
        max_chunk_bytes: bound on the (chunk, N) score block.

    Returns:
        scores (Q, k) float32 numpy, ids (Q, k) int64 numpy row indices into `database`.
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    q = torch.as_tensor(np.asarray(queries, dtype=np.float32)).to(device)
    db = torch.as_tensor(np.asarray(database, dtype=np.float32)).to(device)
    k = min(k, db.shape[0])
    chunk = max(1, max_chunk_bytes // (4 * max(1, db.shape[0])))
    scores, ids = [], []
    with torch.inference_mode():
        for start in range(0, q.shape[0], chunk):
            block = q[start : start + chunk] @ db.T  # (chunk, N)
            top = torch.topk(block, k, dim=1, largest=True, sorted=True)
            scores.append(top.values.cpu())
            ids.append(top.indices.cpu())
    if not scores:
        return np.empty((0, k), np.float32), np.empty((0, k), np.int64)
    return (
        torch.cat(scores).numpy().astype(np.float32),
        torch.cat(ids).numpy().astype(np.int64),
    )
