"""Synchronised BatchNorm on every backend.

On CUDA this is torch.nn.SyncBatchNorm. Elsewhere (CPU with gloo, where torch's module
refuses input that is not on a GPU) paratrain's own: the forward pass normalises with the
global mean and variance, from one all-reduce of the per-channel sum, sum of squares and
count; the backward pass all-reduces the two gradient sums the input gradient needs.
The result equals single-process BatchNorm over the concatenated batch: outputs, input
gradients, weight and bias gradients (DDP averages those), and the running statistics.

Ranks may hold different numbers of samples (the last batch), even a single one; in eval
mode no communication happens. Sums are accumulated in float64, so sum-of-squares
cancellation does not cost precision, and bf16 input gives bf16 output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.dist.runtime import Runtime


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked,
                eps, momentum, group):
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        local_count = x.numel() // channels
        stats = torch.empty(2 * channels + 1, dtype=torch.float64, device=x.device)
        torch.sum(x, dims, dtype=torch.float64, out=stats[:channels])
        torch.sum(x * x, dims, dtype=torch.float64, out=stats[channels : 2 * channels])
        stats[-1] = local_count
        _all_reduce(stats, group)
        count = stats[-1].item()
        if count <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel in training mode, got {count:g}"
            )
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean * mean).clamp_(min=0)
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None:
            with torch.no_grad():
                num_batches_tracked.add_(1)
                factor = 1.0 / float(num_batches_tracked) if momentum is None else momentum
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                unbiased = var * (count / (count - 1))
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)

        shape = [1, channels] + [1] * (x.dim() - 2)
        mean32, invstd32 = mean.float().view(shape), invstd.float().view(shape)
        xhat = (x.float() - mean32) * invstd32
        out = xhat
        if weight is not None:
            out = out * weight.float().view(shape) + bias.float().view(shape)
        ctx.save_for_backward(xhat, invstd32, weight)
        ctx.count, ctx.group, ctx.dims, ctx.shape = count, group, dims, shape
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xhat, invstd, weight = ctx.saved_tensors
        dy = grad_out.float()
        channels = xhat.shape[1]
        sums = torch.empty(2 * channels, dtype=torch.float64, device=dy.device)
        torch.sum(dy, ctx.dims, dtype=torch.float64, out=sums[:channels])
        torch.sum(dy * xhat, ctx.dims, dtype=torch.float64, out=sums[channels:])
        # Weight and bias gradients stay local: DDP averages them like any parameter's.
        grad_bias = sums[:channels].to(dy.dtype).clone() if weight is not None else None
        grad_weight = sums[channels:].to(dy.dtype).clone() if weight is not None else None
        _all_reduce(sums, ctx.group)
        mean_dy = (sums[:channels] / ctx.count).float().view(ctx.shape)
        mean_dy_xhat = (sums[channels:] / ctx.count).float().view(ctx.shape)
        scale = invstd if weight is None else invstd * weight.float().view(ctx.shape)
        grad_x = (dy - mean_dy - xhat * mean_dy_xhat) * scale
        if weight is not None:
            grad_weight, grad_bias = grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)
        return (grad_x.to(grad_out.dtype), grad_weight, grad_bias,
                None, None, None, None, None, None)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the whole global batch, for any number of spatial dims (1d/2d/3d)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            return nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        track = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(
            x, self.weight, self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.num_batches_tracked if track else None,
            self.eps, self.momentum, self.process_group,
        )

    @classmethod
    def convert(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Replace every BatchNorm in ``module`` by a SyncBatchNorm with the same state."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls | nn.SyncBatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
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
