"""A job whose input shards and run directory are on an S3-compatible store (shared storage
for a cluster), against a real S3 API server on loopback (moto's server mode), through
fsspec/s3fs: the client code is the same as against AWS S3 or MinIO."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from moto.server import ThreadedMotoServer
from s3_faults import FaultProxy

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


# The retry settings of docs/failures.md ("Flaky object storage"): botocore's standard retry
# mode (503 SlowDown, connection errors, read timeouts) with more attempts and a read timeout a
# stalled request cannot outlast, given to every s3fs filesystem of the driver and of the Ray
# workers (which inherit the environment) through fsspec's per-protocol configuration.
S3_RETRIES = {
    "config_kwargs": {
        "connect_timeout": 5,
        "read_timeout": 5,
        "retries": {"mode": "standard", "max_attempts": 10},
    }
}


def _run_job(tmp_path, output: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(bucket=BUCKET).replace(f"s3://{BUCKET}/run", output))
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", str(job)],
        cwd=tmp_path,  # a path that lost its s3:// would land here
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def s3_corpus(s3_env, tmp_path_factory):
    import s3fs

    local = tmp_path_factory.mktemp("s3") / "corpus"
    corpus = make_corpus(
        local, samples=120, samples_per_shard=60, test_samples=0, image_size=32, seed=6
    )
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    fs.put(f"{local}/", f"{BUCKET}/corpus/", recursive=True)
    return corpus


def test_a_job_reads_and_writes_s3(s3_env, s3_corpus, tmp_path):
    import s3fs

    corpus = s3_corpus
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    result = _run_job(tmp_path, f"s3://{BUCKET}/run", {})
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


def _sorted_labels(run: str) -> dict[str, list]:
    table = read_labels(run).to_table(columns=["key", "soft_label", "clean_prob", "subset"])
    table = table.sort_by("key")
    return {name: table.column(name).to_pylist() for name in table.schema.names}


def test_a_job_through_a_flaky_object_store_gives_the_same_labels(s3_env, s3_corpus, tmp_path):
    """503 SlowDown, responses cut mid-body and requests stalled past the read timeout, all
    through a proxy in front of the server: the retries absorb them and the labels are those
    of a run against the clean server."""
    import s3fs

    if not s3fs.S3FileSystem(skip_instance_cache=True).exists(f"{BUCKET}/run/labels/_CURRENT"):
        clean = _run_job(tmp_path, f"s3://{BUCKET}/run", {})  # run alone: the clean run first
        assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    proxy = FaultProxy(
        s3_env["AWS_ENDPOINT_URL"], seed=3, slowdown=0.08, cut=0.05, delay=0.01, delay_s=6
    ).start()
    try:
        env = {"AWS_ENDPOINT_URL": proxy.url, "FSSPEC_S3": json.dumps(S3_RETRIES)}
        result = _run_job(tmp_path, f"s3://{BUCKET}/flaky", env)
    finally:
        proxy.stop()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert proxy.counts["slowdown"] and proxy.counts["cut"] and proxy.counts["delay"], proxy.counts
    assert _sorted_labels(f"s3://{BUCKET}/flaky") == _sorted_labels(f"s3://{BUCKET}/run")


def _upload(fs, path: str, data: bytes, part: int = 5 * 2**20) -> None:
    """`data` as a multipart upload of `part`-sized parts (as open_atomic's handle writes)."""
    with fs.open(path, "wb", block_size=part) as handle:
        for start in range(0, len(data), part):
            handle.write(data[start : start + part])


def test_an_upload_cut_midway_leaves_no_partial_object(s3_env):
    """A multipart upload whose connection drops: the object is absent (no retries) or
    complete (retried), never a prefix of it; so is a table written by write_table_atomic."""
    import s3fs

    data = os.urandom(12 * 2**20)  # three 5 MiB parts
    proxy = FaultProxy(s3_env["AWS_ENDPOINT_URL"]).start()
    proxy.cut_when = lambda method, query: method == "PUT" and "partNumber=2" in query
    try:
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            client_kwargs={"endpoint_url": proxy.url},
            config_kwargs={"retries": {"mode": "standard", "max_attempts": 1}},
        )
        fs.retries = 1  # s3fs's own retries too: the cut must reach the writer
        fs.mkdirs(f"{BUCKET}/cut", exist_ok=True)
        with pytest.raises(Exception):  # noqa: B017,PT011 - whatever the client raises
            _upload(fs, f"{BUCKET}/cut/big.bin", data)
        assert proxy.counts["dropped"]
        assert not fs.exists(f"{BUCKET}/cut/big.bin")
        # Retried (one cut, then the part goes through): the whole object.
        cuts = iter([True])
        proxy.cut_when = lambda method, query: (
            method == "PUT" and "partNumber=2" in query and next(cuts, False)
        )
        retrying = s3fs.S3FileSystem(
            skip_instance_cache=True,
            client_kwargs={"endpoint_url": proxy.url},
            config_kwargs=S3_RETRIES["config_kwargs"],
        )
        _upload(retrying, f"{BUCKET}/cut/big.bin", data)
        assert retrying.cat_file(f"{BUCKET}/cut/big.bin") == data
    finally:
        proxy.stop()
