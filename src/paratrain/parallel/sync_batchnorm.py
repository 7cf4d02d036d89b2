"""Synchronised BatchNorm on every backend.

On CUDA this is torch.nn.SyncBatchNorm. Elsewhere (CPU with gloo, where torch's module
refuses input that is not on a GPU) paratrain's own: the forward pass normalises with the
global mean and variance, from one all-reduce of the per-channel sum, sum of squares and
count; the backward pass all-reduces the two gradient sums the input gradient needs.
The result equals single-process BatchNorm over the concatenated batch: outputs, input
gradients, weight and bias gradients (DDP averages those), and the running statistics.

Ranks may hold different numbers of samples (the last batch), even a single one; in eval
mode no communication happens. Sums are combined in float64, so sum-of-squares
cancellation does not cost precision, and bf16 input gives bf16 output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.distributed.runtime import Runtime


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


class _SyncBatchNormFunction(torch.autograd.Function):
    """Global statistics from one all-reduce; torch's fused kernels for the heavy passes.

    Forward: a fused per-rank var_mean, one all-reduce of (n*mean, n*(var+mean^2), n) in
    float64, then torch's eval-mode batch_norm kernel with the global statistics.
    Backward: torch's eval-mode batch_norm backward gives dy*w*invstd and the two local
    sums in one pass; after the all-reduce of the sums, the terms through the global mean
    and variance are added.
    """

    @staticmethod
    def forward(
        ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, eps, momentum, group
    ):
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        local_count = x.numel() // channels
        stats_input = x if x.dtype in (torch.float32, torch.float64) else x.float()
        if local_count > 0:
            local_var, local_mean = torch.var_mean(stats_input, dims, correction=0)
        else:
            local_var = local_mean = torch.zeros(channels, device=x.device)
        # fp32 mean squared is exact in float64, so sum and sum of squares lose nothing here
        mean64, var64 = local_mean.double(), local_var.double()
        stats = torch.cat(
            [
                mean64 * local_count,
                (var64 + mean64 * mean64) * local_count,
                torch.tensor([float(local_count)], dtype=torch.float64, device=x.device),
            ]
        )
        _all_reduce(stats, group)
        count = stats[-1].item()
        if count <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel in training mode, got {count:g}"
            )
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean * mean).clamp_(min=0)

        if running_mean is not None:
            with torch.no_grad():
                num_batches_tracked.add_(1)
                factor = 1.0 / float(num_batches_tracked) if momentum is None else momentum
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                unbiased = var * (count / (count - 1))
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)

        param_dtype = weight.dtype if weight is not None else torch.float32
        mean, var = mean.to(param_dtype), var.to(param_dtype)
        out = nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.count, ctx.group, ctx.eps = count, group, eps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, var = ctx.saved_tensors
        channels = x.shape[1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        affine = weight if weight is not None else torch.ones_like(mean)
        grad_out = grad_out.contiguous(memory_format=_memory_format(x))
        # eval-mode backward: dy*w*invstd, sum(dy*xhat) and sum(dy), fused, on local data
        grad_x, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_out, x, affine, mean, var, None, None, False, ctx.eps, [True, True, True]
        )
        # Weight and bias gradients stay local: DDP averages them like any parameter's.
        grad_weight = sum_dy_xhat.clone() if weight is not None else None
        grad_bias = sum_dy.clone() if weight is not None else None
        sums = torch.cat([sum_dy, sum_dy_xhat]).double()
        _all_reduce(sums, ctx.group)
        invstd = torch.rsqrt(var.double() + ctx.eps)
        mean_dy = sums[:channels] / ctx.count
        mean_dy_xhat = sums[channels:] / ctx.count
        scale = invstd * affine.double()
        # the terms through the global mean and variance: x*slope + offset, per channel
        slope = -scale * invstd * mean_dy_xhat
        offset = -scale * mean_dy - slope * mean.double()
        grad_x = grad_x.addcmul_(x, slope.to(grad_x.dtype).view(shape)).add_(
            offset.to(grad_x.dtype).view(shape)
        )
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the whole global batch, for any number of spatial dims (1d/2d/3d)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Global statistics in training (one all-reduce); running statistics in eval mode, with no communication."""
        self._check_input_dim(x)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            return nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        track = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(
            x,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.num_batches_tracked if track else None,
            self.eps,
            self.momentum,
            self.process_group,
        )

    @classmethod
    def convert(
        cls, module: nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> nn.Module:
        """Replace every BatchNorm in ``module`` by a SyncBatchNorm with the same state."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls | nn.SyncBatchNorm):
            converted = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
            )
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert(child, process_group))
        return converted


def apply(model: nn.Module, runtime: Runtime) -> nn.Module:
    """torch's SyncBatchNorm on CUDA (fused kernels); paratrain's own everywhere else."""
    if runtime.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return SyncBatchNorm.convert(model)
