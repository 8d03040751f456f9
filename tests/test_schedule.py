from __future__ import annotations

import pytest

from training.optim.schedule import learning_rate


def test_warmup_then_cosine_to_min_lr():
    lr = [learning_rate(s, 10, 100, 6e-4, 6e-5) for s in range(120)]
    assert lr[0] == pytest.approx(6e-5) and lr[9] == pytest.approx(6e-4)
    assert all(a < b for a, b in zip(lr[:10], lr[1:10]))
    assert all(a >= b for a, b in zip(lr[10:100], lr[11:100]))
    assert lr[55] == pytest.approx((6e-4 + 6e-5) / 2)
    assert lr[100] == lr[119] == pytest.approx(6e-5)


def test_a_warmup_that_never_ends_is_one_warning():
    """Issue 44: the 24 GB configs shrunk to 3 steps trained at lr 8e-7 (warmup 715) without a word."""
    from training.optim.schedule import ScheduleSettings

    assert ScheduleSettings(max_steps=3, warmup_steps=715).warning() == (
        "warmup_steps 715 >= max_steps 3: the schedule never leaves its warmup; the lr goes from 8.392e-07 at step 0 "
        "to 2.517e-06 at the last step (max_lr 0.0006) and never decays; lower warmup_steps")
    assert ScheduleSettings(max_steps=715, warmup_steps=715).warning() is not None  # max_lr at the end, no decay
    assert ScheduleSettings(max_steps=716, warmup_steps=715).warning() is None
    assert ScheduleSettings().warning() is None
