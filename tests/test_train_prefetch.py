"""The next epoch's data starts early (pipeline.stages.train.prefetch): the same batches in the
same order, errors raised where the caller iterates, pipelines closed when not used, and the
start decided by the steps left against the measured start-up."""

from __future__ import annotations

import threading

import pytest

from pipeline.stages.train.prefetch import MAX_EARLY_SHARE, START_MARGIN, EarlyStart, start_due


def _counting(items, log: list):
    """A generator over `items` that logs each fetch and whether it was closed."""
    try:
        for item in items:
            log.append(("fetch", item, threading.current_thread().name))
            yield item
    finally:
        log.append(("closed",))


@pytest.mark.parametrize("items", [[], [0], list(range(7))])
def test_early_start_yields_the_same_items_in_order(items):
    log: list = []
    assert list(EarlyStart(lambda: _counting(items, log))) == items


def test_the_first_item_is_fetched_on_a_thread_before_iteration():
    log: list = []
    early = EarlyStart(lambda: _counting([10, 11, 12], log))
    early._thread.join()
    assert log == [("fetch", 10, "epoch-data-start")]  # only the first, not the rest
    assert early.start_s is not None and early.start_s >= 0
    assert list(early) == [10, 11, 12]
    main = threading.current_thread().name
    assert [entry[2] for entry in log if entry[0] == "fetch"][1:] == [main, main]


class _ShardError(Exception):
    pass


def _failing_pipeline():
    raise _ShardError("shard 00003.tar changed since the embed pass")
    yield  # a generator, as Ray Data's iterator is: the error comes with the first batch


def _failing_plan():
    raise _ShardError("no such label table")  # before any iterator exists


@pytest.mark.parametrize("make", [_failing_pipeline, _failing_plan])
def test_an_error_while_starting_is_raised_where_the_batches_are_read(make):
    early = EarlyStart(make)
    early._thread.join()  # the thread ends quietly; the error waits for the reader
    with pytest.raises(_ShardError):
        next(iter(early))


def test_close_ends_a_pipeline_that_was_never_read():
    log: list = []
    early = EarlyStart(lambda: _counting(range(100), log))
    early.close()
    assert log[-1] == ("closed",) and len(log) == 2  # one fetch, then closed
    assert list(early) == []


def test_start_due_waits_for_a_measured_start_up():
    assert not start_due(1, 100, 0.1, None)


def test_start_due_when_the_steps_left_last_as_long_as_the_margin():
    steps, step_s, start_s = 100, 0.1, 0.5
    left = int(START_MARGIN * start_s / step_s)  # 10 steps of 0.1 s cover two 0.5 s start-ups
    assert start_due(left, steps, step_s, start_s)
    assert not start_due(left + 1, steps, step_s, start_s)


def test_start_due_never_earlier_than_its_share_of_the_epoch():
    steps = 40
    limit = int(MAX_EARLY_SHARE * steps)
    assert start_due(limit, steps, 0.1, 60.0)  # a cold first epoch: start-up of a minute
    assert not start_due(limit + 1, steps, 0.1, 60.0)
