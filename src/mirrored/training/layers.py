"""Layers that need the strategy: `SyncBatchNorm` and `convert_sync_batchnorm`.

SyncBatchNorm computes batch statistics over the GLOBAL batch: inside `strategy.run` each replica
contributes its per-channel sums and counts through one all-reduce (differentiable: the backward
all-reduces the gradients of those sums), so every replica normalises with the same mean and
variance and its running statistics stay identical. Outside replica context, or on one replica,
it is an ordinary BatchNorm. Uses the public surface of `mirrored.distribute`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import mirrored.distribute as md


class _AllReduceSum(torch.autograd.Function):
    """SUM across replicas, whose gradient is again a SUM across replicas."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        return md.get_replica_context().all_reduce(md.ReduceOp.SUM, t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return md.get_replica_context().all_reduce(md.ReduceOp.SUM, grad.contiguous())


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch of all replicas (any input rank >= 2, channels in dim 1)."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of rank >= 2 (N, C, ...); got shape {tuple(input.shape)}.")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        ctx = md.get_replica_context()
        if not self.training or ctx is None or ctx.num_replicas_in_sync == 1:
            return super().forward(input)
        c = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input.float()
        count = torch.tensor([input.numel() / max(c, 1)], dtype=torch.float32, device=input.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = _AllReduceSum.apply(stats)
        total = stats[2 * c]
        if float(total) < 2:
            raise ValueError(f"SyncBatchNorm: the global batch has {int(total)} value(s) per channel; training "
                             "needs at least 2. Use a larger batch.")
        mean = stats[:c] / total
        var = (stats[c:2 * c] / total - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked + 1)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * (total / (total - 1)), alpha=m)
                self.num_batches_tracked.add_(1)
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Returns `module` with every BatchNorm1d/2d/3d replaced by a SyncBatchNorm holding its state."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats)
        sync.load_state_dict(module.state_dict())
        sync.train(module.training)
        return sync.to(next((t.device for t in module.state_dict().values()), torch.device("cpu")))
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child)
        if new is not child:
            setattr(module, name, new)
    return module


def has_sync_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, SyncBatchNorm) for m in module.modules())


__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
