"""Keras's random ops in a replica step draw a stream per replica.

Seeded (a layer's SeedGenerator(seed=int)): Keras draws through torch.Generator(manual_seed(state))
from the generator, whose state the replicas hold in step (replica 0's after each step), so every
replica would draw the same mask for its different examples. Replica 0, and any call outside a
multi-replica step, keeps Keras's own seed, so one replica draws what Keras draws; replica r > 0
(its global id, so 2 workers x 2 replicas draw as 4 replicas) mixes r into the first word.
Unseeded (seed=None: keras.random.*'s global SeedGenerator, which Keras keeps per thread and seeds
from Python's `random` at a thread's first draw, in whatever order the replica threads get there;
and a layer's SeedGenerator(seed=None), GaussianNoise's say): the seed is drawn from the replica's
own generator, seeded by the strategy's seed, the step and the replica, so two runs, and a resumed
one, draw the same whatever the thread order. (An unseeded Keras Dropout runs torch's dropout,
which draws from that generator already.) patches() lists what install() replaces in Keras. Uses
_common.py, mirrored._seeds and keras.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import mirrored.distribute as md
from mirrored._seeds import derive_seed
from mirrored.training.keras_adapter._common import in_replica_step


def _refuse_per_example(what: str) -> None:
    ctx = md.get_replica_context()
    strategy = getattr(ctx, "strategy", None)
    if strategy is not None and strategy.random_state.per_example:
        raise RuntimeError(
            f"{what} drew a seed in a replica step of a strategy with per_example_random=True: a Keras random op "
            "that draws through a SeedGenerator (Dropout(seed=...), GaussianNoise, keras.random.normal, ...) draws "
            "from a generator of its own, which cannot be keyed by example, so the run would depend on the replica "
            "count. Drop seed= from the Keras Dropout (it then runs torch's dropout, which is keyed), or use "
            "per_example_random=False.")


def _replica_seed() -> Tensor:
    """A Keras seed [s, 0] (int32, Keras's torch seed dtype) drawn from the running replica's generator:
    torch.randint in a replica step takes it (mirrored.distribute's replica random mode)."""
    drawn = int(torch.randint(1, 1 << 31, (), dtype=torch.int64))
    return torch.tensor([drawn, 0], dtype=torch.int32)


class _ReplicaSeeds:
    """Stands in for Keras's global SeedGenerator in a replica step (keras.random.*(seed=None))."""

    def next(self, ordered: bool = True) -> Any:  # noqa: A003 - Keras's name
        del ordered
        _refuse_per_example("keras.random with seed=None")
        return _replica_seed()


def patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for SeedGenerator.next and seed_generator.global_seed_generator."""
    from keras.src.random import seed_generator

    keras_next = seed_generator.SeedGenerator.next
    keras_global = seed_generator.global_seed_generator
    replica_seeds = _ReplicaSeeds()

    def next(self: Any, ordered: bool = True) -> Any:  # noqa: A001 - Keras's name
        if not in_replica_step():
            return keras_next(self, ordered)
        _refuse_per_example(f"Keras's SeedGenerator {getattr(self, 'name', '')!r}")
        if getattr(self, "_initial_seed", 0) is None:  # built with seed=None: the replica's stream
            return _replica_seed()
        value = keras_next(self, ordered)
        ctx = md.get_replica_context()
        replica = 0 if ctx.num_replicas_in_sync < 2 else ctx.replica_id_in_sync_group
        if not replica or not isinstance(value, Tensor) or value.numel() < 1:
            return value
        first = int(value.reshape(-1)[0])
        mixed = derive_seed(first & 0xFFFFFFFF, replica, 0x23) & 0x7FFFFFFF  # fits int32, Keras's seed dtype
        value = value.clone()
        value.view(-1)[0] = mixed
        return value

    def global_seed_generator() -> Any:
        return replica_seeds if in_replica_step() else keras_global()

    next.__doc__ = keras_next.__doc__
    global_seed_generator.__doc__ = keras_global.__doc__
    # (draw_seed(None) looks global_seed_generator up in its module at each call)
    return [(seed_generator.SeedGenerator, "next", next),
            (seed_generator, "global_seed_generator", global_seed_generator)]
