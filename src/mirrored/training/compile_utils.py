"""compile()'s loss, loss_weights, metrics and weighted_metrics against the module's outputs, as Keras 3's
CompileLoss and CompileMetrics resolve them (keras/src/trainers/compile_utils.py): one output, or a
module returning a dict, list or tuple of tensors with a loss (and metrics) per output, and the names
the logs give them (`loss`, then `cls_loss`, `cls_accuracy`; one output's metrics keep their own
names). Arguments for one output are resolved at compile(); arguments per output (a loss dict or
list, metrics keyed by output) and labels given per output are resolved by `build` at the first
step, from what the module returned, as Keras builds them at its first call. Uses losses.py,
metrics.py.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from mirrored.training import losses as losses_lib, metrics as metrics_lib

Path = tuple[Any, ...]  # where an output sits in the module's result: () for one output, ("cls",) or (1,)


@dataclass
class OutputLoss:
    """One output's loss: where the output is, the loss, its loss_weights entry (None: 1), and the name
    the logs give it (`<name>_loss`, kept by `tracker` where there are several losses)."""

    path: Path
    loss: losses_lib.Loss
    weight: float | None
    name: str
    tracker: metrics_lib.Mean | None = None


@dataclass
class OutputMetrics:
    """One output's metrics, or its weighted_metrics (which take the sample weights); `output_name`
    prefixes their names in the logs (None for a single output, or outputs without names)."""

    path: Path
    output_name: str | None
    metrics: list[Any]
    weighted: bool


@dataclass
class CompiledOutputs:
    """What compile() was given; once `built`, the losses (flat, one per output that has one) and the
    metric lists per output, and `names`: (log name, metric) in Keras's order."""

    adapter: Any
    loss: Any
    loss_weights: Any
    metrics: Any
    weighted_metrics: Any
    output_names: list[str] | None  # the module's own (a Keras functional model's), else None
    losses: list[OutputLoss] = field(default_factory=list)
    metric_sets: list[OutputMetrics] = field(default_factory=list)
    paths: list[Path] = field(default_factory=lambda: [()])
    single: bool = True  # resolved for one output
    built: bool = False
    names: list[tuple[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_types(self.loss_weights, self.metrics, self.weighted_metrics)
        if _per_output(self.loss, self.loss_weights, self.metrics, self.weighted_metrics):
            self.single = False  # (built at the first step, against the outputs)
        else:
            self._build_single()

    @property
    def single_loss(self) -> losses_lib.Loss | None:
        """The loss of a model with one output (None without a loss, or with several outputs)."""
        return self.losses[0].loss if self.single and self.losses else None

    # ---- one output, at compile ------------------------------------------------------------------
    def _build_single(self) -> None:
        loss = None if self.loss is None else _resolve_loss(self.adapter, self.loss, "compile(loss=...)")
        weight = self.loss_weights
        if isinstance(weight, (list, tuple)):  # (one entry: Keras flattens it onto the one loss)
            weight = weight[0] if weight else None
        self.losses = ([OutputLoss((), loss, _weight(weight, "compile(loss_weights=...)"), loss.name)]
                       if loss is not None else [])
        name = loss.name if loss is not None else None
        self.metric_sets = [
            OutputMetrics((), None, [self.adapter.metric(m, name) for m in _flat(self.metrics)], False),
            OutputMetrics((), None, [self.adapter.metric(m, name) for m in _flat(self.weighted_metrics)], True)]
        self.paths, self.single, self.built = [()], True, True
        self._name_logs()

    # ---- against the outputs, at the first step --------------------------------------------------
    def needs_build(self, y: Any) -> bool:
        """Whether a step must build first. The same answer on every replica, an empty part's included:
        it reads compile's arguments, the labels' structure and the metrics' state, not the outputs."""
        if not self.built or (self.single and is_nested(y)):
            return True
        return any(_state_pending(m) for s in self.metric_sets for m in s.metrics)

    def build(self, y: Any, y_pred: Any) -> None:
        """Resolves the losses and metrics against `y_pred` (one tensor, or a dict, list or tuple of them)
        and makes the state metrics make at their first update (F1Score's per-class counts), so that no
        step makes it; in cross-replica context, once."""
        if not self.built or (self.single and is_nested(y)):
            self._build_outputs(y_pred)
        for output in self.metric_sets:
            pending = [m for m in output.metrics if _state_pending(m)]
            if pending:
                y_t, y_p = self.part_of(y, output.path, "metrics"), select(y_pred, output.path)
                for m in pending:
                    m._build_state(y_t, y_p)

    def _build_outputs(self, y_pred: Any) -> None:
        paths, names = _outputs(y_pred, self.output_names)
        self.paths, self.single = paths, False
        # A list (of losses or metrics) meets a plain dict's outputs in sorted key order, as Keras flattens the
        # dict (an OrderedDict's, or the module's own output names, as they come).
        order = list(range(len(paths)))
        if isinstance(y_pred, Mapping) and not isinstance(y_pred, OrderedDict) and not (
                self.output_names and set(self.output_names) == set(y_pred)):
            try:
                order = sorted(order, key=lambda i: paths[i][0])
            except TypeError:  # (keys that do not sort keep their order)
                pass
        ordered = [(paths[i], names[i]) for i in order]
        self.losses = self._resolve_losses(ordered if isinstance(self.loss, (list, tuple)) else list(zip(paths, names)),
                                           ordered)
        if len(self.losses) > 1:  # Keras tracks each output's loss only where there are several
            for out in self.losses:
                out.tracker = metrics_lib.Mean(name=f"{out.name}_loss")
        loss_names = {out.path: out.loss.name for out in self.losses}
        self.metric_sets = [
            *self._resolve_metrics(self.metrics, ordered, loss_names, False, "metrics"),
            *self._resolve_metrics(self.weighted_metrics, ordered, loss_names, True, "weighted_metrics")]
        self.built = True
        self._name_logs()

    def _resolve_losses(self, outputs: list[tuple[Path, str | None]],
                        ordered: list[tuple[Path, str | None]]) -> list[OutputLoss]:
        loss, weights = self.loss, self.loss_weights
        paths, names = [p for p, _ in outputs], [n for _, n in outputs]
        if loss is None:
            return []
        per_output = _per_output_values(loss, paths, names, "loss")
        if weights is None or isinstance(weights, (int, float)):
            weight_of = {p: _weight(weights, "compile(loss_weights=...)") for p in paths}
        elif not _is_nested_argument(loss):
            raise ValueError(f"compile(loss_weights={weights!r}) with one loss for every output: give loss_weights "
                             "as one number (it weighs each output's loss), or give loss as a dict or list with an "
                             "entry per output.")
        else:
            weight_of = {p: _weight(w, "compile(loss_weights=...)") for p, w in _per_output_values(
                weights, [p for p, _ in ordered], [n for _, n in ordered], "loss_weights").items()}
        out = []
        for path in per_output:  # (the loss dict's or list's order, as Keras's)
            given = per_output[path]
            if given is None:
                continue
            resolved = _resolve_loss(self.adapter, given, f"compile(loss=...) for the output {_label(path)}")
            name = names[paths.index(path)]
            if name is None:  # an output without a name takes its loss's, as Keras names it
                name = given if isinstance(given, str) else resolved.name
            out.append(OutputLoss(path, resolved, weight_of.get(path), name))
        return out

    def _resolve_metrics(self, given: Any, outputs: list[tuple[Path, str | None]], loss_names: Mapping[Path, str],
                         weighted: bool, arg: str) -> list[OutputMetrics]:
        if not given:
            return []
        if len(outputs) == 1:  # one output: every metric applies to it, under its own name
            path = outputs[0][0]
            flat = [m for entry in (given.values() if isinstance(given, Mapping) else _flat(given))
                    for m in _flat(entry)]
            return [OutputMetrics(path, None, [self.adapter.metric(m, loss_names.get(path)) for m in flat], weighted)]
        paths = [p for p, _ in outputs]
        if not isinstance(given, Mapping) and len(given) != len(paths):
            raise ValueError(f"compile({arg}={given!r}): the module returns {len(paths)} outputs, so {arg} needs "
                             "one entry per output (a metric, a list of metrics, or None) or a dict keyed by "
                             f"output; got {len(given)} entries.")
        by_path = _per_output_values(given, paths, [n for _, n in outputs], arg)
        return [OutputMetrics(path, name, [self.adapter.metric(m, loss_names.get(path))
                                           for m in _flat(by_path[path])], weighted)
                for path, name in outputs if by_path.get(path) is not None]

    def _name_logs(self) -> None:
        """The logs' names, as Keras's CompileMetrics.result makes them (the output's name as a prefix; a
        name taken before gets _1, _2, ...; a weighted metric whose name a metric took, weighted_<name>),
        in Keras's order: the metrics, the weighted metrics, then each output's loss."""
        names: list[tuple[str, Any]] = []
        taken: dict[str, int] = {}

        def numbered(name: str) -> str:
            if name not in taken:
                taken[name] = 1
                return name
            index = taken[name]
            taken[name] += 1
            return f"{name}_{index}"

        for output in self.metric_sets:
            for m in output.metrics:
                prefix = f"{output.output_name}_" if output.output_name else ""
                name = prefix + m.name
                if output.weighted and name in taken:
                    name = numbered(f"{prefix}weighted_{m.name}")
                else:
                    name = numbered(name)
                names.append((name, m))
        names += [(out.tracker.name, out.tracker) for out in self.losses if out.tracker is not None]
        self.names = names

    # ---- a step's values -------------------------------------------------------------------------
    def metric_objects(self) -> list[Any]:
        """The compiled metrics and the per-output loss trackers, each once, in the logs' order."""
        return list({id(m): m for _, m in self.names}.values())

    def part_of(self, value: Any, path: Path, what: str) -> Any:
        """The labels (or sample weights) of the output at `path`: the value itself for one output;
        value[key] or value[i] for several (a list holding only the outputs that have a loss is matched
        to those, in order, as Keras does)."""
        if not path:
            if is_nested(value) and len(value) == 1:
                return next(iter(value.values())) if isinstance(value, Mapping) else value[0]
            return value
        if value is None:
            return None
        key = path[0]
        if isinstance(value, Mapping):
            if key in value:
                return value[key]
            if isinstance(key, int) and self.output_names and len(self.output_names) == len(self.paths) \
                    and self.output_names[key] in value:
                return value[self.output_names[key]]
            raise ValueError(f"the labels have no entry {key!r} for the output {_label(path)}, which has {what}: "
                             f"their keys are {list(value)}. Give y as a dict with a key per output.")
        if isinstance(value, (list, tuple)):
            keys = [p[0] for p in self.paths]
            with_loss = [out.path for out in self.losses]
            if len(value) == len(keys):
                return value[keys.index(key)]
            if len(value) == len(with_loss) and path in with_loss:
                return value[with_loss.index(path)]
            raise ValueError(f"the labels are a {type(value).__name__} of {len(value)} but the module returns "
                             f"{self.describe()}: give one label array per output (or per output with a loss), "
                             "in the outputs' order, or a dict keyed by output.")
        raise ValueError(f"the labels are one array but the module returns {self.describe()}: give y as a dict (or "
                         "tuple) holding the labels of each output.")

    def describe(self) -> str:
        return f"{len(self.paths)} outputs ({', '.join(_label(p) for p in self.paths)})"


def sample_weight_of(sample_weight: Any, path: Path, compiled: CompiledOutputs) -> Any:
    """One output's sample weights: one array weighs every output (Keras's rule), or a dict / list holds
    one per output."""
    if sample_weight is None or not is_nested(sample_weight):
        return sample_weight
    return compiled.part_of(sample_weight, path, "a loss")


def shares_needed(compiled: CompiledOutputs) -> bool:
    """Whether several outputs' losses are not all means over their values (a sum, an ignore_class): their
    replicas' gradients cannot all weigh by rows (Model._outputs_loss)."""
    return not compiled.single and any(out.loss.reduction != "sum_over_batch_size"
                                       or getattr(out.loss, "ignore_class", None) is not None
                                       for out in compiled.losses)


def select(value: Any, path: Path) -> Any:
    """value[path[0]][path[1]]... (value itself for the empty path)."""
    for key in path:
        value = value[key]
    return value


def is_nested(value: Any) -> bool:
    """A dict, list or tuple (of outputs, labels or weights), as opposed to one tensor."""
    return isinstance(value, (Mapping, list, tuple))


def flatten_metrics_in_order(logs: Mapping[str, Any], compiled: CompiledOutputs | None) -> list[Any]:
    """evaluate()'s list as Keras 3's _flatten_metrics_in_order makes it, so that code indexing it reads the
    same values: "loss", then each compiled metric's value under its own name (a weighted metric named as
    a metric is listed by that name, as Keras lists it), each output's loss, then every other key, sorted."""
    order = ["loss"]
    if compiled is not None:
        order += [m.name for output in compiled.metric_sets for m in output.metrics]
        order += [out.tracker.name for out in compiled.losses if out.tracker is not None]
    return [logs[k] for k in order if k in logs] + [logs[k] for k in sorted(logs) if k not in order]


def config_of(given: Any, resolve: Any) -> Any:
    """What compile() records of a loss, metric or loss weight argument, per output as given: each leaf
    through `resolve` (a name as it is, an object by its config)."""
    if isinstance(given, Mapping) and not is_config(given):
        return {k: config_of(v, resolve) for k, v in given.items()}
    if isinstance(given, (list, tuple)):
        return [config_of(v, resolve) for v in given]
    return None if given is None else resolve(given)


def from_config(recorded: Any, rebuild: Any) -> Any:
    """config_of's record as compile() takes it: each leaf through `rebuild`."""
    if isinstance(recorded, Mapping) and not is_config(recorded) and "object" not in recorded:
        return {k: from_config(v, rebuild) for k, v in recorded.items()}
    if isinstance(recorded, list):
        return [from_config(v, rebuild) for v in recorded]
    return None if recorded is None else rebuild(recorded)


def is_config(value: Any) -> bool:
    """A serialized object ({"class_name": ..., "config": {...}}), as opposed to a dict keyed by output."""
    return isinstance(value, Mapping) and "class_name" in value and "config" in value


# ---- helpers -----------------------------------------------------------------------------------------
def _check_types(loss_weights: Any, metrics: Any, weighted_metrics: Any) -> None:
    if loss_weights is not None and (isinstance(loss_weights, bool) or not isinstance(
            loss_weights, (int, float, list, tuple, Mapping))):
        raise TypeError(f"compile(loss_weights={loss_weights!r}): give a number (one output), or a list or dict "
                        "with a number per output.")
    for arg, value in (("metrics", metrics), ("weighted_metrics", weighted_metrics)):
        if value is not None and not isinstance(value, (list, tuple, Mapping)):
            raise TypeError(f"compile({arg}={value!r}): give a list of metrics (or a dict or list with the metrics "
                            f"of each output), as Keras takes it: {arg}=[{value!r}].")


def _is_nested_argument(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (isinstance(value, Mapping) and not is_config(value))


def _per_output(loss: Any, loss_weights: Any, metrics: Any, weighted_metrics: Any) -> bool:
    """Whether compile's arguments speak of outputs: a loss dict or list, weights per output, metrics keyed by
    output or with a list per output."""
    if _is_nested_argument(loss):
        return True
    if isinstance(loss_weights, Mapping) or (isinstance(loss_weights, (list, tuple)) and len(loss_weights) > 1):
        return True
    return any(isinstance(value, Mapping) or (isinstance(value, (list, tuple)) and any(
        v is None or _is_nested_argument(v) for v in value)) for value in (metrics, weighted_metrics))


def _flat(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [m for m in value if m is not None]
    return [value]


def _weight(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {value!r} is not a number; give each output's loss weight as a float.")
    return float(value)


def _resolve_loss(adapter: Any, given: Any, where: str) -> losses_lib.Loss:
    loss = adapter.loss(given)
    if getattr(loss, "reduction", None) == "none":
        raise ValueError(f"{where}: {given!r}: reduction='none' leaves one loss per example, but fit needs one "
                         "number to minimise. Use reduction='sum_over_batch_size' (the mean, Keras's default) or "
                         "'sum'.")
    return loss


def _outputs(y_pred: Any, output_names: list[str] | None) -> tuple[list[Path], list[str | None]]:
    """The outputs' paths and names: a dict's keys; a list's or tuple's positions, named by the module's
    own output names where it has them (a Keras functional model); one tensor: one output."""
    if isinstance(y_pred, Mapping):
        paths, names, leaves = [(k,) for k in y_pred], [str(k) for k in y_pred], list(y_pred.values())
    elif isinstance(y_pred, (list, tuple)):
        leaves = list(y_pred)
        paths = [(i,) for i in range(len(leaves))]
        names = list(output_names) if output_names and len(output_names) == len(leaves) else [None] * len(leaves)
    else:
        return [()], [output_names[0] if output_names and len(output_names) == 1 else None]
    if not paths:
        raise ValueError("the module returned an empty dict, list or tuple: no output to compute a loss on.")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, Tensor):
            raise ValueError(f"the module's output {_label(path)} is a {type(leaf).__name__}; mr.Model takes a "
                             "module returning one tensor, or a dict, list or tuple of tensors (one level): return "
                             "the outputs side by side, e.g. {\"cls\": logits, \"reg\": value}.")
    return paths, names


def _per_output_values(given: Any, paths: list[Path], names: list[str | None], arg: str) -> dict[Path, Any]:
    """compile's `arg` as {output path: its entry}, in the order given: a dict by output key (or output
    name), a list or tuple by position, anything else for every output."""
    if isinstance(given, Mapping) and not is_config(given):
        by_name = {name: path for name, path in zip(names, paths) if name is not None}
        out = {}
        for key, value in given.items():
            if paths != [()] and (key,) in paths:
                out[(key,)] = value
            elif key in by_name:
                out[by_name[key]] = value
            else:
                shown = ("one tensor, with no keys" if paths == [()] else
                         "outputs " + ", ".join(repr(p[0]) for p in paths))
                raise ValueError(f"compile({arg}={{{key!r}: ...}}): {key!r} names no output of the module, which "
                                 f"returns {shown}. Key {arg} by the keys of the dict the module returns (a tuple's "
                                 f"outputs take a list).")
        return out
    if isinstance(given, (list, tuple)):
        if len(given) != len(paths):
            raise ValueError(f"compile({arg}=[...]): {len(given)} entries for the module's {len(paths)} output(s); "
                             "give one entry per output (None for an output without one), or a dict keyed by output.")
        return dict(zip(paths, given))
    return {p: given for p in paths}


def _state_pending(metric: Any) -> bool:
    pending = getattr(metric, "_state_pending", None)
    return bool(pending()) if callable(pending) else False


def _label(path: Path) -> str:
    return repr(path[0]) if len(path) == 1 else ("(the only output)" if not path else repr(path))
