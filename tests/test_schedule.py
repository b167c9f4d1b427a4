"""Learning-rate schedule and the adaptive warm-up decision."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from pipeline.core.schedule import WarmupState, chance_loss, cosine_lr, update_warmup


@given(total=st.integers(1, 5000), warm=st.integers(0, 500), base=st.floats(1e-8, 1.0))
def test_cosine_lr_is_bounded_and_ends_low(total, warm, base):
    lrs = [cosine_lr(s, total, warm, base) for s in range(0, total + 1, max(1, total // 50))]
    assert all(0 <= lr <= base * (1 + 1e-12) for lr in lrs)
    assert cosine_lr(total + warm + 10, total + warm, warm, base) <= 1e-12 + 0.0


def test_cosine_lr_warms_up_linearly():
    assert math.isclose(cosine_lr(0, 100, 10, 1.0), 0.1)
    assert math.isclose(cosine_lr(9, 100, 10, 1.0), 1.0)
    assert math.isclose(cosine_lr(10, 100, 10, 1.0), 1.0)
    assert math.isclose(cosine_lr(55, 100, 10, 1.0), 0.5)


def _run(losses, rsums, max_epochs=10, patience=2):
    state = WarmupState()
    history = []
    for loss, rsum in zip(losses, rsums, strict=True):
        state = update_warmup(
            state,
            epoch_loss=loss,
            batch_size=128,
            rsum=rsum,
            max_epochs=max_epochs,
            patience=patience,
        )
        history.append(state)
        if state.stopped:
            break
    return history


def test_no_stop_while_on_the_plateau_even_if_recall_is_flat():
    plateau = chance_loss(128)
    history = _run([plateau] * 5 + [0.5 * plateau] * 3, [3.0] * 8, max_epochs=8)
    assert not any(h.left_plateau for h in history[:5])
    assert history[5].left_plateau
    assert history[-1].reason.startswith("reached the maximum")


def test_stops_when_recall_stops_improving_after_the_plateau():
    low = 0.5 * chance_loss(128)
    history = _run([low] * 10, [10, 20, 30, 29, 28, 40, 50, 60, 70, 80])
    assert history[-1].stopped and history[-1].epochs_done == 5
    assert history[-1].best_epoch == 3 and "did not improve" in history[-1].reason


def test_without_a_test_split_warmup_runs_to_the_maximum():
    history = _run([1.0] * 4, [None] * 4, max_epochs=4)
    assert history[-1].stopped and history[-1].best_epoch is None
