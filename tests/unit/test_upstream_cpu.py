"""Upstream bugs paratrain works around, each as its smallest plain-torch reproduction,
marked xfail(strict=True): the day torch fixes one, its test passes, the suite fails,
and the workaround can go."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.xfail(
    strict=True,
    raises=TypeError,
    reason="torch 2.14 fused SGD (torch/optim/sgd.py, _fused_sgd: is_first_step is "
    "all-or-none) cannot step when some parameters have momentum buffers and others "
    "first get a gradient later, as a thawed backbone does; no upstream issue found. "
    "paratrain gives the late parameters zero buffers first (engine/recipe.py, "
    "_late_buffers)",
)
def test_fused_sgd_steps_parameters_that_join_late():
    early, late = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([early, late], lr=0.1, momentum=0.9, fused=True)
    early.grad = torch.ones(3)
    optimizer.step()  # late has no gradient yet: no buffer
    early.grad, late.grad = torch.ones(3), torch.ones(3)
    optimizer.step()
    assert torch.allclose(late, torch.full((3,), 0.9))


def test_paratrain_sgd_steps_parameters_that_join_late_as_unfused_sgd_does():
    from paratrain.engine.recipe import StorageOrderSGD

    results = []
    for kind in (StorageOrderSGD, torch.optim.SGD):
        early, late = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
        fused = {"fused": True} if kind is StorageOrderSGD else {"foreach": False}
        optimizer = kind([early, late], lr=0.1, momentum=0.9, weight_decay=0.01, **fused)
        for step in range(3):
            early.grad = torch.full((3,), float(step + 1))
            late.grad = torch.full((3,), 2.0) if step else None
            optimizer.step()
        results.append((early.detach().clone(), late.detach().clone()))
    assert torch.allclose(results[0][0], results[1][0])
    assert torch.allclose(results[0][1], results[1][1])
