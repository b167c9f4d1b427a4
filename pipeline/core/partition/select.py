"""Order statistics over rows spread across shards: a radix select (docs/methods.md §3.3).

Pure module: numpy only. The partitions need "the value at sorted position k" and "the k
lowest-loss pairs, ties by sample id" over the whole corpus, yet no per-sample list may travel to
one process. Each row is ranked by a composite key (float32 value as an order-preserving uint32,
then the int64 sample id); a selection asks every shard, round by round, for a sparse histogram
of the next 16-bit digit among the rows still in play, and fetches the rows themselves once at
most `fetch_limit` remain.

Contract:
- `order_keys(values)` maps float32 values to uint64 keys < 2^32 that sort exactly like the
  values (-0.0 and 0.0 are one key); `key_value` inverts it.
- `select_round(keys, ids, prefix, fetch)` is the per-shard step; `radix_select(run_round, ...)`
  is the driver loop, given a callable that runs one round on every shard (in-process or as Ray
  tasks: the result is the same).
- A selection result `(key, id)` is a cut: `at_or_below(keys, ids, cut)` marks exactly the k
  rows it selected, in any shard.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = [
    "Cut",
    "at_or_below",
    "key_value",
    "order_keys",
    "radix_select",
    "select_round",
]

DIGITS = 6  # 16-bit digits of the composite key: 2 for the float32 value, 4 for the int64 id
Cut = tuple[int, int]  # (value key, sample id): rows with composite key <= cut are selected


def order_keys(values: np.ndarray) -> np.ndarray:
    """(N,) uint64 keys < 2^32 ordered exactly like the float32 `values` (-0.0 taken as 0.0)."""
    bits = (np.asarray(values, dtype=np.float32) + np.float32(0.0)).view(np.uint32)
    bits = bits.astype(np.uint64)
    negative = (bits >> np.uint64(31)) == 1
    keys: np.ndarray = np.where(
        negative, bits ^ np.uint64(0xFFFFFFFF), bits | np.uint64(0x80000000)
    )
    return keys


def key_value(key: int) -> float:
    """The float32 value of one key of `order_keys`."""
    bits = key ^ 0x80000000 if key & 0x80000000 else key ^ 0xFFFFFFFF
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _digit(keys: np.ndarray, ids: np.ndarray, level: int) -> np.ndarray:
    """16-bit digit `level` of the composite key (value key: levels 0-1, id: levels 2-5)."""
    digit: np.ndarray
    if level < 2:
        digit = (keys >> np.uint64(16 * (1 - level))) & np.uint64(0xFFFF)
    else:
        digit = (ids.astype(np.uint64) >> np.uint64(16 * (5 - level))) & np.uint64(0xFFFF)
    return digit


def at_or_below(keys: np.ndarray, ids: np.ndarray, cut: Cut) -> np.ndarray:
    """(N,) bool: composite (key, id) <= cut."""
    key, sample = np.uint64(cut[0]), cut[1]
    below: np.ndarray = (keys < key) | ((keys == key) & (ids <= sample))
    return below


def select_round(
    keys: np.ndarray, ids: np.ndarray, prefix: tuple[int, ...], fetch: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One radix-select round over one shard's rows.

    Args:
        keys: (N,) uint64 from `order_keys`; ids: (N,) int64 sample ids.
        prefix: the digits fixed so far.
        fetch: return the rows in play instead of a histogram.

    Returns:
        (digits, counts) int64 sparse histogram of the next digit among the rows matching
        `prefix`; or, with `fetch`, those rows' (keys, ids).
    """
    in_play = np.ones(keys.shape, dtype=bool)
    for level, digit in enumerate(prefix):
        in_play &= _digit(keys, ids, level) == np.uint64(digit)
    if fetch:
        return keys[in_play], ids[in_play]
    digits, counts = np.unique(_digit(keys[in_play], ids[in_play], len(prefix)), return_counts=True)
    return digits.astype(np.int64), counts.astype(np.int64)


def radix_select(
    run_round: Callable[[tuple[int, ...], bool], list[tuple[np.ndarray, np.ndarray]]],
    k: int,
    total: int,
    *,
    with_id: bool,
    fetch_limit: int,
) -> tuple[int, int | None, int]:
    """The k-th smallest (1-based) composite key among `total` rows spread over shards.

    Args:
        run_round: (prefix, fetch) -> the per-shard results of `select_round`.
        k: rank wanted, 1 <= k <= total.
        total: rows ranked.
        with_id: rank (value, id) pairs (unique) or values only.
        fetch_limit: fetch the rows in play once at most this many remain.

    Returns:
        (value key, id or None, number of rows with key <= the result: by value when
        `with_id` is False, exactly k otherwise).
    """
    levels = DIGITS if with_id else 2
    prefix: tuple[int, ...] = ()
    below, in_play = 0, total
    while len(prefix) < levels and in_play > fetch_limit:
        merged: dict[int, int] = {}
        for digits, counts in run_round(prefix, False):
            for d, c in zip(digits.tolist(), counts.tolist(), strict=True):
                merged[d] = merged.get(d, 0) + c
        for d in sorted(merged):
            if below + merged[d] >= k:
                prefix, in_play = (*prefix, d), merged[d]
                break
            below += merged[d]
    if len(prefix) == levels:
        key = (prefix[0] << 16) | prefix[1]
        sample = None
        if with_id:
            sample = (prefix[2] << 48) | (prefix[3] << 32) | (prefix[4] << 16) | prefix[5]
        return key, sample, below + in_play
    parts = run_round(prefix, True)
    keys = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.uint64)
    ids = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64)
    order = np.lexsort((ids, keys))
    chosen = order[k - below - 1]
    key = int(keys[chosen])
    if with_id:
        return key, int(ids[chosen]), k
    return key, None, below + int((keys <= keys[chosen]).sum())
