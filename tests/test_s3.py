"""A job whose input shards and run directory are on an S3-compatible store (shared storage
for a cluster), against a real S3 API server on loopback (moto's server mode), through
fsspec/s3fs: the client code is the same as against AWS S3 or MinIO."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from moto.server import ThreadedMotoServer

from pipeline.clients.read import read_labels
from pipeline.data.synthetic import make_corpus
from pipeline.io.labels import SUBSET_VALUES

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.own_ray]
ROOT = Path(__file__).resolve().parents[1]
BUCKET = "ncl-test"

JOB = """
name: s3
input: {{shards: "s3://{bucket}/corpus/{{00000..00001}}.tar"}}
output: s3://{bucket}/run
model: {{name: ncl-tiny, pretrained: null}}
embed: {{batch_size: 32, gpus_per_worker: 0, cpus_per_worker: 1, decode_threads: 1, concurrency: 1}}
mixture: {{kind: gmm}}
labels: {{method: bicro}}
train:
  rounds: 0                 # the warm-up only: round 1 embeds with its checkpoints (on S3)
  warmup_epochs: 1
  batch_size: 32
  lr: 2.0e-3
  torch_threads: 1
eval: {{ground_truth: "s3://{bucket}/corpus/ground_truth.parquet"}}
ray: {{address: null, num_cpus: 2}}
seed: 1
"""


@pytest.fixture(scope="module")
def s3_env():
    """A moto S3 server on 127.0.0.1 and the standard AWS variables that point s3fs (and
    every Ray worker, which inherits the driver's environment) at it."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_a_job_reads_and_writes_s3(s3_env, tmp_path):
    import s3fs

    local = tmp_path / "corpus"
    corpus = make_corpus(
        local, samples=120, samples_per_shard=60, test_samples=0, image_size=32, seed=6
    )
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    fs.put(f"{local}/", f"{BUCKET}/corpus/", recursive=True)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(bucket=BUCKET))
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(job)],
        cwd=tmp_path,  # a path that lost its s3:// would land here
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    written = set(fs.find(f"{BUCKET}/run"))
    for name in ("manifest.json", "metrics.json", "labels/_CURRENT", "report/index.html"):
        assert f"{BUCKET}/run/{name}" in written, sorted(written)
    assert not (tmp_path / BUCKET).exists()  # nothing written to a local look-alike path
    assert f"{BUCKET}/run/labels/gen-1/00000.parquet" in written
    assert f"{BUCKET}/run/rounds/0/checkpoints/A/model.pt" in written
    assert not any("/_restore/" in path for path in written)  # index restore tables removed

    labels = read_labels(f"s3://{BUCKET}/run").to_table()
    truth = pq.read_table(corpus.ground_truth)
    assert sorted(labels.column("key").to_pylist()) == sorted(truth.column("key").to_pylist())
    assert set(labels.column("subset").to_pylist()) <= set(SUBSET_VALUES)
