"""Labelled runs for the export, loader and label-reader tests.

`pipeline_run(root)` writes a synthetic corpus (4 shards of 150 pairs, a few corrupt samples)
and runs the real pipeline on it (local Ray, the packaged ncl-tiny model at random init, no
warm-up, no co-teaching rounds), so `root/run/labels/` holds published label tables. The
session fixture `pipeline_run` (conftest.py) builds it once for every module that reads it.
`truth_labelled_corpus(root)` writes label tables from the ground truth, without a model.
"""

from __future__ import annotations

from pathlib import Path

JOB = """
name: labels-test
input: {{shards: "{corpus}/{{00000..00003}}.tar"}}
output: {output}
model: {{name: ncl-tiny, pretrained: null}}
embed: {{batch_size: 32, gpus_per_worker: 0, cpus_per_worker: 1, decode_threads: 2, concurrency: 2}}
labels: {{method: bicro}}
index: {{shards: 2}}
train: {{warmup_epochs: 0, rounds: 0}}
eval: {{ground_truth: {corpus}/ground_truth.parquet}}
seed: 5
"""


def pipeline_run(root: Path) -> dict:
    """{"corpus", "run", "job", "paths", "metrics", "summary" (round 1 view a's label pass),
    "log" (the console lines)}."""
    from log_capture import console_output

    from pipeline.config import load_job
    from pipeline.data.synthetic import make_corpus
    from pipeline.run.runner import resolve_inputs, run_job

    corpus = root / "demo"
    make_corpus(
        corpus,
        samples=600,
        noise=0.4,
        partial=0.1,
        seed=4,
        samples_per_shard=150,
        test_samples=0,
        corrupt=0.03,
    )
    job_file = root / "job.yaml"
    job_file.write_text(JOB.format(corpus=corpus, output=root / "run"))
    job = load_job(job_file)
    # run_job labels round 1 (no warm-up, no co-teaching: the initial models) and publishes.
    with console_output() as lines:
        metrics = run_job(job)
    return {
        "corpus": corpus,
        "run": root / "run",
        "job": job,
        "paths": resolve_inputs(job),
        "metrics": metrics,
        "summary": metrics["rounds"]["1"]["labels_a"],
        "log": lines,
    }


def truth_labelled_corpus(root: Path, *, seed: int = 11) -> dict:
    """A corpus with `labels.v3` tables made from its ground truth, without running a model.

    8 shards of 30 pairs (a few corrupt samples, left out of the tables as the pipeline would
    quarantine them). soft_label is the ground-truth degree (1 clean, 0.5 partial, 0 mismatched)
    moved by a seeded ±0.05, clipped to [0, 1]; subset clean / quasi_clean / noisy by kind;
    `ncl.shard_path` names the tar, as the published tables do. Returns {"corpus", "run",
    "labels": pyarrow.Table of every row}.
    """
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.core.labels import SCORE_COLUMNS
    from pipeline.data.synthetic import make_corpus
    from pipeline.io.labels import LABELS_SCHEMA, SUBSET_VALUES, labels_file_metadata, uid_of
    from pipeline.io.tables import write_table_atomic

    corpus, run = root / "corpus", root / "run"
    make_corpus(
        corpus,
        samples=240,
        noise=0.4,
        partial=0.2,
        seed=seed,
        samples_per_shard=30,
        test_samples=0,
        corrupt=0.02,
    )
    truth = pq.read_table(corpus / "ground_truth.parquet")
    truth = truth.filter(pc.is_null(truth.column("corrupt")))
    rng = np.random.default_rng(seed)
    subset_of = {"clean": "clean", "partial": "quasi_clean", "mismatched": "noisy"}
    tables = []
    for shard in sorted(set(truth.column("shard").to_pylist())):
        rows = truth.filter(pc.equal(truth.column("shard"), shard))
        n = rows.num_rows
        keys = rows.column("key").to_pylist()
        degree = rows.column("degree").to_numpy().astype(np.float64)
        label = np.clip(degree + rng.uniform(-0.05, 0.05, n), 0.0, 1.0).astype(np.float32)
        subsets = [subset_of[k] for k in rows.column("kind").to_pylist()]
        codes = pa.array([SUBSET_VALUES.index(s) for s in subsets], pa.int8())
        nulls = pa.nulls(n, pa.float32())
        columns = {
            "key": keys,
            "shard": [shard] * n,
            "url": [f"https://example.invalid/img/{k}.jpg" for k in keys],
            "caption": rows.column("noisy_caption"),
            "soft_label": label,
            "clean_prob": label,
            "subset": pa.DictionaryArray.from_arrays(codes, pa.array(SUBSET_VALUES)),
            "loss": np.zeros(n, np.float32),
            "cosine": np.zeros(n, np.float32),
            **{name: nulls for name in SCORE_COLUMNS},  # every method's score: not computed
            "image_anchor_key": pa.nulls(n, pa.string()),
            "text_anchor_key": pa.nulls(n, pa.string()),
            "round": np.ones(n, np.int16),
            "uid": [uid_of(k) for k in keys],
            "image_sha256": [hashlib.sha256(k.encode()).hexdigest() for k in keys],  # unused
        }
        metadata = labels_file_metadata(
            pipeline_version="test",
            job_hash="truth",
            model_id="ground-truth",
            mixture={},
            extra={"ncl.shard_path": str(corpus / f"{shard}.tar")},
        )
        schema = LABELS_SCHEMA.with_metadata(metadata)
        table = pa.table([columns[name] for name in schema.names], schema=schema)
        write_table_atomic(table, f"{run}/labels/{shard}.parquet", schema)
        tables.append(table.replace_schema_metadata(None))
    return {"corpus": corpus, "run": run, "labels": pa.concat_tables(tables)}
