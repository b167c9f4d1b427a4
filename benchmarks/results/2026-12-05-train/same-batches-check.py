"""Hashes of every epoch's training batches of one view on rank R of a 2-rank world, with the
data code of the tree given, so the per-epoch pipelines (before 388ba13) and the per-round one
can be compared: run once per tree and rank, then compare the JSON files.

    PYTHONPATH=<tree> python same-batches-check.py <tree> <rank> <out.json>
"""

import hashlib
import importlib
import json
import sys
import types
from pathlib import Path


def main() -> None:
    tree, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.path[:0] = [tree, f"{tree}/benchmarks"]
    bt = importlib.import_module("train")  # benchmarks/train.py: the corpus and spec helpers
    data = importlib.import_module("pipeline.stages.train.data")
    from pipeline.models import ModelSpec
    from pipeline.runtime.ray import init_ray
    from pipeline.stages.train import ViewSpec

    init_ray(None, num_cpus=2)
    tmp, epochs = "/tmp/cmp-batches-corpus", 4
    corpus = bt.demo_corpus(tmp, types.SimpleNamespace(samples=1200, noise=0.4), 100, 64)
    train = bt.train_config(64, 1e-3, epochs, False, f"{tmp}/pixels", 20.0)
    spec = bt.train_spec(corpus, f"{tmp}/run", views=(), mode="warmup", epochs=epochs, train=train)
    view = ViewSpec("A", ModelSpec("ncl-tiny", None), seed=3)

    def digest(batch) -> str:
        h = hashlib.sha256()
        for name in sorted(batch):
            h.update(name.encode())
            h.update(batch[name].cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    got: dict[int, list[str]] = {}
    if hasattr(data, "round_batches"):
        for epoch, batch in data.round_batches(spec, view, 0, rank, 2):
            got.setdefault(epoch, []).append(digest(batch))
    else:
        for epoch in range(epochs):
            got[epoch] = [digest(b) for b in data.epoch_batches(spec, view, epoch, rank, 2)]
    Path(out).write_text(json.dumps(got))
    print({epoch: len(hashes) for epoch, hashes in got.items()})


if __name__ == "__main__":
    main()
