"""benchmarks/gpu_check.py in its CPU mode: the kernels part runs every step at tiny sizes and
prints JSON lines without importing Ray, pydantic or webdataset; the FAISS smoke fails under
faiss-cpu with the sentence naming the wheel, so the GPU index is skipped with that reason; a
missing dependency of the pipeline part is named, not a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
HEAVY = ("ray", "pydantic", "webdataset")

# Runs the check in this interpreter's child, then reports what it imported and its status.
RUNNER = """\
import json, runpy, sys
{block}
sys.argv = ["gpu_check.py", *{argv!r}]
try:
    runpy.run_path({script!r}, run_name="__main__")
    code = 0
except SystemExit as exc:
    code = exc.code
loaded = sorted(m for m in {heavy!r} if m in sys.modules and sys.modules[m] is not None)
print(json.dumps({{"figure": "runner", "exit": code, "imported": loaded}}))
"""


def _run(argv: list[str], block: str = "") -> dict[str, dict]:
    code = RUNNER.format(block=block, argv=argv, script=str(SCRIPT), heavy=HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True
    )
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    figures = {line["figure"]: line for line in lines}
    assert len(figures) == len(lines), lines  # one line per figure
    return figures


def test_kernels_part_on_cpu():
    figures = _run(["--part", "kernels", "--device", "cpu"])
    assert figures["runner"] == {"figure": "runner", "exit": 0, "imported": []}
    assert figures["environment"]["device"] == "cpu"
    smoke = figures["faiss_smoke"]
    assert smoke["ok"] is False and "faiss-cpu" in smoke["problem"]
    assert "faiss-gpu>=1.14" in smoke["problem"]
    assert "smoke failed" in figures["faiss_gpu"]["skipped"]
    encode = figures["encode"]
    assert encode["pairs"] == 32 and encode["pairs_per_s"] > 0
    assert 0 < encode["ratio_to_forward"] < 5
    step = figures["coteach_step"]
    assert step["finite"] and len(step["losses"]) == 2
    cpu = figures["faiss_cpu"]
    assert cpu["n"] == 10_000 and cpu["self_first"] > 0.95  # each vector finds itself first
    assert "seconds" in figures["kernels"]


def test_pipeline_part_names_a_missing_dependency():
    # A Python where `import ray` fails (sys.modules[name] = None is how Python blocks one).
    figures = _run(["--part", "pipeline", "--device", "cpu"], block="sys.modules['ray'] = None")
    assert figures["runner"]["exit"] == 2
    assert figures["pipeline"] == {
        "figure": "pipeline",
        "skipped": "missing: pip install ray[default,data]",
    }
