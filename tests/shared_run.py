"""The suite's one small corpus and one job, shared by the rerun, co-teaching, broken-shard,
fault and damaged-run tests, so their runs can share one another's stages.

- `write_corpus(root)`: 4 shards of 80 pairs (32 px, 40% mismatched, 10% partial) and a test
  split of 60; the jobs read shards 0-2, shard 3 is what a rerun test adds.
- `write_job(corpus, output, *overrides)`: the job as a YAML file beside `output` (a random-init
  ncl-tiny, BiCro, a Flat index in 2 shards, one warm-up epoch, no co-teaching round), with
  `key=value` overrides as `--set` takes them.
- `warmed_run(root)`: the job run up to its warm-up on the session's local Ray (conftest's
  `warmed_run` fixture); a test copies it (`copy_run`) and its own job reuses those stages
  when the stage keys match, which the run state checks, not this module.
- conftest's `cli_reference` fixture: the job run to its end by the CLI on a Ray of its own,
  the undisturbed run the fault tests compare with.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

SHARDS = 3  # the shards the job reads; the corpus has one more
PAIRS_PER_SHARD = 80

JOB = """
name: shared
input: {shards: "CORPUS/{00000..00002}.tar"}
output: OUTPUT
model: {name: ncl-tiny, pretrained: null}
embed: {batch_size: 32, gpus_per_worker: 0, cpus_per_worker: 1, decode_threads: 1, concurrency: 1}
mixture: {kind: gmm}
labels: {method: bicro}
index: {factory: Flat, shards: 2}
train:
  rounds: 0
  warmup_epochs: 1
  epochs_per_round: 1
  batch_size: 32
  lr: 2.0e-3
  lr_warmup_steps: 4
  weight_decay: 0.1
  torch_threads: 1
  checkpoint_every_steps: 2
eval: {ground_truth: CORPUS/ground_truth.parquet, test_shards: CORPUS/test/00000.tar}
ray: {address: null, num_cpus: 2}
seed: 4
"""


def write_corpus(root: Path) -> Path:
    from pipeline.data.synthetic import make_corpus

    make_corpus(
        root,
        samples=(SHARDS + 1) * PAIRS_PER_SHARD,
        samples_per_shard=PAIRS_PER_SHARD,
        noise=0.4,
        partial=0.1,
        test_samples=60,
        image_size=32,
        seed=11,
    )
    return root


def shard_pattern(corpus: Path, shards: int = SHARDS) -> str:
    return f"{corpus}/{{00000..{shards - 1:05d}}}.tar"


def write_job(corpus: Path, output: Path, *overrides: str, name: str | None = None) -> Path:
    """The job file `<output>.yaml` (or `name` beside `output`), with `a.b=value` overrides
    applied as `--set` applies them (`pipeline.config.with_overrides`)."""
    from pipeline.config import with_overrides

    text = JOB.replace("CORPUS", str(corpus)).replace("OUTPUT", str(output))
    job = with_overrides(yaml.safe_load(text), list(overrides))
    path = output.parent / (name or f"{output.name}.yaml")
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def load(corpus: Path, output: Path, *overrides: str):
    """The job model of `write_job(corpus, output, *overrides)`."""
    from pipeline.config import load_job

    return load_job(write_job(corpus, output, *overrides))


def warmed_run(root: Path) -> dict:
    """{"corpus", "out"}: the shared job run up to its warm-up (run_job's `until`)."""
    from pipeline.run.runner import run_job

    corpus = write_corpus(root / "corpus")
    out = root / "warmed"
    # TensorBoard on (resources only, in no stage key): the co-teaching test reads the
    # warm-up's scalars from the copy it continues.
    run_job(load(corpus, out, "train.report_to=tensorboard"), until="round0/warmup")
    return {"corpus": corpus, "out": out}


def cli_reference(root: Path) -> dict:
    """{"corpus", "out", "job"}: the shared job run to its end by the CLI (a Ray of its own)."""
    from cli_job import run_cli

    corpus = write_corpus(root / "corpus")
    out = root / "run"
    job = write_job(corpus, out)
    done = run_cli("run", str(job), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    return {"corpus": corpus, "out": out, "job": job}


def copy_run(source: Path, target: Path) -> Path:
    """A copy of the run directory `source` at `target` (a rerun there reuses its stages)."""
    shutil.copytree(source, target)
    return target
