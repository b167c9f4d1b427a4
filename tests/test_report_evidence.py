"""RCR's evidence in the report: the captions a pair's image retrieves, streamed over the
round's embeddings files, against a brute-force search over all of them at once."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.io.layout import RunLayout
from pipeline.reporting.evidence import merge_topk, retrieved_captions


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def write_embeddings(run, round_index: int, files: list[tuple[list[str], np.ndarray, np.ndarray]]):
    folder = RunLayout(str(run)).embeddings_dir(round_index)
    for number, (keys, images, texts) in enumerate(files):
        dim = images.shape[1]
        columns = {"key": keys}
        for name, rows in (("image_embedding_a", images), ("text_embedding_a", texts)):
            flat = pa.array(rows.astype(np.float16).ravel(), pa.float16())
            columns[name] = pa.FixedSizeListArray.from_arrays(flat, dim)
        os.makedirs(folder, exist_ok=True)
        pq.write_table(pa.table(columns), f"{folder}/{number:05d}.parquet")


def test_merge_topk_keeps_the_k_best_and_earlier_ties_first():
    rng = np.random.default_rng(0)
    scores = np.round(rng.normal(size=(4, 30)), 1).astype(np.float32)  # many ties
    best = (np.empty((4, 0), np.float32), np.empty((4, 0), np.int64))
    for start in range(0, 30, 7):
        block = scores[:, start : start + 7]
        best = merge_topk(best, block, np.arange(start, start + block.shape[1]), 5)
    expected = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(best[1], expected)
    np.testing.assert_array_equal(best[0], np.take_along_axis(scores, expected, 1))


def test_retrieved_captions_match_a_search_over_every_file_at_once(tmp_path):
    rng = np.random.default_rng(1)
    images, texts = _unit(rng.normal(size=(50, 8))), _unit(rng.normal(size=(50, 8)))
    keys = [f"{i:09d}" for i in range(50)]
    write_embeddings(
        tmp_path, 2, [(keys[:20], images[:20], texts[:20]), (keys[20:], images[20:], texts[20:])]
    )
    asked = [keys[3], keys[41], "not-a-key"]
    got = retrieved_captions(str(tmp_path), 2, "a", asked, k=3)
    stored = lambda rows: rows.astype(np.float16).astype(np.float32)  # noqa: E731
    sims = _unit(stored(images)) @ _unit(stored(texts)).T
    for key in asked[:2]:
        order = np.argsort(-sims[keys.index(key)], kind="stable")[:3]
        assert got[key] == [keys[i] for i in order]
    assert "not-a-key" not in got
    assert retrieved_captions(str(tmp_path), 5, "a", asked) == {}  # no such round
