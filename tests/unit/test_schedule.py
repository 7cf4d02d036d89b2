import math

import pytest
import torch

from paratrain.engine.schedule import build_scheduler, effective_lr, lr_factor


def test_cosine_runs_from_one_to_lrf():
    epochs, lrf = 10, 0.1
    values = [lr_factor(e, epochs, lrf) for e in range(epochs + 1)]
    assert values[0] == pytest.approx(1.0)
    assert values[epochs] == pytest.approx(lrf)
    assert values[5] == pytest.approx((1 + math.cos(math.pi / 2)) / 2 * 0.9 + 0.1)
    assert all(a > b for a, b in zip(values, values[1:], strict=False))


def test_warmup_ramps_linearly_then_cosine():
    f = [lr_factor(e, 10, 0.1, warmup_epochs=3) for e in range(10)]
    assert f[:3] == pytest.approx([0.25, 0.5, 0.75])
    assert f[3] == pytest.approx(1.0)
    assert f[3:] == sorted(f[3:], reverse=True)


def test_linear_scaling_rule():
    assert effective_lr(0.01, 4, "linear") == pytest.approx(0.04)
    assert effective_lr(0.01, 4, "none") == pytest.approx(0.01)


def test_scheduler_sets_optimizer_lr_per_epoch():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    sched = build_scheduler(opt, epochs=4, lrf=0.1, warmup_epochs=0)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.2 * lr_factor(e, 4, 0.1) for e in range(4)])
