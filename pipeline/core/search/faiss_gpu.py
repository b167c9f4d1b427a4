"""What a FAISS index can do on GPU, checked on the configuration before any work.

Pure module: strings and numbers only (no faiss import), so a job is checked on a machine
without faiss-gpu. The limits are those of the faiss-gpu wheels (built without cuVS):
- k-selection (neighbours per query, and IVF lists probed per query) is at most 2048
  (`GPU_MAX_SELECTION_K`; searches asking more fail, or come back cut with -1 ids);
- the GPU cloner moves Flat, IVF<n>,Flat, IVF<n>,PQ<m> and IVF<n>,SQ<b> (behind optional OPQ
  or PCA pre-transforms); HNSW, NSG, fast-scan (`x4fs`), plain PQ/SQ, LSH, additive
  quantizers and refinement stay on CPU (`index_cpu_to_gpu` throws for them);
- GPU IVFPQ codes of 8 bits per sub-quantizer, with these code sizes in bytes only.
"""

from __future__ import annotations

import re

__all__ = ["GPU_MAX_K", "GPU_PQ_CODE_BYTES", "gpu_index_problems"]

GPU_MAX_K = 2048
GPU_PQ_CODE_BYTES = (1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96)

_TRANSFORM = re.compile(r"^(OPQ\d+(_\d+)?|PCAR?\d+|L2norm)$")
_COARSE = re.compile(r"^IVF\d+$")
_PQ = re.compile(r"^PQ(\d+)(x8)?(np)?$")
_SQ = re.compile(r"^SQ(4|6|8|fp16)$")


def _factory_problem(factory: str) -> str | None:
    parts = [p for p in factory.replace(" ", "").split(",") if p]
    while parts and _TRANSFORM.match(parts[0]):
        parts = parts[1:]
    supported = "Flat, IVF<n>,Flat, IVF<n>,PQ<m> or IVF<n>,SQ8 (optionally behind OPQ/PCA)"
    if parts == ["Flat"]:
        return None
    if len(parts) == 2 and _COARSE.match(parts[0]):
        if parts[1] == "Flat" or _SQ.match(parts[1]):
            return None
        pq = _PQ.match(parts[1])
        if pq:
            if int(pq.group(1)) in GPU_PQ_CODE_BYTES:
                return None
            return (
                f"index.factory '{factory}': GPU IVFPQ takes code sizes "
                f"{', '.join(map(str, GPU_PQ_CODE_BYTES))} bytes, not {pq.group(1)}"
            )
    return f"index.factory '{factory}' has no GPU implementation: use {supported}"


def gpu_index_problems(factory: str, nprobe: int, max_k: int) -> list[str]:
    """Why `factory` searched with `nprobe` lists and up to `max_k` neighbours per query cannot
    run on a faiss GPU index; empty when it can.

    Args:
        factory: a FAISS index_factory string.
        nprobe: IVF lists probed per query (ignored for Flat).
        max_k: the deepest search the label method makes (neighbours per query).
    """
    problems = []
    factory_problem = _factory_problem(factory)
    if factory_problem:
        problems.append(factory_problem)
    if "IVF" in factory and nprobe > GPU_MAX_K:
        problems.append(f"index.nprobe={nprobe} is above the GPU limit of {GPU_MAX_K}")
    if max_k > GPU_MAX_K:
        problems.append(
            f"the label method searches up to {max_k} neighbours per query, above the GPU "
            f"limit of {GPU_MAX_K} (labels.rcr.k <= {GPU_MAX_K // 32 - 1} fits)"
        )
    return problems
