"""paratrain's SyncBatchNorm equals one BatchNorm over the concatenated batch (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.parallel.sync_batchnorm import SyncBatchNorm
from spawn import run_distributed

pytestmark = pytest.mark.slow

BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _shape(kind: int, n: int) -> tuple[int, ...]:
    return {1: (n, 4, 5), 2: (n, 4, 5, 3), 3: (n, 4, 3, 2, 3)}[kind]


def _global_batch(kind: int, sizes: list[int]):
    torch.manual_seed(0)
    x = torch.randn(_shape(kind, sum(sizes)), dtype=torch.float32) * 3 + 1.5
    g = torch.randn_like(x)  # upstream gradient: loss = sum(out * g), additive over ranks
    return x, g


def _make_bn(kind: int) -> nn.Module:
    torch.manual_seed(1)
    bn = BN[kind](4, momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _train_steps(bn: nn.Module, x: torch.Tensor, g: torch.Tensor, channels_last: bool, steps: int):
    xs = x.clone().requires_grad_(True)
    inp = xs.to(memory_format=torch.channels_last) if channels_last else xs
    for _ in range(steps):
        bn.zero_grad()
        xs.grad = None
        out = bn(inp)
        (out * g).sum().backward()
    return {
        "out": out.detach(),
        "grad_x": xs.grad,
        "grad_w": bn.weight.grad,
        "grad_b": bn.bias.grad,
        "running_mean": bn.running_mean,
        "running_var": bn.running_var,
        "num_batches_tracked": bn.num_batches_tracked,
        "channels_last": out.is_contiguous(memory_format=torch.channels_last),
    }


def _reference(kind: int, sizes: list[int], channels_last: bool, steps: int = 2):
    x, g = _global_batch(kind, sizes)
    return _train_steps(_make_bn(kind), x, g, channels_last, steps)


def _sync_rank(rank, world, kind, sizes, channels_last, steps=2):
    x, g = _global_batch(kind, sizes)
    start = sum(sizes[:rank])
    x, g = x[start : start + sizes[rank]], g[start : start + sizes[rank]]
    bn = SyncBatchNorm.convert(_make_bn(kind))
    assert isinstance(bn, SyncBatchNorm)
    return _train_steps(bn, x, g, channels_last, steps)


def _check_against_reference(results, reference, atol=1e-5):
    out = torch.cat([r["out"] for r in results])
    grad_x = torch.cat([r["grad_x"] for r in results])
    torch.testing.assert_close(out, reference["out"], rtol=1e-5, atol=atol)
    torch.testing.assert_close(grad_x, reference["grad_x"], rtol=1e-5, atol=atol)
    # each rank holds its share of the parameter gradient; DDP sums (averages) them
    torch.testing.assert_close(
        sum(r["grad_w"] for r in results), reference["grad_w"], rtol=1e-5, atol=atol
    )
    torch.testing.assert_close(
        sum(r["grad_b"] for r in results), reference["grad_b"], rtol=1e-5, atol=atol
    )
    for r in results:
        torch.testing.assert_close(
            r["running_mean"], reference["running_mean"], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(r["running_var"], reference["running_var"], rtol=1e-5, atol=1e-6)
        assert int(r["num_batches_tracked"]) == int(reference["num_batches_tracked"])


@pytest.mark.parametrize(
    "kind, sizes, channels_last",
    [
        (2, [4, 4], False),  # even split
        (2, [5, 2], True),  # ranks with different batch sizes, channels_last input
        (1, [1, 6], False),  # a single sample on one rank; BatchNorm1d
        (3, [3, 2, 1], False),  # 3 ranks, BatchNorm3d, uneven
    ],
)
def test_sync_bn_equals_batchnorm_over_the_concatenated_batch(kind, sizes, channels_last):
    results = run_distributed(_sync_rank, len(sizes), kind, sizes, channels_last)
    _check_against_reference(results, _reference(kind, sizes, channels_last))
    if channels_last:
        assert all(r["channels_last"] for r in results)


def _eval_mode_rank(rank, world):
    import torch.distributed as dist

    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or original(*a, **k)
    bn = SyncBatchNorm(4)
    bn.running_mean.fill_(0.5)
    bn.running_var.fill_(4.0)
    bn.eval()
    x = torch.randn(3, 4, 2, 2) + rank
    out = bn(x)
    expected = (x - 0.5) / torch.sqrt(torch.tensor(4.0 + bn.eps))
    dist.all_reduce = original
    return len(calls), torch.allclose(out, expected, atol=1e-6)


def test_eval_mode_uses_running_stats_without_communication():
    for calls, matches in run_distributed(_eval_mode_rank, 2):
        assert calls == 0 and matches


def _bf16_rank(rank, world, sizes):
    x, g = _global_batch(2, sizes)
    start = sum(sizes[:rank])
    bn = SyncBatchNorm(4)
    conv_out = x[start : start + sizes[rank]].to(torch.bfloat16).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bn(conv_out)
    out.float().sum().backward()
    assert conv_out.grad.dtype == torch.bfloat16 and torch.isfinite(conv_out.grad).all()
    assert bn.weight.grad.dtype == torch.float32
    return out.dtype, out.float().detach(), bn.running_mean.clone()


def test_bf16_autocast_input_gives_bf16_output_close_to_fp32():
    sizes = [3, 3]
    results = run_distributed(_bf16_rank, 2, sizes)
    x, _ = _global_batch(2, sizes)
    reference = nn.BatchNorm2d(4)(x.to(torch.bfloat16).float())
    assert all(dtype == torch.bfloat16 for dtype, _, _ in results)
    torch.testing.assert_close(
        torch.cat([o for _, o, _ in results]), reference.detach(), rtol=2e-2, atol=2e-2
    )


def _plain_bn_rank(rank, world, sizes):
    x, _ = _global_batch(2, sizes)
    start = sum(sizes[:rank])
    bn = nn.BatchNorm2d(4)
    bn(x[start : start + sizes[rank]])
    return bn.running_mean


def test_without_sync_the_statistics_differ_per_rank():
    sizes = [4, 4]
    local = run_distributed(_plain_bn_rank, 2, sizes)
    reference = _reference(2, sizes, False, steps=1)["running_mean"]
    assert not torch.allclose(local[0], local[1], atol=1e-3)
    assert not torch.allclose(local[0], reference, atol=1e-3)
    synced = run_distributed(_sync_rank, 2, 2, sizes, False, 1)
    torch.testing.assert_close(synced[0]["running_mean"], reference)


def test_convert_keeps_state_and_rejects_1d_input():
    bn = nn.BatchNorm2d(3)
    bn.running_mean.fill_(2.0)
    model = SyncBatchNorm.convert(nn.Sequential(nn.Conv2d(1, 3, 1), bn))
    assert isinstance(model[1], SyncBatchNorm)
    assert torch.equal(model[1].running_mean, torch.full((3,), 2.0))
    assert model[1].weight is bn.weight
    with pytest.raises(ValueError, match="at least 2D"):
        model[1](torch.zeros(3))
