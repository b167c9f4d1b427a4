"""One data pipeline per view and round (pipeline.stages.train.prefetch, and the batching in
pipeline.stages.train.data): each epoch's batches are its own rows cut in order with the last
partial batch dropped, handed out one epoch at a time, an epoch cut short leaves its rest
unread, and closing ends the pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.stages.train.data import cut_epoch_batches
from pipeline.stages.train.prefetch import EpochStream


def _blocks(rows_per_epoch: dict[int, int], block: int) -> list[dict[str, np.ndarray]]:
    """Rows numbered in order, epoch after epoch, in blocks of at most `block` rows (a block
    may span two epochs)."""
    epochs = np.concatenate([np.full(n, e) for e, n in rows_per_epoch.items()])
    ids = np.arange(len(epochs))
    return [
        {"epoch": epochs[a : a + block], "id": ids[a : a + block]}
        for a in range(0, len(ids), block)
    ]


@pytest.mark.parametrize("block", [1, 3, 5, 7, 64])
def test_each_epoch_is_cut_alone_and_its_partial_batch_dropped(block):
    rows = {0: 10, 1: 7, 2: 4, 3: 12}
    got = list(cut_epoch_batches(_blocks(rows, block), size=4))
    # The reference: each epoch's rows alone, cut into 4s, the rest dropped.
    want, start = [], 0
    for epoch, n in rows.items():
        ids = list(range(start, start + n))
        want += [(epoch, ids[i : i + 4]) for i in range(0, n - n % 4, 4)]
        start += n
    assert [(e, b["id"].tolist()) for e, b in got] == want
    assert all(set(b["epoch"].tolist()) == {e} for e, b in got)


def _pairs(log: list, epochs: dict[int, int]):
    """(epoch, batch) pairs that log each fetch and whether they were closed."""
    try:
        for epoch, count in epochs.items():
            for i in range(count):
                log.append((epoch, i))
                yield epoch, {"epoch": epoch, "i": i}
    finally:
        log.append("closed")


def test_a_stream_hands_out_one_epoch_at_a_time_and_skips_the_rest_of_a_cut_epoch():
    log: list = []
    stream = EpochStream(_pairs(log, {0: 3, 1: 3, 2: 2}))
    assert [b["i"] for b in stream.epoch(0)] == [0, 1, 2]
    first = stream.epoch(1)
    assert next(first)["i"] == 0  # epoch 1 cut short after one batch
    assert [(b["epoch"], b["i"]) for b in stream.epoch(2)] == [(2, 0), (2, 1)]
    assert list(stream.epoch(3)) == []
    assert log[-1] == "closed"  # read to its end


def test_an_epoch_not_yet_reached_yields_nothing_and_loses_nothing():
    stream = EpochStream(_pairs([], {1: 2}))
    assert list(stream.epoch(0)) == []
    assert [b["i"] for b in stream.epoch(1)] == [0, 1]


def test_close_ends_the_pipeline():
    log: list = []
    stream = EpochStream(_pairs(log, {0: 100}))
    assert next(stream.epoch(0))["i"] == 0
    stream.close()
    assert log == [(0, 0), "closed"]
