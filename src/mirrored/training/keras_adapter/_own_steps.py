"""mr.Model of a Keras model whose class defines its own steps (train_step, test_step, predict_step,
compute_loss, compute_metrics) or its own compile, as keras.io's "Customizing what happens in fit()"
writes them: OwnSteps runs them on every replica's copy, as Keras's own fit does under a strategy
(KerasReplicas: the gradient all-reduce in the optimizer's apply, the metrics combined after each
step), inside mr.Model's loop. Its compile is the model's own, on every copy (a GAN's
compile(d_optimizer=..., g_optimizer=..., loss_fn=...)). Uses _replicas.py, _mirroring.py,
mirrored.distribute and keras.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

import mirrored.distribute as md
from mirrored.training.keras_adapter import _mirroring
from mirrored.training.keras_adapter._replicas import KerasReplicas, with_metrics

_OWN = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics", "compile")


def defines_own_steps(module: nn.Module) -> bool:
    """Whether a Keras model's class overrides a step, compute_loss, compute_metrics or compile (against
    keras.Model's, which Sequential and functional models keep, install()'s compile included)."""
    import keras

    cls = type(module)
    return any(getattr(cls, name) is not getattr(keras.Model, name) for name in _OWN)


class OwnSteps:
    """The Keras model's own compile and steps, on every replica of a MirroredModule (mr.Model's)."""

    def __init__(self, mirror: md.MirroredModule):
        self._mirror = mirror
        self._replicas = KerasReplicas(mirror.replicas[0], mirror.distribute_strategy, mirror=mirror)

    def compile(self, *args: Any, **kwargs: Any) -> _CompiledOptimizer:
        """The model's own compile(*args, **kwargs) on every replica's copy (the others get copies of
        the arguments: an optimizer object is each copy's own). Returns what mr.Model.optimizer shows."""
        strategy = self._mirror.distribute_strategy
        with strategy.scope():
            for r, copy_ in enumerate(self._mirror.replicas):
                given = (args, kwargs) if r == 0 else _mirroring.copy_objects((args, kwargs))
                copy_.compile(*given[0], **given[1])
        self._replicas.prepare()
        return _CompiledOptimizer(self._mirror.replicas)

    def step(self, kind: str, data: Any) -> Any:
        """In replica context: the copy's own `kind` step on this replica's part; the logs flattened as
        Keras's loop flattens them (a dict of metrics' results read over every replica)."""
        ctx = md.get_replica_context()
        rows = _rows(data)
        total = ctx.all_reduce(md.ReduceOp.SUM, torch.tensor([float(rows)], dtype=torch.float64))
        out = self._replicas.replica_step(kind, data, rows, max(int(total[0]), 1), _by_rows)
        if kind == "predict":
            return out
        logs = with_metrics(self._mirror.replicas[ctx.local_replica_id], *out)
        if not isinstance(logs, Mapping):
            return logs
        flat = {}
        for k, v in logs.items():  # (Keras's pythonify_logs: a metric's dict of results, one level)
            if isinstance(v, Mapping):
                flat.update(v)
            else:
                flat[k] = v
        return flat


def _by_rows(copy_: nn.Module, rows: int) -> tuple[float, bool]:
    del copy_
    return float(rows), True


def _rows(data: Any) -> int:
    """The examples of a replica's part: the first dimension of its first tensor."""
    first = next((t for t in md.flatten(data) if isinstance(t, Tensor) and t.dim() > 0), None)
    return 0 if first is None else int(first.shape[0])


class _CompiledOptimizer:
    """mr.Model.optimizer of a Keras model that compiles itself: its compiled `optimizer`, every
    replica's copy, as fit's schedules and BackupAndRestore read and set the learning rate."""

    use_ema = False  # (fit's finalize step; a Keras optimizer's EMA is its own apply's)

    def __init__(self, copies: tuple[nn.Module, ...]):
        self._copies = copies

    def _optimizers(self) -> list[Any]:
        return [opt for opt in (getattr(c, "optimizer", None) for c in self._copies) if opt is not None]

    @property
    def name(self) -> str:
        found = self._optimizers()
        return found[0].name if found else "none"

    @property
    def _schedule(self) -> Any:
        import keras

        found = self._optimizers()
        rate = found[0]._learning_rate if found else None
        return None if rate is None or isinstance(rate, keras.Variable) else rate

    @property
    def learning_rate(self) -> float:
        found = self._optimizers()
        return float(found[0].learning_rate) if found else 0.0

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        for opt in self._optimizers():
            opt.learning_rate = value

    def __repr__(self) -> str:
        return f"<the compiled optimizer {self.name} of every replica's copy>"
