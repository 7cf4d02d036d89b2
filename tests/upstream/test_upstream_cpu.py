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
    "paratrain gives the late parameters zero buffers first (engine/run/recipe.py, "
    "_missing_buffers)",
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
    from paratrain.engine.run.recipe import StorageOrderSGD

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


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="torch 2.14 fused SGD (torch/optim/sgd.py, _fused_sgd) makes the first step's "
    "momentum buffers with empty_like and its kernel returns before writing them when "
    "found_inf is set (a GradScaler's overflow, a skipped step): the next step reads "
    "garbage. Seen on CUDA (torch 2.11) as a NaN after an fp16 overflow, as "
    "LibreYOLO/libreyolo#771 describes; no upstream issue found. paratrain gives such a "
    "step zero buffers first (engine/run/recipe.py, _missing_buffers)",
)
def test_fused_sgd_after_a_skipped_first_step():
    """A first step skipped through found_inf, then one finite step: the weights must be
    those of one plain SGD step (here, after one skipped step, they are not)."""
    for _ in range(20):  # freed memory full of garbage, for empty_like to hand out
        torch.full((4096,), float("nan")).sum()
    weight = torch.nn.Parameter(torch.zeros(4096))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9, fused=True)
    optimizer.found_inf, optimizer.grad_scale = torch.ones(()), torch.ones(())
    weight.grad = torch.full((4096,), float("inf"))
    optimizer.step()  # skipped
    optimizer.found_inf = torch.zeros(())
    weight.grad = torch.ones(4096)
    optimizer.step()
    assert torch.equal(weight.detach(), torch.full((4096,), -0.1))


def test_paratrain_sgd_after_a_grad_scalers_skipped_first_step_is_plain_sgd():
    """Through torch's GradScaler, as 16-mixed runs it: an overflow on the first step is
    skipped, and the next step lands where one plain SGD step does, to the bit."""
    from paratrain.engine.run.recipe import StorageOrderSGD

    for _ in range(20):
        torch.full((4096,), float("nan")).sum()
    grad = torch.randn(64, 8, 3, 3)
    start = torch.randn(64, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    weight = torch.nn.Parameter(start.clone())
    optimizer = StorageOrderSGD([weight], lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.ones(()))  # the scale exists from the first scale() on
    weight.grad = torch.full_like(start, float("inf"))
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**15 and torch.equal(weight.detach(), start)
    weight.grad = (grad * scaler.get_scale()).contiguous(memory_format=torch.channels_last)
    scaler.step(optimizer)
    scaler.update()
    plain = torch.nn.Parameter(start.clone())
    reference = torch.optim.SGD([plain], lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=False)
    plain.grad = grad.clone()
    reference.step()
    assert torch.allclose(weight.detach(), plain.detach(), rtol=0, atol=1e-6)
    assert torch.isfinite(optimizer.state[weight]["momentum_buffer"]).all()


def _cpu_has_bf16_kernels() -> bool:
    """AVX512-BF16 or AMX: the CPUs whose oneDNN bf16 convolutions were measured to get
    it wrong (29/30 tries on an AMX CPU, 24/30 on an AVX512-BF16 one without AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.mark.skipif(
    not _cpu_has_bf16_kernels(), reason="measured wrong on AVX512-BF16 and AMX CPUs only"
)
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="torch 2.14.1 CPU bf16: a 3x3 stride-2 convolution over a 1x1 input gets a "
    "weight gradient far from fp32's (even inf) at the taps that see only padding; no "
    "upstream issue found. paratrain runs such convolutions in fp32 "
    "(models/cpu_bf16.py; set its FIXED_IN when this passes)",
)
def test_bf16_weight_gradient_of_a_strided_convolution_over_one_pixel():
    torch.manual_seed(0)
    errors = []
    for _ in range(10):
        weight = torch.randn(64, 64, 3, 3)
        x, grad = torch.randn(8, 64, 1, 1), torch.randn(8, 64, 1, 1)
        exact = weight.clone().requires_grad_()
        torch.nn.functional.conv2d(x, exact, stride=2, padding=1).backward(grad)
        half = weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.nn.functional.conv2d(x, half, stride=2, padding=1)
        out.backward(grad.bfloat16())
        errors.append(float((half.grad.float() - exact.grad).norm() / exact.grad.norm()))
    assert all(e < 0.05 for e in errors), f"relative errors against fp32: {errors}"


def test_the_bf16_detour_is_gated_by_the_torch_version(monkeypatch):
    from paratrain.models import cpu_bf16

    assert cpu_bf16.FIXED_IN is None and cpu_bf16.affected("2.14.1")  # every release yet
    monkeypatch.setattr(cpu_bf16, "FIXED_IN", (2, 16))
    assert cpu_bf16.affected("2.15.2+cpu") and not cpu_bf16.affected("2.16.0")
    assert not cpu_bf16.affected("3.0.0a0+git1234")


@pytest.mark.xfail(
    strict=True,
    raises=torch._dynamo.exc.InternalTorchDynamoError,
    reason="torch 2.14's dynamo traces torch.utils.checkpoint with a context_fn only under "
    "torch._dynamo.config._experimental_support_context_fn_in_torch_utils_checkpoint "
    "(torch/_higher_order_ops/wrap.py; seen by others: NVIDIA/TransformerEngine#890). "
    "paratrain's checkpointed blocks keep BatchNorm's statistics in a context_fn, so "
    "--activation-checkpointing with --compile is refused in one line (config/train.py)",
)
def test_compile_traces_a_checkpoint_with_a_context_fn():
    import contextlib

    from torch.utils.checkpoint import checkpoint

    layer = torch.nn.Linear(4, 4)

    def forward(x):
        both = (contextlib.nullcontext(), contextlib.nullcontext())
        return checkpoint(layer, x, use_reentrant=False, context_fn=lambda: both)

    torch.compile(forward, backend="eager")(torch.ones(2, 4, requires_grad=True)).sum().backward()
    assert layer.weight.grad is not None
