"""A Keras model's own steps on every replica: KerasReplicas, what Keras's own fit (and mr.Model, for a
model whose class overrides its steps) needs to run `train_step` / `test_step` / `predict_step` on
each replica's copy of the model.

Replica 0's copy is the user's model, the one Keras's loop, callbacks and saving read. Before each
step, what changed there since the last step (weights a callback or BackupAndRestore loaded, the
learning rate, torch modes) is copied to the other copies (sync_from_first); a changed structure (a
recompile, trainable flags, a new optimizer) makes the copies again. Each step splits the GLOBAL
batch as experimental_distribute_dataset does (a replica whose part would be empty gets one row of
the batch, weighted 0 everywhere, so every replica runs the same collectives), runs the copy's own
step on every replica, and then, in one all-reduce: the metric variables' increments are added
(tf.distribute's sync-on-read SUM, so replica 0's metrics are the global ones), the variables layers
assign in call (BatchNormalization's moving statistics) take their mean weighted by rows, and logs
that are not the metrics' take their mean weighted by rows. Inside the step, a Keras optimizer's
apply all-reduces the gradients first (_keras_fit.py's hook): each replica weighs by its rows, so a
mean loss over a part gives one device's update on the global batch. current() is the running
replica's step, which the hooks read. Uses _common.py, _mirroring.py, mirrored.distribute and keras.
"""
from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import mirrored.distribute as md
from mirrored.training.keras_adapter import _mirroring
from mirrored.training.keras_adapter._common import device_scope

_STEP = threading.local()  # .step: the replica step running on this thread
_VERSION = operator.attrgetter("_version")
_TRAINING = operator.attrgetter("training")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class ReplicaStep:
    """One replica's part of one step: its rows of the GLOBAL batch (0 for a padded replica), what
    its gradients weigh in the all-reduce, and which trainable tensors Keras's apply wrote."""

    __slots__ = ("replicas", "rows", "global_rows", "weight", "divide", "applying", "applied")

    def __init__(self, replicas: KerasReplicas, rows: int, global_rows: int, weight: float, divide: bool):
        self.replicas, self.rows, self.global_rows = replicas, rows, global_rows
        self.weight, self.divide = weight, divide
        self.applying = False  # inside an optimizer's apply (an inner optimizer's apply is not reduced again)
        self.applied: dict[int, int] = {}  # id(tensor) -> its version when an apply that wrote it ended

    @property
    def share(self) -> float:
        """This replica's share of the global batch: what an unweighted Mean of one number per step counts."""
        return self.rows / self.global_rows

    @property
    def loss_share(self) -> float:
        """What this replica's loss weighs in one device's loss: its share of the batch (a mean over its
        part), or all of it (a sum: weighed 1, summed), 0 for a padded replica."""
        return self.share if self.divide else self.weight

    def reduce(self, optimizer: Any, grads: list[Any], variables: list[Any]) -> list[Any]:
        """The replicas' gradients of `variables` (each replica's copies), averaged weighted by rows."""
        params = [v.value if hasattr(v, "value") else v for v in variables]
        if len(grads) != len(params):
            raise ValueError(f"{optimizer.name}.apply: {len(grads)} gradients for {len(params)} variables; give one "
                             "gradient (or None) per variable, in the same order.")
        reducer = self.replicas.reducer(optimizer, variables)
        grads = [g.value if hasattr(g, "value") and not isinstance(g, Tensor) else g for g in grads]
        reduced = reducer.reduce(md.get_replica_context(), params, grads, self.weight, self.divide)
        journal = md.current_journal()
        if journal is not None:
            journal.before_update()  # the weights change now: the step cannot be run again from here
        return reduced

    def after_apply(self, variables: list[Any]) -> None:
        for v in variables:
            t = v.value if hasattr(v, "value") else v
            self.applied[id(t)] = t._version


def _unchanged(module: nn.Module) -> None:
    del module


def current() -> ReplicaStep | None:
    """The replica step running on this thread, or None outside one."""
    return getattr(_STEP, "step", None)


def _optimizers(model: nn.Module) -> list[Any]:
    """The Keras optimizers a model holds as attributes (compile's, and a GAN's d_optimizer, ...),
    with their inner ones, in attribute order (the same on every copy)."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    found: list[Any] = []

    def add(obj: Any) -> None:
        if isinstance(obj, BaseOptimizer) and all(obj is not o for o in found):
            found.append(obj)
            for inner in (getattr(obj, "inner_optimizer", None), *getattr(obj, "_inner_optimizers", ())):
                add(inner)

    for value in list(vars(model).values()):
        add(value)
    return found


def _metric_variables(model: nn.Module) -> list[Any]:
    """The variables of every metric the model reports or tracks: its `metrics` (a subclass may list its
    own trackers there) and Keras's own list (the loss tracker, compiled metrics, trackers set as
    attributes), each once, in that order."""
    from keras.src.trainers.trainer import Trainer

    seen: set[int] = set()
    found = []
    lists = [model.metrics]
    if isinstance(model, Trainer) and type(model).metrics is not Trainer.metrics:
        lists.append(Trainer.metrics.fget(model))
    for metrics in lists:
        for m in metrics:
            for v in m.variables:  # (a compiled metric's variables are its CompileMetrics' too: once)
                if id(v) not in seen:
                    seen.add(id(v))
                    found.append((m, v))
    return found


def _tracked(model: nn.Module) -> list[Tensor]:
    """The tensors of a copy that Keras's loop may change between steps on replica 0 alone: the
    model's weights and its optimizers' variables."""
    return [v._value for v in model.weights] + [v._value for opt in _optimizers(model) for v in opt.variables]


class _Snapshot:
    """Replica 0's copy as the last step left it: which tensors (their identities), their write
    counts, the torch modes and requires_grad."""

    __slots__ = ("ids", "versions", "modules", "modes", "grads")

    def __init__(self, model: nn.Module, tensors: list[Tensor]):
        self.ids = list(map(id, tensors))
        self.versions = list(map(_VERSION, tensors))
        modules = list(model.modules())
        self.modules = list(map(id, modules))
        self.modes = list(map(_TRAINING, modules))
        self.grads = list(map(_REQUIRES_GRAD, tensors))


class KerasReplicas:
    """A Keras model's copies under a strategy, and its steps on them (see the module docstring).

    Args:
      model: the user's Keras model (replica 0's copy).
      strategy: the strategy it is distributed by.
      mirror: copies made already (mr.Model's), which are kept; None: made at the first step, from the
        compiled model, and made again after a recompile.
    """

    def __init__(self, model: nn.Module, strategy: Any, mirror: Any = None):
        self._model = model
        self.strategy = strategy
        self.mirror = mirror
        self._own_mirror = mirror is None
        self.stale = mirror is None  # the copies are to be made (again) before the next step
        self._snapshot: _Snapshot | None = None
        self._reducers: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.compare_next = strategy.num_workers > 1  # the next batch's digest is compared across workers

    @property
    def replicas(self) -> tuple[nn.Module, ...]:
        return self.mirror.replicas

    # ---- between steps, on the caller's thread -----------------------------------------------------
    def prepare(self) -> None:
        """Makes the copies where they are stale (the first step, a recompile) from replica 0's model."""
        if not self.stale and self.mirror is not None:
            return
        if self._own_mirror:
            with self.strategy.scope():
                self.mirror = self.strategy.mirror(self._model, memory_format="preserve")
            for copy_, device in zip(self.replicas[1:], self.strategy.extended.worker_devices[1:]):
                _mirroring.move_state(copy_, torch.device(device))
        self._reducers.clear()
        self.stale = False
        self._snapshot = _Snapshot(self._model, _tracked(self._model))

    def sync_from_first(self) -> None:
        """Carries to every copy what changed on replica 0 since the last step: the tensors written
        (their values), the torch modes; a changed structure or requires_grad makes the copies again."""
        model = self._model
        tensors = _tracked(model)
        snap = self._snapshot
        if snap is None or list(map(id, tensors)) != snap.ids or list(map(_REQUIRES_GRAD, tensors)) != snap.grads:
            if not self._own_mirror:
                raise RuntimeError(f"{type(model).__name__}: its variables or trainable flags changed since the last "
                                   "step (a layer added, frozen or unfrozen): compile the model again, so that every "
                                   "replica's copy is made from it.")
            self.stale = True
            self.prepare()
            return
        copies = self.replicas[1:]
        if copies:
            changed = [i for i, (t, v) in enumerate(zip(tensors, snap.versions)) if t._version != v]
            if changed:
                with torch.no_grad():
                    for copy_ in copies:
                        theirs = _tracked(copy_)
                        for i in changed:
                            theirs[i].copy_(tensors[i])
            modules = list(model.modules())
            if list(map(id, modules)) != snap.modules:
                # Keras's fit makes the model's torch ParameterDict again (_symbolic_build's _post_build), over
                # the same parameters: the mirror's watch walks the copies again (MirroredModule.apply does).
                self.mirror.apply(_unchanged)
            modes = list(map(_TRAINING, modules))
            if modes != snap.modes:
                for copy_ in copies:
                    for m, mode in zip(copy_.modules(), modes):
                        m.training = mode

    def take_snapshot(self) -> None:
        self._snapshot = _Snapshot(self._model, _tracked(self._model))

    def reducer(self, optimizer: Any, variables: Sequence[Any]) -> Any:
        """The gradient reducer for this optimizer and list of variables (one each: a reducer keeps
        buffers laid out for the gradients it reduced)."""
        key = (optimizer.name, len(variables), getattr(variables[0], "path", None) if variables else None,
               getattr(variables[-1], "path", None) if variables else None)
        found = self._reducers.get(key)
        if found is None:
            with self._lock:
                found = self._reducers.get(key)
                if found is None:
                    found = self._reducers[key] = self.strategy.gradient_reducer(
                        self.mirror, f"{type(self._model).__name__}'s {optimizer.name}.apply, all-reducing the "
                                     "gradients")
        return found

    # ---- one step -----------------------------------------------------------------------------------
    def split(self, batch: Any) -> tuple[Any, Any, int]:
        """The GLOBAL batch's parts for this process's replicas and their rows (PerReplica values, or
        those of a lone local replica), and the global size; an empty part gets the batch's first row."""
        compare, self.compare_next = self.compare_next, False
        parts, rows, size = md.split_global_batch(self.strategy, batch, compare_workers=compare)
        devices = self.strategy.extended.worker_devices
        for r, n in enumerate(rows):
            if n == 0:  # a short last batch: one row of the batch, weighted 0 everywhere
                parts[r] = md.map_structure(lambda leaf, d=devices[r]: _first_row(leaf, d), batch)
        if len(parts) == 1:
            return parts[0], rows[0], size
        return md.PerReplica(parts), md.PerReplica(rows), size

    def replica_step(self, kind: str, part: Any, rows: int, global_rows: int, weight: Callable[..., Any]) -> Any:
        """On every replica thread: the copy's own `kind` step ("train", "test", "predict") on its part,
        then the combine. Returns the predictions (a padded replica's sliced to none) for "predict";
        for the others (the logs with their numbers averaged over the replicas, weighted by rows; the
        keys whose values were a metric's result, which the caller reads from replica 0's metrics)."""
        ctx = md.get_replica_context()
        rid = ctx.local_replica_id
        copy_ = self.replicas[rid]
        n = rows
        device = next((p.device for p in copy_.parameters()), torch.device("cpu"))
        metrics = _metric_variables(copy_) if kind != "predict" else []  # (predict leaves the metrics alone)
        state = _mirroring.state_tensors(copy_) or []
        journal = md.current_journal()
        if journal is not None:  # a failed (or redone) step puts these back
            journal.before_forward(copy_)
            for t, _ in state:
                journal.before_write(t)
            for _, v in metrics:
                journal.before_write(v._value)
        with torch.no_grad():
            base = [v._value.clone() for _, v in metrics]
            for _, v in metrics:
                v._value.zero_()  # each holds this step's increment, added to every replica's after it
        w, divide = weight(copy_, n)
        step = ReplicaStep(self, n, global_rows, w, divide)
        trainable = [v._value for v in copy_.trainable_weights] if kind == "train" else []
        before = list(map(_VERSION, trainable))
        _STEP.step = step
        try:
            with device_scope(device):
                out = getattr(copy_, f"{kind}_step")(part)
            if kind == "predict":
                return out if n else md.map_structure(lambda t: t[:0] if isinstance(t, Tensor) else t, out)
            # Metrics built in the step (a compiled metric builds at its first batch) started from zeros.
            was = {id(v): b for (_, v), b in zip(metrics, base)}
            after = _metric_variables(copy_)
            base_after = [was[id(v)] if id(v) in was else torch.zeros_like(v._value) for _, v in after]
            return self._combine(ctx, copy_, step, after, base_after, state, out,
                                 _outside_apply(trainable, before, step.applied), _keras_own(copy_, kind))
        except BaseException:
            with torch.no_grad():
                for (_, v), b in zip(metrics, base):
                    v._value.copy_(b)
            raise
        finally:
            _STEP.step = None
            if kind == "train":
                for t in trainable:  # (Keras clears them first thing next step; nothing reads them before)
                    t.grad = None

    def _combine(self, ctx: Any, copy_: nn.Module, step: ReplicaStep, metrics: list[tuple[Any, Any]],
                 base: list[Tensor], state: list[tuple[Tensor, str]], logs: Any, written: list[Tensor],
                 logs_are_metrics: bool) -> Any:
        """One all-reduce after the step: metric increments summed onto replica 0's state before it,
        state averaged weighted by rows, the logs' numbers averaged weighted by rows, and a checksum of
        trainable weights written outside an optimizer's apply (which must have the same values on every
        replica). Returns (the logs with their numbers averaged, the keys whose values were a metric's
        result): all of them for Keras's own steps, which return get_metrics_result()."""
        rows, first = step.rows, ctx.replica_id_in_sync_group == 0
        for m, v in metrics:
            if v.aggregation not in ("sum", "only_first_replica"):
                raise ValueError(f"metric {m.name!r} of {type(self._model).__name__}: its variable {v.path!r} has "
                                 f"aggregation={v.aggregation!r}, so the replicas' parts cannot be combined into one "
                                 "device's. Create metric variables with aggregation=\"sum\" (Keras's default for "
                                 "metrics).")
        logged = _numbers(logs)
        of_metrics = tuple(logs) if logs_are_metrics and isinstance(logs, Mapping) else _metric_keys(copy_, logs)
        f64 = torch.float64
        device = next((p.device for p in copy_.parameters()), torch.device("cpu"))
        means = [t for t, how in state if how == "mean"]
        firsts = [t for t, how in state if how != "mean"]
        values = [v._value for _, v in metrics]
        # (a padded replica's increments count for nothing; only replica 0's state before the step counts:
        # Keras resets and reads replica 0's metrics)
        keep = [float(rows > 0) if v.aggregation == "sum" else float(first) for _, v in metrics]
        increments = _flat(values, f64, device)
        if keep and min(keep) != max(keep):
            increments = increments * _per_element(keep, values, f64, device)
        elif keep:
            increments = increments * keep[0]
        n = ctx.num_replicas_in_sync
        sums = torch.zeros(2 * n + 1, dtype=f64, device=device)
        if written:
            me = ctx.replica_id_in_sync_group
            sums[2 * me] = torch.stack([t.detach().to(f64).sum() for t in written]).sum()
            sums[2 * me + 1] = torch.stack([t.detach().to(f64).square().sum() for t in written]).sum()
        sums[-1] = rows
        means_flat = _flat(means, f64, device)
        pieces = [increments, _flat(base, f64, device) * float(first), means_flat * rows,
                  _flat(firsts, f64, device) * float(first)]
        if logged:
            pieces.append(torch.stack([torch.as_tensor(v).detach().reshape(()).to(device=device, dtype=f64)
                                       for _, v in logged]) * step.share)
        pieces.append(sums)
        sizes = [p.numel() for p in pieces]
        total = ctx.all_reduce(md.ReduceOp.SUM, torch.cat(pieces))
        parts = total.split(sizes)
        increments, bases, mean_sums, first_values = parts[:4]
        checks, count = parts[-1][:-1].reshape(n, 2), parts[-1][-1]
        if written and not bool((checks == checks[0]).all()):
            raise ValueError(f"{type(self._model).__name__}.train_step wrote trainable weights outside the "
                             "optimizer's apply() with different values on different replicas (an update computed "
                             "from this replica's own gradients, say), so the replicas' copies would differ. Update "
                             "weights with self.optimizer.apply(grads, variables), which all-reduces the gradients "
                             "first, or write the same values on every replica.")
        with torch.no_grad():
            if values:
                summed = increments + bases
                is_sum = [v.aggregation == "sum" for _, v in metrics]
                if not all(is_sum):  # (an only_first_replica one: its increment)
                    summed = torch.where(_per_element(is_sum, values, torch.bool, device), summed, increments)
                _unflat(values, summed)
            if means:
                _unflat(means, torch.where(count > 0, mean_sums / count.clamp(min=1), means_flat))
            _unflat(firsts, first_values)
        if not isinstance(logs, Mapping):
            return logs, ()
        averaged = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in logs.items()}
        if logged:
            reduced = parts[4].to(torch.float32)
            for j, (path, _) in enumerate(logged):
                if len(path) == 1:
                    averaged[path[0]] = reduced[j]
                else:
                    averaged[path[0]][path[1]] = reduced[j]
        return averaged, of_metrics


def _flat(tensors: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The tensors' values in one flat tensor of `dtype` (empty for none)."""
    if not tensors:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat([t.detach().reshape(-1).to(device) for t in tensors]).to(dtype)


def _per_element(flags: list[Any], tensors: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """One entry per tensor, repeated over its elements: a mask or factor for _flat(tensors)."""
    return torch.tensor(flags, dtype=dtype, device=device).repeat_interleave(
        torch.tensor([t.numel() for t in tensors], device=device))


def _unflat(tensors: list[Tensor], flat: Tensor) -> None:
    """Writes `flat`'s consecutive pieces into `tensors`, each in its own dtype, in one foreach call (a
    copy rounds a float64 value to float32 as .to() does)."""
    if tensors:
        pieces = flat.split([t.numel() for t in tensors])
        torch._foreach_copy_(tensors, [piece.view(t.shape) for piece, t in zip(pieces, tensors)])


def with_metrics(model: nn.Module, logs: Any, of_metrics: tuple[str, ...]) -> Any:
    """A step's logs as they are reported: a value that was a metric's result on the replica becomes
    that metric's result now, from `model`'s metrics (each copy's hold every replica's parts)."""
    if not of_metrics:
        return logs
    results = model.get_metrics_result()
    if set(of_metrics) == set(logs) == set(results):
        return results
    by_name = {m.name: m for m in model.metrics}
    logs = dict(logs)
    for k in of_metrics:
        logs[k] = results[k] if k in results else by_name[k].result()
    return logs


def _keras_own(model: nn.Module, kind: str) -> bool:
    """Whether the model's `kind` step is Keras's own (which returns get_metrics_result())."""
    import keras

    return getattr(type(model), f"{kind}_step") is getattr(keras.Model, f"{kind}_step")


def _numbers(logs: Any) -> list[tuple[tuple[str, ...], Any]]:
    """The numbers of a step's logs (a dict of numbers, or of dicts of them), with their keys."""
    if not isinstance(logs, Mapping):
        return []
    found = []
    for k, v in logs.items():
        if isinstance(v, Mapping):
            found.extend(((k, kk), vv) for kk, vv in v.items() if _is_number(vv))
        elif _is_number(v):
            found.append(((k,), v))
    return found


def _metric_keys(model: nn.Module, logs: Any) -> tuple[str, ...]:
    """The keys of a step's logs whose value is a metric's result() as the step ended (the replica's
    part), so that the log reports that metric over every replica instead: the default steps'
    get_metrics_result(), and a step of your own that returns {m.name: m.result() for m in self.metrics}."""
    if not isinstance(logs, Mapping):
        return ()
    results = {m.name: m for m in model.metrics}
    flat = None
    found = []
    for k, v in logs.items():
        if k in results:
            mine = results[k].result()
        else:
            if flat is None:
                flat = model.get_metrics_result()
            if k not in flat:
                continue
            mine = flat[k]
        if _same(v, mine):
            found.append(k)
    return tuple(found)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and set(a) == set(b)
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and bool(torch.equal(a.detach(), b.detach()))
    return a is b


def _is_number(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and (value.is_floating_point() or not value.dtype.is_complex)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _first_row(leaf: Any, device: str) -> Any:
    if isinstance(leaf, Tensor):
        return leaf[:1].to(torch.device(device))
    if hasattr(leaf, "shape") and len(getattr(leaf, "shape", ())) > 0:
        return torch.as_tensor(leaf[:1]).to(torch.device(device))
    if isinstance(leaf, (list, tuple)):
        return leaf[:1]
    return leaf


def _outside_apply(trainable: list[Tensor], before: list[int], applied: dict[int, int]) -> list[Tensor]:
    """The trainable tensors written in the step other than by an optimizer's apply (their version moved
    past what the last apply that wrote them left)."""
    return [t for t, v in zip(trainable, before) if t._version != applied.get(id(t), v)]


def no_grad_unless(kind: str) -> Any:
    """Keras's test and predict functions run without autograd; strategy.run carries it to the replicas."""
    return contextlib.nullcontext() if kind == "train" else torch.no_grad()
