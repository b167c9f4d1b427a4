"""The report's evidence for a label method that records no evidence pairs in its table: the
captions a pair's image retrieves (RCR's neighbours, docs/methods.md §6).

Contract: `retrieved_captions(run_dir, round_index, view, keys, k)` reads the round's
embeddings tables (`rounds/<r>/embeddings/*.parquet`, the view's image and text columns) one
file at a time, twice (the queries' images, then every caption), and returns, per key, the keys
of the k pairs whose captions lie nearest its image by exact cosine, nearest first (ties by file
and row order). Memory holds the queries, one file's captions and the (Q, k) best so far;
nothing is written. A run without the round's embeddings (deleted `rounds/`) gives {}.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["merge_topk", "retrieved_captions"]


def merge_topk(
    best: tuple[np.ndarray, np.ndarray], scores: np.ndarray, ids: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k best of the running (scores (Q, k'), ids (Q, k')) and a new block (scores (Q, n),
    ids (n,)): largest score first, earlier candidates first among equal scores."""
    all_scores = np.concatenate([best[0], scores], axis=1)  # (Q, k' + n)
    all_ids = np.concatenate([best[1], np.broadcast_to(ids, scores.shape)], axis=1)
    order = np.argsort(-all_scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(all_scores, order, 1), np.take_along_axis(all_ids, order, 1)


def _files(run_dir: str, round_index: int) -> tuple[Any, list[str]]:
    from pipeline.io.layout import RunLayout
    from pipeline.io.paths import filesystem, parquet_files

    fs, root = filesystem(RunLayout(run_dir).embeddings_dir(round_index))
    return fs, parquet_files(fs, root)


def retrieved_captions(
    run_dir: str, round_index: int, view: str, keys: list[str], k: int = 3
) -> dict[str, list[str]]:
    """Key -> the keys of the `k` captions nearest its image (see the module docstring)."""
    import pyarrow.parquet as pq

    from pipeline.io.tables import embedding_matrix

    fs, files = _files(run_dir, round_index)
    wanted = set(keys)
    queries: dict[str, np.ndarray] = {}
    for path in files:
        with fs.open(path, "rb") as handle:
            table = pq.read_table(handle, columns=["key", f"image_embedding_{view}"])
        rows = [i for i, key in enumerate(table.column("key").to_pylist()) if key in wanted]
        if rows:
            images = embedding_matrix(table.column(f"image_embedding_{view}").take(rows))
            queries.update(zip(table.column("key").take(rows).to_pylist(), images, strict=True))
    found = [key for key in keys if key in queries]
    if not found:
        return {}
    q = np.stack([queries[key] for key in found])  # (Q, D)
    best = (np.empty((len(found), 0), np.float32), np.empty((len(found), 0), np.int64))
    names: list[str] = []
    for path in files:
        with fs.open(path, "rb") as handle:
            table = pq.read_table(handle, columns=["key", f"text_embedding_{view}"])
        texts = embedding_matrix(table.column(f"text_embedding_{view}"))  # (n, D)
        ids = np.arange(len(names), len(names) + len(texts), dtype=np.int64)
        best = merge_topk(best, q @ texts.T, ids, k)
        names += table.column("key").to_pylist()
    return {key: [names[i] for i in best[1][row]] for row, key in enumerate(found)}
