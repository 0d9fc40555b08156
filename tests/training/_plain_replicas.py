"""Plain PyTorch playing a strategy's replicas by hand: the reference that fit's BatchNorm tests
(test_fit_step_path.py, test_fit_overhead.py) compare mr.Model's fit with. No mirrored code."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def tf_split(batch: int, replicas: int) -> list[int]:
    """TF's split of a global batch: replicas in order take ceil(batch / replicas) until it runs out."""
    per, sizes = -(-batch // replicas), []
    for _ in range(replicas):
        sizes.append(min(per, batch - sum(sizes)))
    return sizes


def batchnorm_data(seed: int, examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`examples` rows of 6 features with an offset mean (as activations have) and labels of 4 classes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(examples, 6, generator=g) * 2 + 1, torch.randint(0, 4, (examples,), generator=g)


def replicas_by_hand(make_net: Callable[[], torch.nn.Module], x: torch.Tensor, y: torch.Tensor, replicas: int,
                     global_batch: int, epochs: int) -> tuple[torch.nn.Module, list[float]]:
    """Replica 0's module and the loss of each epoch (the mean over its examples) after fit's steps done op
    for op in plain PyTorch: one module copy per replica on its part of each global batch (TF's split),
    crossentropy (as -log_softmax at the label, which mr's loss computes) summed over the part / global
    batch, backward on each copy; the gradients summed in replica order and applied by each copy's torch
    SGD (lr 0.1, momentum 0.9); the floating-point buffers set to the parts' average weighted by their
    sizes, computed in float64 in replica order; the integer ones (num_batches_tracked) replica 0's."""
    copies = [make_net() for _ in range(replicas)]
    opts = [torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9) for c in copies]
    losses = []
    for _ in range(epochs):
        epoch_loss = 0.0
        for i in range(0, len(x), global_batch):
            xb, yb = x[i:i + global_batch], y[i:i + global_batch]
            sizes = tf_split(len(xb), replicas)
            batch_loss, start = 0.0, 0
            for c, opt, size in zip(copies, opts, sizes):
                opt.zero_grad()
                part = slice(start, start + size)
                start += size
                per_example = -F.log_softmax(c(xb[part]), dim=-1).gather(1, yb[part].unsqueeze(1)).squeeze(1)
                loss = per_example.sum() / len(xb)
                loss.backward()
                batch_loss += loss.item()
            epoch_loss += batch_loss * len(xb)
            with torch.no_grad():
                params = [list(c.parameters()) for c in copies]
                summed = [p.grad.clone() for p in params[0]]
                for other in params[1:]:
                    for s, p in zip(summed, other):
                        s.add_(p.grad)
                for c, opt in zip(copies, opts):
                    for p, s in zip(c.parameters(), summed):
                        p.grad = s.clone()
                    opt.step()
                buffers = [dict(c.named_buffers()) for c in copies]
                for name, first in buffers[0].items():
                    if first.is_floating_point():
                        total = first.double() * sizes[0]
                        for r in range(1, replicas):
                            total = total + buffers[r][name].double() * sizes[r]
                        value = (total / sum(sizes)).to(first.dtype)
                    else:
                        value = first.clone()
                    for b in buffers:
                        b[name].copy_(value)
        losses.append(epoch_loss / len(x))
    return copies[0], losses
