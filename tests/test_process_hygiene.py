"""What a fresh process imports or sets up: the import-cost and side-effect rules for Ray
workers, the training controller, the CLI and library users (docs/architecture.md §4.8). Each
test runs a snippet in a new interpreter (tests/fresh_interpreter.py)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

from fresh_interpreter import run_fresh
from test_config import MINIMAL

from pipeline.config import TrainConfig
from pipeline.models import ModelSpec
from pipeline.stages.train import TrainSpec, ViewSpec

ROOT = Path(__file__).resolve().parents[1]


def test_label_pass_workers_import_no_torch():
    """What label tasks and index actors import (pipeline.stages.labels, and
    pipeline.runtime.devices for the GPU grant) loads no torch: each such worker is a fresh
    process, and importing torch there costs seconds of CPU apiece."""
    printed, loaded = run_fresh(
        "import importlib, pkgutil\n"
        "import pipeline.stages.labels as labels\n"
        "prefix = 'pipeline.stages.labels.'\n"
        "names = [m.name for m in pkgutil.walk_packages(labels.__path__, prefix)]\n"
        "for name in names + ['pipeline.runtime.devices']:\n"
        "    importlib.import_module(name)\n"
        "print(len(names))\n",
        {"torch"},
    )
    assert int(printed[0]) >= 5 and loaded == [], (printed, loaded)


def test_training_workers_and_the_driver_load_no_faiss():
    """Training workers and the driver search no index, so they import no faiss: its loader
    logs at INFO, and Ray forwards a worker's log to the job's console ("Loading faiss with
    AVX2 support", "ModuleNotFoundError(...swigfaiss_avx2)") once per training round."""
    _, loaded = run_fresh(
        "import pipeline.cli, pipeline.config, pipeline.stages.train.loop\n", {"faiss"}
    )
    assert loaded == [], loaded


def test_the_training_controller_unpickles_its_config_without_the_training_code(tmp_path):
    """What Ray Train's controller unpickles for several workers (the torch config, the
    train-loop config) loads neither open_clip nor the training stage there: in a fresh process
    those imports cost seconds of CPU per round (torch comes with Ray Train's TorchConfig)."""
    import cloudpickle

    from pipeline.runtime.rendezvous import LoopbackTorchConfig
    from pipeline.stages.train.driver import train_loop_config

    views = tuple(
        ViewSpec(name=name, init=ModelSpec("ncl-tiny", None, "fp32", seed=seed), seed=seed)
        for name, seed in (("A", 0), ("B", 1))
    )
    shards = tuple(str(tmp_path / f"{i:05d}.tar") for i in range(2))  # never opened
    spec = TrainSpec(
        output=str(tmp_path / "run"),
        round_index=0,
        views=views,
        shards=shards,
        shard_sizes={f"{i:05d}": 160 for i in range(2)},
        train=TrainConfig.model_validate({"batch_size": 64, "lr": 1e-3}),
    )
    config = LoopbackTorchConfig()
    blob = cloudpickle.dumps((config, train_loop_config(spec, None, ray_train=True)))
    (tmp_path / "config.pkl").write_bytes(blob)
    _, loaded = run_fresh(
        "import pickle\n"
        f"config, loop_config = pickle.load(open({str(tmp_path / 'config.pkl')!r}, 'rb'))\n"
        "assert config.backend_cls.__name__ and loop_config['spec']\n",
        {"open_clip", "pipeline.stages.train"},
    )
    assert loaded == [], loaded
    # The workers get the spec back whole.
    assert pickle.loads(train_loop_config(spec, None, ray_train=True)["spec"]) == spec


def test_checking_a_job_file_imports_neither_torch_nor_ray(tmp_path):
    """`validate --config-only` (an editor's or CI's lint of a job file) answers in about a
    second: torch, open_clip and Ray load only for the commands that use them, and the CLI
    recognises an error meant for the user (`UserError`) without importing where it came from."""
    job = tmp_path / "job.yaml"
    job.write_text(MINIMAL)
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from pipeline.cli import app\n"
        f"args = ['validate', {str(job)!r}, '--config-only']\n"
        "for extra in ([], ['--set', 'embed.batchsize=2']):\n"
        "    result = CliRunner().invoke(app, args + extra)\n"
        "    print(result.exit_code)\n"
        "print(sorted({'torch', 'open_clip', 'ray'} & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["0", "2", "[]"], out.stdout + out.stderr


def test_importing_pipeline_configures_no_logging():
    """Every module of the package imports without touching the root or `pipeline` logger:
    only the CLI (or the application) decides what reaches the console."""
    code = """
        import importlib, logging, pkgutil
        import pipeline

        for info in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
            if not info.name.endswith("__main__"):  # that one runs the CLI
                importlib.import_module(info.name)
        root, ours = logging.getLogger(), logging.getLogger("pipeline")
        assert root.handlers == [] and root.level == logging.WARNING, (root.handlers, root.level)
        assert ours.handlers == [] and ours.level == logging.NOTSET and ours.propagate
        print("ok")
        """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr[-3000:]
