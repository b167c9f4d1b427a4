"""`index.factory: auto`: the FAISS factory for an index of a given size.

Pure module (strings and numbers, no faiss import), like `faiss_gpu`: the choice is made on the
driver from the pass's pair count before any actor starts. docs/scale.md gives the measured
costs behind the thresholds.
"""

from __future__ import annotations

import math

from pipeline.core.search.faiss_gpu import GPU_PQ_CODE_BYTES

__all__ = ["auto_factory"]

# `auto_factory`: exact search up to this many rows (a Flat search costs rows x queries, so
# a label pass over every pair grows with N^2); IVF beyond, its lists holding 8-bit scalar
# codes (a quarter of the bytes to scan per query, found neighbours as with full vectors once
# rescored: docs/scale.md §4), and PQ codes beyond _AUTO_PQ_ROWS, where even one byte per
# dimension per row stops fitting an actor's (or a GPU's) memory.
_AUTO_FLAT_ROWS = 50_000
_AUTO_PQ_ROWS = 4_000_000


def auto_factory(rows: int, dim: int) -> str:
    """The FAISS factory `index.factory: auto` uses for an index of `rows` vectors of `dim`.

    - up to 50k rows: "Flat" (exact; the search is cheap at this size);
    - up to 4M: "IVF<n>,SQ8", n ~ 4 sqrt(rows) as a power of two (faiss's guideline of
      4-16 sqrt(N) lists), so each query scans nprobe/n of the rows as 8-bit codes, the
      candidates rescored exactly from the stored embeddings;
    - beyond: "IVF<n>,PQ<m>", m = dim/8 bytes per vector (a GPU-supported code size), the
      scores rescored exactly from the stored embeddings by the label methods.
    Every choice also runs on faiss-gpu.
    """
    if rows <= _AUTO_FLAT_ROWS:
        return "Flat"
    lists = 1 << max(6, min(16, round(math.log2(4 * math.sqrt(rows)))))
    if rows <= _AUTO_PQ_ROWS:
        return f"IVF{lists},SQ8"
    code_bytes = max(b for b in GPU_PQ_CODE_BYTES if b <= max(1, dim // 8) and dim % b == 0)
    return f"IVF{lists},PQ{code_bytes}"
