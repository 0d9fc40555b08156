"""Variables: `mr.Variable` and the mirrored state it becomes inside a strategy's scope.

Outside any scope a Variable holds one tensor. Created in a scope it holds one tensor per replica:
a `MirroredVariable` (ON_WRITE: the copies are kept identical by every write) or a
`SyncOnReadVariable` (ON_READ: each replica writes its own copy; a cross-replica read aggregates).
Created inside strategy.run, it is one such variable for all replicas, from the first replica's
initial value (a merge_call). The write rules follow tf.distribute 2.21 (measured); each method
says which context does what. `update` is `strategy.extended.update`'s work on each copy. torch
functions and arithmetic accept a Variable where they accept a tensor (its current value).
Uses context.py, values.py and devices.py.
"""
from __future__ import annotations

import copy
import enum
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mirrored.distribute import context
from mirrored.distribute.devices import torch_device
from mirrored.distribute.rollback import journal_of
from mirrored.distribute.values import (DistributedValues, Mirrored, PerReplica, ReduceOp, map_structure, regroup,
                                        select_replica)

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy


class VariableSynchronization(enum.Enum):
    """When the copies of a variable are synchronised (tf.VariableSynchronization)."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How per-replica writes (ON_WRITE) or copies (ON_READ) combine (tf.VariableAggregation)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


def _as_enum(value: Any, kind: type[enum.Enum], arg: str) -> Any:
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value.upper() in kind.__members__:
        return kind[value.upper()]
    raise ValueError(f"Variable({arg}={value!r}): expected one of "
                     f"{', '.join(f'{kind.__name__}.{m}' for m in kind.__members__)}.")


class Variable:
    """A mutable tensor (tf.Variable). In a strategy's scope it becomes a MirroredVariable or a
    SyncOnReadVariable, chosen by `synchronization`."""

    def __new__(cls, initial_value: Any = None, trainable: bool | None = None, name: str | None = None,
                dtype: torch.dtype | None = None, synchronization: Any = VariableSynchronization.AUTO,
                aggregation: Any = VariableAggregation.NONE):
        if cls is not Variable:
            return super().__new__(cls)
        sync = _as_enum(synchronization, VariableSynchronization, "synchronization")
        strategy = context.get_strategy()
        if not strategy._mirrors_variables:  # the default and one-device strategies: plain, as TF's
            return super().__new__(cls)
        if sync is VariableSynchronization.NONE:
            raise ValueError(
                f"Variable(name={name!r}, synchronization=NONE) in {type(strategy).__name__}'s scope: NONE "
                "synchronization is not supported with a distribution strategy (as in TF). Use ON_WRITE (the "
                "default: identical copies) or ON_READ (per-replica copies aggregated on read), or create the "
                "variable outside the scope.")
        ctx = context.get_replica_context()
        if ctx is not None:
            # Inside strategy.run, as TF: one variable for every replica, built once in cross-replica
            # context from the first replica's initial value; every replica gets the same object. The
            # first replica calls its initializer here, in its own context, as in TF; the others' are
            # never called.
            if ctx.local_replica_id == 0 and callable(initial_value):
                initial_value = initial_value()
            return ctx.merge_call(_create_for_every_replica, args=(initial_value,),
                                  kwargs={"trainable": trainable, "name": name, "dtype": dtype,
                                          "synchronization": sync, "aggregation": aggregation})
        return super().__new__(SyncOnReadVariable if sync is VariableSynchronization.ON_READ else MirroredVariable)

    def __init__(self, initial_value: Any = None, trainable: bool | None = None, name: str | None = None,
                 dtype: torch.dtype | None = None, synchronization: Any = VariableSynchronization.AUTO,
                 aggregation: Any = VariableAggregation.NONE):
        if self.__dict__.get("_values") is not None:  # built by the merge_call in __new__ already
            return
        if initial_value is None:
            raise ValueError(f"Variable(name={name!r}): initial_value is required.")
        if callable(initial_value):
            initial_value = initial_value()
        self._sync = _as_enum(synchronization, VariableSynchronization, "synchronization")
        self._aggregation = _as_enum(aggregation, VariableAggregation, "aggregation")
        self._strategy: Strategy = context.get_strategy()
        if self._sync is VariableSynchronization.AUTO and self._strategy._mirrors_variables:
            self._sync = VariableSynchronization.ON_WRITE  # as TF reports a distributed variable's AUTO
        # Only the default follows the synchronization (ON_READ: not trainable); TF 2.21 takes an explicit
        # trainable=True for an ON_READ variable and reports it.
        self._trainable = bool(self._sync is not VariableSynchronization.ON_READ if trainable is None else trainable)
        self._name = name or "Variable"
        value = torch.as_tensor(_unwrap(initial_value), dtype=dtype)
        if (self._aggregation is VariableAggregation.MEAN and self._strategy._mirrors_variables
                and not (value.is_floating_point() or value.is_complex())):
            # As TF 2.21 refuses it at creation: the mean of integer copies has no integer value.
            raise ValueError(
                f"Variable(name={name!r}): aggregation=MEAN on a {value.dtype} variable in "
                f"{type(self._strategy).__name__}'s scope: the mean of integer copies is not an integer (TF "
                "refuses this too). Use aggregation=SUM or ONLY_FIRST_REPLICA, or a floating-point dtype.")
        requires_grad = self._trainable and (value.is_floating_point() or value.is_complex())
        copies = []
        for device in self._strategy.extended.worker_devices:
            t = value.detach().to(torch_device(device), copy=True)
            copies.append(t.requires_grad_(requires_grad))
        self._values: tuple[Tensor, ...] = tuple(copies)

    # ---- properties --------------------------------------------------------------------------
    @property
    def values(self) -> tuple[Tensor, ...]:
        """One tensor per replica, in replica order."""
        return self._values

    name = property(lambda self: self._name, doc="The name given at creation (default \"Variable\").")
    trainable = property(lambda self: self._trainable,
                         doc="Whether gradients flow to it (default: True unless synchronization is ON_READ).")
    synchronization = property(lambda self: self._sync,
                               doc="When the copies agree: ON_WRITE (mirrored) or ON_READ (aggregated when read).")
    aggregation = property(lambda self: self._aggregation,
                           doc="How copies combine: NONE, SUM, MEAN or ONLY_FIRST_REPLICA (a VariableAggregation).")
    shape = property(lambda self: self._values[0].shape, doc="The shape of every copy (a torch.Size).")
    dtype = property(lambda self: self._values[0].dtype, doc="The dtype of every copy.")
    device = property(lambda self: self._local().device,
                      doc="The device of the copy this context reads (the replica's; replica 0's outside run).")

    @property
    def distribute_strategy(self) -> Strategy | None:
        """The strategy whose scope created this variable; None for one made outside any (as in TF)."""
        return None if self._strategy._is_default else self._strategy

    def _replica_id(self) -> int | None:
        """This variable's replica in the current context, None in cross-replica context."""
        ctx = context.replica_of(self._strategy)
        return None if ctx is None else ctx.local_replica_id

    def _local(self) -> Tensor:
        rid = self._replica_id()
        return self._values[rid or 0]

    # ---- reads -------------------------------------------------------------------------------
    def read_value(self) -> Tensor:
        """The value now: this replica's copy in replica context (see subclasses for cross-replica
        reads), as a new tensor, so that a later write does not change it (as in TF, where a read is a
        snapshot) and modifying it does not change one copy behind the others' back. Differentiable."""
        return self._local().clone()

    def value(self) -> Tensor:
        """read_value() (TF's name for the same snapshot)."""
        return self.read_value()

    def numpy(self) -> Any:
        """read_value() as a numpy array, on the CPU."""
        return self.read_value().detach().cpu().numpy()

    def item(self) -> Any:
        """read_value() of a one-element variable as a Python number."""
        return self.read_value().item()

    # ---- writes: a plain variable has one copy -----------------------------------------------
    # TF's signature: use_locking and name change nothing here (writes are serialised per copy);
    # read_value=False returns None instead of the variable.
    def assign(self, value: Any, use_locking: bool = False, name: str | None = None,
               read_value: bool = True) -> Variable | None:
        """Writes `value` with the semantics of the context (subclasses: every copy, or this replica's).

        Returns:
            The variable, or None with read_value=False (TF's signature; use_locking and name do nothing).
        """
        del use_locking, name
        self._update(value, "assign")
        return self if read_value else None

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None,
                   read_value: bool = True) -> Variable | None:
        """Adds `delta` in place, as assign() writes; returns the variable (None with read_value=False)."""
        del use_locking, name
        self._update(delta, "assign_add")
        return self if read_value else None

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None,
                   read_value: bool = True) -> Variable | None:
        """Subtracts `delta` in place, as assign() writes; returns the variable (None with read_value=False)."""
        del use_locking, name
        self._update(delta, "assign_sub")
        return self if read_value else None

    def _update(self, value: Any, op: str) -> Variable:
        _write(self._values[0], value, op)
        return self

    # ---- behaving like a tensor ----------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        args, kwargs = map_structure(_unwrap, (tuple(args), dict(kwargs or {})))
        return func(*args, **kwargs)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    # detach(): converting a tensor that requires grad to a Python number warns in torch.
    def __float__(self) -> float:
        return float(self.read_value().detach())

    def __int__(self) -> int:
        return int(self.read_value().detach())

    def __bool__(self) -> bool:
        return bool(self.read_value().detach())

    def __deepcopy__(self, memo: dict) -> Variable:
        """An independent variable with equal copies, of the same strategy (which is shared, not
        copied: a strategy owns threads), as TF's deepcopy of a distributed variable."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_values":
                value = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in value)
            elif key not in ("_strategy", "_distributed_container"):
                value = copy.deepcopy(value, memo)
            new.__dict__[key] = value
        return new

    def __repr__(self) -> str:
        kind = type(self).__name__
        if len(self._values) == 1:
            return f"<{kind} {self._name!r} shape={tuple(self.shape)} dtype={self.dtype} value={self._values[0].tolist()}>"
        body = ", ".join(f"{i}: {v.tolist()}" for i, v in enumerate(self._values))
        return f"<{kind} {self._name!r} shape={tuple(self.shape)} dtype={self.dtype} {{{body}}}>"


def _unwrap(x: Any) -> Any:
    return x.read_value() if isinstance(x, Variable) else x


def _binary(name: str) -> Any:
    def method(self: Variable, other: Any) -> Any:
        return getattr(self.read_value(), name)(_unwrap(other))

    method.__name__ = name
    return method


# TF's true division of integers (math_ops._TRUEDIV_TABLE): 8- and 16-bit ones divide in float32,
# 32- and 64-bit ones in float64 (torch would give float32 for all, 7 / 3 = 2.3333332538604736).
_TRUEDIV_AS = {torch.int8: torch.float32, torch.uint8: torch.float32, torch.int16: torch.float32,
               torch.int32: torch.float64, torch.int64: torch.float64}


def _truediv(name: str) -> Any:
    def method(self: Variable, other: Any) -> Any:
        value, other = self.read_value(), _unwrap(other)
        wide = _TRUEDIV_AS.get(value.dtype)
        if wide is not None and isinstance(other, (int, Tensor)) and not (
                isinstance(other, Tensor) and (other.is_floating_point() or other.is_complex())):
            value = value.to(wide)
            other = other.to(wide) if isinstance(other, Tensor) else other
        return getattr(value, name)(other)

    method.__name__ = name
    return method


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
            "lt", "le", "gt", "ge", "eq", "ne"):
    for _name in (f"__{_op}__", f"__r{_op}__"):
        if hasattr(Tensor, _name):
            setattr(Variable, _name, (_truediv if _op == "truediv" else _binary)(_name))
Variable.__neg__ = lambda self: -self.read_value()  # type: ignore[attr-defined]
Variable.__invert__ = lambda self: ~self.read_value()  # type: ignore[attr-defined]
Variable.__abs__ = lambda self: abs(self.read_value())  # type: ignore[attr-defined]
Variable.__getitem__ = lambda self, key: self.read_value()[key]  # type: ignore[attr-defined]
Variable.__hash__ = object.__hash__  # type: ignore[assignment]  # identity, as tf.Variable


_EXACT_FOR_INTS = (torch.int64, torch.float64)  # dtypes that hold every int up to _INT_LIMIT exactly
_INT_LIMIT = 2 ** 53


def _write(target: Tensor, value: Any, op: str) -> None:
    """target := value / += / -= value, in place, outside autograd."""
    value = _unwrap(value)
    # (a metric's update writes twice per replica step: a value already of the target's dtype and device,
    # or a whole number for an int64 or float64 target, needs no conversion - each torch call on the step's
    # path hands the GIL to the other replicas)
    if isinstance(value, Tensor):
        if value.dtype != target.dtype or value.device != target.device:
            value = value.to(device=target.device, dtype=target.dtype)
    elif not (type(value) is int and target.dtype in _EXACT_FOR_INTS and -_INT_LIMIT <= value <= _INT_LIMIT):
        value = torch.as_tensor(value, dtype=target.dtype).to(target.device)
    elif op == "assign":
        with torch.no_grad():
            target.fill_(value)
        return
    if isinstance(value, Tensor) and value.shape != target.shape and value.numel() != 1 \
            and not _broadcasts_to(value.shape, target.shape):
        raise ValueError(f"Variable.{op}: value of shape {tuple(value.shape)} does not fit a variable of shape "
                         f"{tuple(target.shape)}.")
    with torch.no_grad():
        if op == "assign":
            target.copy_(value)
        elif op == "assign_add":
            target.add_(value)
        else:
            target.sub_(value)


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:  # broadcast_shapes raises, rather than returns, for shapes that do not broadcast
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _apply(current: Tensor, value: Tensor, op: str) -> Tensor:
    """The value a copy takes after `op` with `value`, without writing it."""
    if op == "assign":
        return value
    return current + value if op == "assign_add" else current - value


class MirroredVariable(Variable):
    """ON_WRITE: one identical copy per replica (tf.distribute.MirroredVariable).

    Cross-replica context: a read gives replica 0's copy; a write updates every copy.
    Replica context: a read gives the replica's copy. A write with aggregation NONE updates only
    the calling replica's copy (the caller supplies equal values, as an optimizer applying
    all-reduced gradients does); SUM, MEAN and ONLY_FIRST_REPLICA first combine the values of all
    replicas (a merge_call) and then every copy gets the same result."""

    def _update(self, value: Any, op: str) -> Variable:
        rid = self._replica_id()
        if rid is None:
            if isinstance(value, DistributedValues):  # TF writes each copy its own value: they diverge
                raise ValueError(
                    f"MirroredVariable {self._name!r}.{op}({type(value).__name__}) in cross-replica context: one "
                    "value per replica would make the copies differ. Pass one value for every copy, or write "
                    "inside strategy.run, where the variable's aggregation combines the replicas' values.")
            for t in self._values:
                _write(t, value, op)
            return self
        agg = self._aggregation
        if agg is VariableAggregation.NONE:
            _note_write(self._values[rid])
            _write(self._values[rid], value, op)
            return self
        ctx = context.get_replica_context()
        ctx.merge_call(_merge_update, args=(self, value, op))
        return self


def _create_for_every_replica(strategy: Strategy, initial_value: Any, **kwargs: Any) -> Variable:
    """The merge_call function of a Variable created inside strategy.run: the first replica's
    arguments make the one variable, as TF's shared variable creator hands the later replicas the
    variable the first one made."""
    del strategy
    initial_value, kwargs = select_replica(0, (initial_value, kwargs))
    return Variable(initial_value, **kwargs)


def update(strategy: Strategy, var: Variable, fn: Any, args: tuple, kwargs: dict, group: bool) -> Any:
    """`strategy.extended.update` in cross-replica context: fn(copy, *args, **kwargs) once per copy of
    `var`, each copy with its replica's part of every PerReplica / Mirrored argument (TF's
    MirroredExtended._update). Returns the results as a Mirrored (group=True; a variable result is read
    into a tensor, as TF's grouped update returns tensors) or as one tuple per result (group=False)."""
    if not isinstance(var, Variable):
        raise TypeError(f"strategy.extended.update(var={type(var).__name__}): expected a variable created in "
                        "the strategy's scope (mr.Variable).")
    if not callable(fn):
        raise TypeError(f"strategy.extended.update(fn={fn!r}): fn must be callable, as fn(var_copy, *args).")
    if type(var) is Variable:  # a plain variable (default or one-device strategy): fn gets it itself
        result = fn(var, *select_replica(0, args), **select_replica(0, kwargs))
        return result if group else map_structure(lambda x: (x,), result)
    if var._strategy is not strategy:
        raise ValueError(f"strategy.extended.update: {var._name!r} belongs to {var._strategy!r}, not {strategy!r}. "
                         "Update a variable with the strategy whose scope created it.")
    results = [fn(_copy_of(var, r), *select_replica(r, args), **select_replica(r, kwargs))
               for r in range(len(var.values))]
    if group:
        results = [map_structure(lambda x: x.read_value() if isinstance(x, Variable) else x, r) for r in results]
    regrouped = regroup(results, Mirrored)
    if group:
        return regrouped
    return map_structure(lambda x: x.values if isinstance(x, DistributedValues) else (x,), regrouped)


def _copy_of(var: Variable, replica: int) -> Variable:
    """Replica `replica`'s copy of `var` as a one-copy Variable over the same tensor, so that writes
    through it change that copy (what TF's update hands fn: the component variable)."""
    view = object.__new__(Variable)
    view.__dict__.update(var.__dict__)
    view._strategy = context._default_strategy()  # a plain variable: no replica indexes into its one copy
    view._values = (var.values[replica],)
    if replica:
        view._name = f"{var._name}/replica_{replica}"
    view._distributed_container = var
    return view


def value_container(value: Any) -> Any:
    """The distributed variable whose copy `value` is (a copy `extended.update` handed its function),
    else `value` itself (TF's StrategyExtended.value_container)."""
    container = getattr(value, "_distributed_container", None) if isinstance(value, Variable) else None
    return value if container is None else container


def _merge_update(strategy: Strategy, var: MirroredVariable, value: Any, op: str) -> None:
    """Runs once, in cross-replica context: combines the replicas' values and writes every copy."""
    parts = strategy.experimental_local_results(value)
    parts = [torch.as_tensor(_unwrap(p), dtype=var.dtype) for p in parts]
    agg = var.aggregation
    shared = not isinstance(value, DistributedValues) and len(strategy.extended.worker_devices) > 1
    if shared and agg is VariableAggregation.SUM and not bool((parts[0] == 0).all()):
        # Every replica passed the same object (a constant): TF refuses to sum it (the total would
        # depend on whether the replicas built the value themselves or shared one); zeros sum to zero.
        raise ValueError(
            f"MirroredVariable {var.name!r}.{op} in replica context with aggregation SUM got the same value "
            f"({value!r}) from every replica, so summing it is ambiguous (TF raises too). Pass a per-replica "
            "value (computed inside the replica function), or use aggregation MEAN or ONLY_FIRST_REPLICA.")
    if agg is VariableAggregation.ONLY_FIRST_REPLICA or shared or strategy.num_replicas_in_sync == 1:
        combined = parts[0]
    else:
        reduce_op = ReduceOp.SUM if agg is VariableAggregation.SUM else ReduceOp.MEAN
        # A multi-worker strategy holds one local part; its reduce adds the other workers' parts.
        combined = strategy.reduce(reduce_op, PerReplica(parts) if len(parts) > 1 else parts[0])
    for t in var.values:
        _write(t, combined, op)


class SyncOnReadVariable(Variable):
    """ON_READ: each replica writes its own copy; a cross-replica read aggregates them.

    Replica context: reads and writes touch the replica's own copy.
    Cross-replica context: a read gives SUM / MEAN of the copies, or replica 0's for
    ONLY_FIRST_REPLICA. `assign` writes every copy so that the aggregate reads back the value
    (SUM: each copy gets value / replicas, as TF does; integers split exactly). `assign_add` and
    `assign_sub` with SUM are refused there, as in TF: the meaning (add to each copy, or to the
    total) is ambiguous."""

    def read_value(self) -> Tensor:
        """This replica's copy in replica context; in cross-replica context the copies aggregated by
        the variable's aggregation (SUM, MEAN, or replica 0's for ONLY_FIRST_REPLICA; NONE is refused)."""
        rid = self._replica_id()
        if rid is not None:
            return self._values[rid].clone()  # a snapshot, as Variable.read_value
        agg = self._aggregation
        if agg is VariableAggregation.ONLY_FIRST_REPLICA or self._strategy.num_replicas_in_sync == 1:
            return self._values[0].clone()
        if agg is VariableAggregation.NONE:
            raise ValueError(
                f"SyncOnReadVariable {self._name!r} has aggregation NONE, so it cannot be read in cross-replica "
                "context (there is no rule to combine its copies). Create it with aggregation=SUM, MEAN or "
                "ONLY_FIRST_REPLICA, or read one copy with strategy.experimental_local_results(var).")
        op = ReduceOp.SUM if agg is VariableAggregation.SUM else ReduceOp.MEAN
        # Through the strategy, so that a multi-worker strategy adds the other workers' copies too.
        local = PerReplica([t.detach() for t in self._values]) if len(self._values) > 1 else self._values[0].detach()
        return self._strategy.reduce(op, local)

    def _update(self, value: Any, op: str) -> Variable:
        rid = self._replica_id()
        if rid is not None:
            _note_write(self._values[rid])
            _write(self._values[rid], value, op)
            return self
        n = self._strategy.num_replicas_in_sync
        if self._aggregation is VariableAggregation.SUM and n > 1:
            if op != "assign":
                raise ValueError(
                    f"SyncOnReadVariable {self._name!r}.{op} in cross-replica context is not supported when "
                    "aggregation is SUM (as in TF): it is unclear whether to change each copy or the total. "
                    "Call it inside strategy.run, or assign() the new total.")
            parts = _split_total(torch.as_tensor(_unwrap(value), dtype=self.dtype), n)
            first = self._strategy.first_replica_id  # this process's first replica (multi-worker)
            for t, part in zip(self._values, parts[first:]):
                _write(t, part, "assign")
            return self
        for t in self._values:
            _write(t, value, op)
        return self


def _note_write(copy_: Tensor) -> None:
    """A copy written by its replica inside strategy.run goes back to its value if the step fails."""
    journal = journal_of(context.get_replica_context())
    if journal is not None:
        journal.before_write(copy_)


def _split_total(total: Tensor, n: int) -> list[Tensor]:
    """n parts whose sum is `total`: total / n each for floats; for integers, exact shares."""
    if total.is_floating_point() or total.is_complex():
        return [total / n] * n
    share = torch.div(total, n, rounding_mode="floor")
    return [total - share * (n - 1)] + [share] * (n - 1)
