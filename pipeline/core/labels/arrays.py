"""Small array helpers shared by the label methods."""

from __future__ import annotations

import numpy as np

__all__ = ["check_rows", "rowdot"]


def rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(Q,) float64 row-wise inner products of two (Q, D) arrays (exact f32 products)."""
    dots: np.ndarray = (np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)).sum(
        axis=-1
    )
    return dots


def check_rows(name: str, array: np.ndarray, rows: int) -> np.ndarray:
    """`array` as an ndarray, after checking it has `rows` rows."""
    array = np.asarray(array)
    if array.shape[0] != rows:
        raise ValueError(f"{name} has {array.shape[0]} rows, expected {rows}")
    return array
