from __future__ import annotations

import pytest

from training.train.schedule import learning_rate


def test_warmup_then_cosine_to_min_lr():
    lr = [learning_rate(s, 10, 100, 6e-4, 6e-5) for s in range(120)]
    assert lr[0] == pytest.approx(6e-5) and lr[9] == pytest.approx(6e-4)
    assert all(a < b for a, b in zip(lr[:10], lr[1:10]))
    assert all(a >= b for a, b in zip(lr[10:100], lr[11:100]))
    assert lr[55] == pytest.approx((6e-4 + 6e-5) / 2)
    assert lr[100] == lr[119] == pytest.approx(6e-5)
