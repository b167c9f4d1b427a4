"""Wall clock vs busy time of the CPU embed pass, one 2-CPU worker (W=1) or two 1-CPU ones
(W=2), on a corpus of few large shards (CORPUS; made with
`make_corpus(out, samples=16000, samples_per_shard=4000, test_samples=0, seed=1)`).

    W=1 CORPUS=/tmp/embed-16k-big python benchmarks/results/2026-12-05-embed/pass-timing.py
"""

import glob
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from pipeline.runtime.ray import apply_loopback_defaults, init_ray  # noqa: E402

apply_loopback_defaults()
from pipeline.config import EmbedConfig  # noqa: E402
from pipeline.models import ModelSpec  # noqa: E402
from pipeline.stages.embed import EmbedSpec, run_embed_pass  # noqa: E402

workers = int(os.environ.get("W", "2"))
init_ray(None, num_cpus=2)
shards = sorted(glob.glob(os.environ["CORPUS"] + "/[0-9]*.tar"))
model = ModelSpec("ncl-tiny", None, "fp32", seed=0)
embed = EmbedConfig(
    batch_size=256,
    decode="cpu",
    concurrency=workers,
    cpus_per_worker=2 / workers,
    decode_threads=2 // workers,
    gpus_per_worker=0,
)
for rep in range(3):  # the first pass starts the pooled workers
    with tempfile.TemporaryDirectory() as out:
        spec = EmbedSpec(output=out, round_index=0, views={"a": model}, seed=0, embed=embed)
        started = time.perf_counter()
        summary = run_embed_pass(spec, shards)
        wall = time.perf_counter() - started
        busy = summary["actor_seconds"] / workers
        pairs = summary["embedded"]
        print(
            f"W={workers} pass {rep}: wall {wall:.2f} s, busy per worker {busy:.2f} s, "
            f"{pairs / wall:.0f} pairs/s end to end",
            flush=True,
        )
