"""benchmarks/selection.py's summary: each arm's kept fraction is picked per seed on the
validation rSum (never the test split), medians over seeds, the gates and the win."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
selection = pytest.importorskip("selection")


def _arm(seed: int, arm: str, fraction, val: float, test: float) -> dict:
    return {
        "figure": "selection_arm",
        "seed": seed,
        "arm": arm,
        "fraction": fraction,
        "precision": 0.5,
        "val_rsum": val,
        "test_rsum": {"all": test, "full": test, "short": test / 2},
        "attributes": {"mean": 0.4},
    }


def test_the_fraction_is_picked_on_validation_and_the_ratios_use_the_test_medians():
    lines = []
    for seed in (0, 1, 2):
        lines += [
            _arm(seed, "none", None, 10, 100),
            _arm(seed, "oracle", None, 10, 140 + seed),
            # f=0.5 is best on validation, f=0.3 on test: the summary must take 0.5.
            _arm(seed, "teacher", 0.3, 20, 200),
            _arm(seed, "teacher", 0.5, 30, 150),
            _arm(seed, "negclip", 0.5, 30, 140),
            _arm(seed, "teacher_in_clean", 0.5, 40, 165),
            _arm(seed, "labels_assign", 0.5, 50, 160 + seed),
            _arm(seed, "fusion_assign", 0.5, 45, 300),  # best on test, not on validation
        ]
    summary = selection.summarise(lines)
    assert summary["arms"]["teacher"]["fractions"] == [0.5, 0.5, 0.5]
    assert summary["arms"]["teacher"]["test_rsum"]["median"] == 150
    assert summary["arms"]["labels_assign"]["test_rsum"] == {
        "median": 161,
        "min": 160,
        "max": 162,
        "n": 3,
    }
    assert summary["gates"] == {"oracle_over_none": 1.41, "headroom": round(165 / 150, 3)}
    assert summary["gates_hold"] == {"oracle_over_none": True, "headroom": True}
    assert summary["best_label_arm"] == "labels_assign"
    assert summary["win"]["over_teacher"] == round(161 / 150, 3)
    assert summary["win_holds"] == {
        "over_teacher": False,
        "over_negclip": True,
        "over_teacher_in_clean": True,
    }


def test_scorer_aurocs_merge_over_invocations_one_value_per_seed():
    def scorers(seed: int, **auroc: float) -> dict:
        values = {name: {"all_mismatched": v} for name, v in auroc.items()}
        return {"figure": "selection_scorers", "seed": seed, "auroc": values}

    lines = [scorers(s, teacher=0.8, labels_rcr=0.86 + s / 100) for s in (0, 1, 2)]
    lines += [scorers(s, teacher=0.8, labels_sps=0.7) for s in (0, 1, 2)]  # a later invocation
    auroc = selection.summarise(lines)["scorer_auroc"]
    assert auroc["teacher"] == {"median": 0.8, "min": 0.8, "max": 0.8, "n": 3}
    assert auroc["labels_rcr"]["median"] == 0.87 and auroc["labels_sps"]["n"] == 3
