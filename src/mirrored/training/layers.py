"""Layers that need the strategy: `SyncBatchNorm` and `convert_sync_batchnorm`.

SyncBatchNorm computes batch statistics over the GLOBAL batch. Inside `strategy.run` each replica
computes its own per-channel count, mean and sum of squared deviations (M2), the replicas exchange
them in one collective, and every replica combines them in the same order with Chan et al.'s
parallel formula, so all normalise with the same mean and variance and keep identical running
statistics. The backward all-reduces the two per-channel sums the input gradient needs (of dy and
of dy * (x - mean)), so input gradients equal those of one BatchNorm over the whole batch, as in
torch.nn.SyncBatchNorm. Outside replica context, on one replica, or in eval mode it is an ordinary
BatchNorm. Uses the public surface of `mirrored.distribute`.
"""
from __future__ import annotations

import gc
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

import mirrored.distribute as md
from mirrored.training import keras_adapter

# The per-replica statistics travel in float64: they are tiny (replicas x (2C + 1) numbers), counts
# stay exact past float32's 2**24, and the combination adds no rounding of its own.
_STATS_DTYPE = torch.float64


def _all_gather_rows(local: Tensor, replica_ctx: Any) -> Tensor:
    """(num_replicas, *local.shape): row r is replica r's `local`. A SUM of zero-padded rows is an
    exact all-gather (x + 0 == x)."""
    rows = local.new_zeros((replica_ctx.num_replicas_in_sync, *local.shape))
    rows[replica_ctx.replica_id_in_sync_group] = local
    return replica_ctx.all_reduce(md.ReduceOp.SUM, rows)


@torch.no_grad()
def _global_stats(x: Tensor, replica_ctx: Any) -> tuple[Tensor, Tensor, Tensor]:
    """(mean, biased variance, values per channel) over every replica's part of the batch, all three on
    x's device: nothing here waits for the device (on a GPU, reading the count would, twice per layer)."""
    c = x.shape[1]
    count = x.numel() // c
    if count:
        mean_i, var_i = torch.batch_norm_update_stats(x, None, None, 0.0)  # precise: not E[x^2] - E[x]^2
    else:  # an empty part (the kernel refuses one): contributes nothing
        mean_i = var_i = x.new_zeros(c)
    local = torch.cat([x.new_full((1,), float(count), dtype=_STATS_DTYPE), mean_i.to(_STATS_DTYPE),
                       var_i.to(_STATS_DTYPE) * count])
    rows = _all_gather_rows(local, replica_ctx)
    counts, means, m2s = rows[:, :1], rows[:, 1:c + 1], rows[:, c + 1:]
    total = counts.sum()
    divisor = total.clamp_min(1)  # no values anywhere: every count, mean and M2 is 0, and so are the results
    mean = (counts * means).sum(0) / divisor
    # Chan et al.: M2 = sum_r (M2_r + n_r * (mean_r - mean)^2), every term >= 0 (no cancellation).
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / divisor, total


class _SyncBatchNormFn(torch.autograd.Function):
    """Normalises with given global statistics; the backward adds the statistics' part of the input
    gradient from sums all-reduced across replicas. The replica context comes from forward: on CUDA,
    autograd runs backward on its own device threads, which have no replica context of their own."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor,
                eps: float, total: Tensor, replica_ctx: Any) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            out = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, torch.backends.cudnn.enabled)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.eps, ctx.total, ctx.replica_ctx = eps, total, replica_ctx
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, var = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        c = x.shape[1]
        invstd = torch.rsqrt(var + ctx.eps)
        if x.numel():
            # One fused pass: sum(dy * (x - mean) * invstd) and sum(dy), as the "weight" and "bias"
            # gradients of a training-mode batch norm given our global mean and invstd. The CUDA kernel
            # asserts that save_mean/save_invstd are defined (the CPU one does not), and it sizes the
            # weight gradient from the weight: without an affine weight, ones stand in (the weight
            # gradient does not depend on the weight's value).
            ones = weight if weight is not None else torch.ones(c, dtype=x.dtype, device=x.device)
            _, dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, ones, None, None, mean, invstd, True, ctx.eps, [False, True, True])
        else:  # the kernel fails on an empty batch; this replica still joins the all-reduce below
            dy_xhat = sum_dy = x.new_zeros(c)
        dx = None
        if need_x:  # the same on every replica: every replica all-reduces, or none does
            sums = ctx.replica_ctx.all_reduce(md.ReduceOp.SUM, torch.cat([sum_dy, dy_xhat]))
            k = invstd if weight is None else weight * invstd
            # With xhat = (x - mean) * invstd and sums over the GLOBAL batch of N values per channel:
            # dx = k * (dy - sum(dy) / N - xhat * sum(dy * xhat) / N). The last two terms are a batch norm
            # of x with weight -k * sum(dy * xhat) / N and bias -k * sum(dy) / N: one fused pass; then
            # dy * k is added in place.
            dx = torch.batch_norm(x, -k * sums[c:] / ctx.total, -k * sums[:c] / ctx.total, mean, var, False, 0.0,
                                  ctx.eps, torch.backends.cudnn.enabled)
            dx.addcmul_(dy, k.view([1, c] + [1] * (x.dim() - 2)))
        return (dx, dy_xhat if need_w else None, sum_dy if need_b else None, None, None, None, None, None)


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch of all replicas (any input rank >= 2, channels in dim 1).

    Matches one torch.nn.BatchNorm over the concatenated batch: output, gradients and running
    statistics (unbiased running_var), up to float reassociation. Every replica must call it, also
    one with an empty part of the batch (mr.Model does): the statistics' exchange needs them all."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of rank >= 2 (N, C, ...); got shape {tuple(input.shape)}.")

    def forward(self, input: Tensor) -> Tensor:
        """Normalizes with the mean and variance of the global batch while training in a replica (an
        exchange every replica joins); outside a replica, with one replica, or in eval, plain BatchNorm."""
        self._check_input_dim(input)
        ctx = md.get_replica_context()
        if not self.training or ctx is None or ctx.num_replicas_in_sync == 1:
            return super().forward(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}): input of shape {tuple(input.shape)} has "
                             f"{input.shape[1]} channels in dim 1; expected {self.num_features}.")
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()  # bf16/fp16: stats in fp32
        mean, var, total = _global_stats(x, ctx)
        # The global count is read (a device sync) only when this replica's part cannot prove it is >= 2.
        if x.numel() // x.shape[1] < 2 and int(total.item()) < 2:
            raise ValueError(f"SyncBatchNorm: the global batch has {int(total.item())} value(s) per channel; "
                             "training needs at least 2 (as torch.nn.BatchNorm). Use a larger batch.")
        if self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean, var, total)
        # The affine parameters in x's dtype too (a .half() model holds fp16 ones; the kernels take one
        # dtype): their gradients come back through the cast in the parameters' own dtype.
        weight = self.weight if self.weight is None or self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        out = _SyncBatchNormFn.apply(x, weight, bias, mean.to(x.dtype), var.to(x.dtype), self.eps, total, ctx)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, total: Tensor) -> None:
        self.num_batches_tracked.add_(1)
        m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * (total / (total - 1))
        self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """`module` with every BatchNorm1d/2d/3d (any torch `_BatchNorm`) replaced by a SyncBatchNorm that
    shares its parameters and buffers (so requires_grad, device and dtype carry over) and its
    training flag. Like torch.nn.SyncBatchNorm.convert_sync_batchnorm; state_dict keys are unchanged.
    A Keras 3 model's BatchNormalization layers compute global-batch statistics instead (in place).
    Refused on a module already mirrored: only replica 0's copy would change."""
    _refuse_mirrored(module)
    if keras_adapter.is_keras_model(module):
        return keras_adapter.convert_sync_batchnorm(module)
    return _convert(module)


def _refuse_mirrored(module: Any) -> None:
    """Raises for a module strategy.mirror (or mr.Model) already copied: converting replica 0's copy
    alone makes its BatchNorms all-reduce where the others' do not, and the next step fails on the
    mismatched collectives without naming this cause."""
    if isinstance(module, md.MirroredModule):
        mirror = module
    elif isinstance(module, nn.Module):
        if md.mirror_holding(module) is not None:
            gc.collect()  # a dropped mr.Model lives on in reference cycles until the collector runs
        mirror = md.mirror_holding(module)
    elif keras_adapter.is_keras_model(module):
        return  # (another backend than torch: mr.Model and strategy.mirror refuse it, naming the fix)
    else:
        raise TypeError(f"convert_sync_batchnorm({type(module).__name__}): expected a torch.nn.Module or a Keras "
                        "model. For an mr.Model, convert the module before wrapping it: "
                        "mr.Model(mr.layers.convert_sync_batchnorm(net)).")
    if mirror is None:
        return
    n = len(mirror.values)
    whose = "this module" if mirror.values[0] is module or mirror is module else \
        f"this module is inside {type(mirror.values[0]).__name__}, which"
    raise ValueError(
        f"convert_sync_batchnorm({type(module).__name__}): {whose} is already mirrored on {n} replica(s) "
        "(by strategy.mirror or mr.Model), so only replica 0's copy would change and the replicas' "
        "BatchNorm exchanges would no longer match. Convert before mirroring: "
        "mr.Model(mr.layers.convert_sync_batchnorm(net)) or strategy.mirror(mr.layers.convert_sync_batchnorm(net)) "
        "in `with strategy.scope():`.")


def _convert(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"convert_sync_batchnorm: {type(module).__name__} is not initialised yet; run one "
                             "forward pass first (or use BatchNorm2d(num_features)).")
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats)
        with torch.no_grad():
            if module.affine:
                sync.weight, sync.bias = module.weight, module.bias
            # Buffers are shared too (None when track_running_stats=False).
            sync.running_mean = module.running_mean
            sync.running_var = module.running_var
            sync.num_batches_tracked = module.num_batches_tracked
        sync.train(module.training)
        if hasattr(module, "qconfig"):
            sync.qconfig = module.qconfig
        return sync
    for name, child in module.named_children():
        new = _convert(child)
        if new is not child:
            setattr(module, name, new)
    return module


def has_sync_batchnorm(module: nn.Module) -> bool:
    """True if `module` holds a SyncBatchNorm (its forward joins a collective, even on an empty batch)."""
    return any(isinstance(m, SyncBatchNorm) for m in module.modules()) or keras_adapter.has_global_batchnorm(module)


__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
