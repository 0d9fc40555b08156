"""Mirrored torch modules and optimizers: `strategy.mirror(net)` and `strategy.mirror_optimizer(...)`.

A MirroredModule keeps one copy of an `nn.Module` per replica (`.replicas`); calling it, or reading
an attribute, uses the calling replica's copy (replica 0's in cross-replica context). A
MirroredOptimizer keeps one torch optimizer per copy; `step()` in replica context first
all-reduces the replica's gradients (SUM, as TF's apply_gradients does: scale each replica's loss
by the GLOBAL batch), then every replica applies the same update, so the copies stay bitwise
identical; floating-point buffers (BatchNorm statistics) are averaged after the update. Uses
context.py, devices.py, values.py and variables.py; the strategy does the reduction.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mirrored.distribute import context
from mirrored.distribute.devices import torch_device
from mirrored.distribute.rollback import journal_of
from mirrored.distribute.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy


def _replica_id(strategy: Strategy) -> int:
    ctx = context.get_replica_context()
    if ctx is None or ctx.strategy is not strategy:
        return 0
    return ctx._replica_id  # this process's copy, also on a worker of a multi-worker strategy


class MirroredModule:
    """One copy of a module per replica; attribute access and calls go to the current replica's copy.

    In cross-replica context (outside strategy.run) what changes a module reaches every copy: train/
    eval, apply, load_state_dict, requires_grad_, zero_grad, dtype casts (to(dtype), double, float,
    half, bfloat16, type) and register_buffer/register_parameter/add_module; a submodule (mnet.fc,
    mnet[0], iterating) is itself mirrored, so mnet.fc.requires_grad_(False) freezes it everywhere.
    Other attributes read replica 0's copy: change tensors through every copy (mnet.replicas)."""

    def __init__(self, strategy: Strategy, module: nn.Module):
        if not isinstance(module, nn.Module):
            raise TypeError(f"strategy.mirror(module={type(module).__name__}): expected a torch.nn.Module.")
        if isinstance(module, MirroredModule):
            raise TypeError("strategy.mirror: this module is already mirrored.")
        devices = strategy.extended.worker_devices
        first = module.to(torch_device(devices[0]))
        copies = [first] + [copy.deepcopy(first).to(torch_device(d)) for d in devices[1:]]
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "replicas", tuple(copies))

    @classmethod
    def _of(cls, strategy: Strategy, copies: Any) -> MirroredModule:
        """The mirror of existing copies (one per replica, e.g. a submodule of each): nothing copied."""
        view = object.__new__(cls)
        object.__setattr__(view, "_strategy", strategy)
        object.__setattr__(view, "replicas", tuple(copies))
        return view

    def _cross_replica(self) -> bool:
        ctx = context.get_replica_context()
        return ctx is None or ctx.strategy is not self._strategy

    @property
    def values(self) -> tuple[nn.Module, ...]:
        return self.replicas

    @property
    def module(self) -> nn.Module:
        """The current replica's copy."""
        return self.replicas[_replica_id(self._strategy)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = context.get_replica_context()
        if ctx is None or ctx.strategy is not self._strategy:
            return self.replicas[0](*args, **kwargs)
        copy_ = self.replicas[ctx._replica_id]
        journal = journal_of(ctx)
        if journal is not None:  # a failed step puts this copy's gradients and buffers back
            journal.before_forward(copy_)
        return copy_(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.module, name)
        if isinstance(value, nn.Module) and self._cross_replica():
            return MirroredModule._of(self._strategy, [getattr(m, name) for m in self.replicas])
        return value

    def __getitem__(self, index: Any) -> Any:
        item = self.module[index]
        if isinstance(item, nn.Module) and self._cross_replica():
            return MirroredModule._of(self._strategy, [m[index] for m in self.replicas])
        return item

    def __len__(self) -> int:
        return len(self.module)

    def __bool__(self) -> bool:  # a module is true, whatever its len (which Python would ask otherwise)
        return True

    def __contains__(self, key: Any) -> bool:
        return key in self.module

    def __iter__(self) -> Iterator[Any]:
        if not self._cross_replica():
            return iter(self.module)
        return (MirroredModule._of(self._strategy, parts) if isinstance(parts[0], nn.Module) else parts[0]
                for parts in zip(*self.replicas))

    # Casts and new state reach every copy; each copy stays on its replica's device.
    def to(self, *args: Any, **kwargs: Any) -> MirroredModule:
        """Casts every copy (to(torch.float64)); a device would move every copy onto that one device,
        which is refused: the copies live on their replicas' devices."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        target = None if device is None else torch.device(device)  # "cuda" (no index) means where they are
        if target is not None and any(d.type != target.type or target.index not in (None, d.index)
                                      for d in self._devices()):
            raise ValueError(f"MirroredModule.to({device}): the copies live on their replicas' devices "
                             f"({', '.join(self._strategy.extended.worker_devices)}); moving them all to one "
                             "would break the mirroring. Change the dtype only, e.g. mnet.to(torch.float64).")
        for m in self.replicas:
            m.to(dtype=dtype, non_blocking=non_blocking, memory_format=memory_format)
        return self

    def cpu(self) -> MirroredModule:
        return self.to("cpu")  # a no-op where every copy is on the CPU already; refused otherwise

    def cuda(self, device: Any = None) -> MirroredModule:
        return self.to("cuda" if device is None else torch.device("cuda", device) if isinstance(device, int)
                       else device)

    def double(self) -> MirroredModule:
        return self.to(torch.float64)

    def float(self) -> MirroredModule:
        return self.to(torch.float32)

    def half(self) -> MirroredModule:
        return self.to(torch.float16)

    def bfloat16(self) -> MirroredModule:
        return self.to(torch.bfloat16)

    def type(self, dst_type: Any) -> MirroredModule:
        for m in self.replicas:
            m.type(dst_type)
        return self

    def _one_process(self, what: str) -> None:
        """New state copied within this process only: workers of a multi-worker strategy would each add
        their own (mirror() broadcasts rank 0's state; this does not)."""
        if getattr(self._strategy, "_world_size", 1) > 1:
            raise ValueError(f"MirroredModule.{what} on a multi-worker strategy: each worker would add its own "
                             "value. Add it to the module before strategy.mirror(), which broadcasts rank 0's.")

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        self._one_process("register_buffer")
        for m, device in zip(self.replicas, self._devices()):
            m.register_buffer(name, None if tensor is None else tensor.detach().to(device, copy=True), persistent)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Adds the parameter to every copy (an optimizer made before does not know it, as in torch)."""
        self._one_process("register_parameter")
        for m, device in zip(self.replicas, self._devices()):
            m.register_parameter(name, None if param is None else
                                 nn.Parameter(param.detach().to(device, copy=True), param.requires_grad))

    def add_module(self, name: str, module: nn.Module | None) -> None:
        self._one_process("add_module")
        for m, device in zip(self.replicas, self._devices()):
            m.add_module(name, None if module is None else copy.deepcopy(module).to(device))

    register_module = add_module

    def _devices(self) -> list[torch.device]:
        return [torch_device(d) for d in self._strategy.extended.worker_devices]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot set {name!r} on a MirroredModule: set it on every copy "
                             "(for m in mnet.replicas: ...) so the replicas stay identical.")

    # Calls that must reach every copy, not only the current one.
    def train(self, mode: bool = True) -> MirroredModule:
        for m in self.replicas:
            m.train(mode)
        return self

    def eval(self) -> MirroredModule:
        return self.train(False)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        result = None
        for m in self.replicas:
            result = m.load_state_dict(state_dict, strict=strict)
        return result

    def apply(self, fn: Callable[[nn.Module], None]) -> MirroredModule:
        for m in self.replicas:
            m.apply(fn)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the current replica's gradients inside strategy.run, every replica's outside it."""
        ctx = context.get_replica_context()
        own = ctx is not None and ctx.strategy is self._strategy
        for m in (self.module,) if own else self.replicas:
            m.zero_grad(set_to_none=set_to_none)

    def requires_grad_(self, requires_grad: bool = True) -> MirroredModule:
        for m in self.replicas:
            m.requires_grad_(requires_grad)
        return self

    def __repr__(self) -> str:
        return f"MirroredModule({len(self.replicas)} replicas of {type(self.replicas[0]).__name__})"


class MirroredOptimizer:
    """One torch optimizer per replica copy of a MirroredModule."""

    def __init__(self, strategy: Strategy, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 module: Any, hparams: dict[str, Any]):
        if not isinstance(module, MirroredModule):
            raise TypeError(f"strategy.mirror_optimizer(..., {type(module).__name__}): pass the module that "
                            "strategy.mirror() returned, so each replica's optimizer gets that replica's parameters.")
        if not callable(optimizer_cls):
            raise TypeError(f"strategy.mirror_optimizer({optimizer_cls!r}): pass an optimizer class such as "
                            "torch.optim.SGD (or a callable params -> optimizer).")
        self._strategy = strategy
        self._module = module
        self.replicas = tuple(optimizer_cls(m.parameters(), **hparams) for m in module.replicas)
        self._grad_buffers: dict = {}  # the strategy's persistent reduction buffers for this optimizer

    @property
    def values(self) -> tuple[torch.optim.Optimizer, ...]:
        return self.replicas

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The current replica's optimizer."""
        return self.replicas[_replica_id(self._strategy)]

    @property
    def param_groups(self) -> list[Any]:
        """Inside strategy.run, the replica's own optimizer's groups; outside it, groups whose
        hyperparameters are written to every replica's optimizer (g["lr"] = 0.01 changes them all)."""
        ctx = context.get_replica_context()
        if ctx is not None and ctx.strategy is self._strategy:
            return self.optimizer.param_groups
        return [_MirroredGroup([opt.param_groups[i] for opt in self.replicas])
                for i in range(len(self.replicas[0].param_groups))]

    def _params(self, rid: int) -> list[Tensor]:
        return [p for g in self.replicas[rid].param_groups for p in g["params"]]

    def reduce_gradients(self) -> None:
        """All-reduces (SUM) the calling replica's gradients in place of its `.grad`s."""
        ctx = context.get_replica_context()
        if ctx is None or ctx.strategy is not self._strategy or ctx.num_replicas_in_sync == 1:
            return
        rid = ctx._replica_id
        params = self._params(rid)
        reduced = self._strategy._reduce_gradients(ctx, self._grad_buffers, params, [p.grad for p in params])
        for p, g in zip(params, reduced):
            if p.grad is not g:  # after zero_grad(set_to_none=False) backward refilled last step's views
                p.grad = g

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Replica context: all-reduce this replica's gradients, then apply them with its optimizer."""
        if closure is not None:
            raise ValueError("MirroredOptimizer.step(closure) is not supported: run the forward/backward in "
                             "the replica function, then call step().")
        ctx = context.get_replica_context()
        in_own_replica = ctx is not None and ctx.strategy is self._strategy
        if not in_own_replica and self._strategy.num_replicas_in_sync > 1:  # else replica 0 alone would step
            raise RuntimeError("MirroredOptimizer.step() was called outside strategy.run (cross-replica context), "
                               "where it would update replica 0's copy only. Call it inside strategy.run(step_fn): "
                               "each replica all-reduces its gradients, then updates.")
        # An optimizer built by an mr.optimizers recipe with gradient accumulation keeps a step's gradients
        # local until its update step: then one all-reduce sends the sum of all of them.
        accumulate = getattr(self.optimizer, "accumulate_gradients", None)
        update = accumulate is None or accumulate()
        if update:
            self.reduce_gradients()
        result = self.optimizer.step()
        self.finish_step(commit=update)
        return result

    def finish_step(self, weight: float | None = None, commit: bool = True) -> None:
        """Ends a step: syncs the buffers (see sync_buffers) and, after an update applied by every
        replica (`commit`), commits the step, so that a failure later in the same strategy.run keeps
        the update and rolls back only what follows it. A step that only accumulated gradients locally
        is not committed: no meeting made every replica take it, so a failure rolls it back too.
        `step()` calls it; a loop that steps `self.optimizer` itself calls it after."""
        self.sync_buffers(weight)
        journal = journal_of(context.get_replica_context())
        if journal is not None and commit:
            journal.commit()

    def sync_buffers(self, weight: float | None = None) -> None:
        """Makes the module's buffers identical across replicas: floating-point ones (BatchNorm's running
        statistics) are averaged, as TF's MEAN-aggregated moving averages are; integer ones (BatchNorm's
        num_batches_tracked) take replica 0's value. With `weight` (this replica's examples in the step),
        the average is weighted by it: a replica whose part of a short last batch was empty (weight 0)
        did not update its statistics and does not count, and uneven parts count by their size, which
        gives a single device's update of the running mean on the whole batch."""
        ctx = context.get_replica_context()
        if ctx is None or ctx.strategy is not self._strategy or ctx.num_replicas_in_sync == 1:
            return
        net = self._module.replicas[ctx._replica_id]
        floats = [b for b in net.buffers() if b.is_floating_point()]
        ints = [b for b in net.buffers() if not b.is_floating_point() and not b.is_complex() and b.dtype != torch.bool]
        if not floats and not ints:  # (the same on every replica: no meeting at all)
            return
        first = ctx.replica_id_in_sync_group == 0
        # Averaged in float64: for float32 (or half) copies that are equal, the sum of n of them (weighted
        # by whole numbers) and its division are exact there, so a buffer that no step changed (a
        # constant, a frozen statistic) stays bit for bit itself; in its own dtype, (x + x + x) / 3 is
        # not always x, and such buffers drifted by an ulp here and there. Every copy of the module has
        # the same buffers, so the strategy may skip its shape check.
        # Without a weight every replica weighs 1: the same sum, divided by the replica count.
        w = 1.0 if weight is None else float(weight)
        sent = [b if first else torch.zeros_like(b) for b in ints] + [b.double() * w for b in floats]
        if floats:
            sent.append(torch.tensor(w, dtype=torch.float64, device=floats[0].device))
        summed = self._strategy._replica_all_reduce(ctx, ReduceOp.SUM, sent, same_shapes=True)
        with torch.no_grad():
            for b, value in zip(ints, summed):
                b.copy_(value)
            if floats:
                total = summed[-1]  # > 0: a step has examples (torch.where keeps a device sync out of the step)
                for b, value in zip(floats, summed[len(ints):]):
                    b.copy_(torch.where(total > 0, value / total, b.double()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the current replica's gradients (every replica's outside strategy.run)."""
        ctx = context.get_replica_context()
        if ctx is None or ctx.strategy is not self._strategy:
            for opt in self.replicas:
                opt.zero_grad(set_to_none=set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.replicas[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for rid, opt in enumerate(self.replicas):
            device = torch_device(self._strategy.extended.worker_devices[rid])
            opt.load_state_dict(_to_device(copy.deepcopy(state_dict), device))

    def __repr__(self) -> str:
        return f"MirroredOptimizer({len(self.replicas)} replicas of {type(self.replicas[0]).__name__})"


class _MirroredGroup(MutableMapping):
    """One param group of every replica's optimizer: reads replica 0's, writes all of them."""

    def __init__(self, groups: list[dict[str, Any]]):
        self._groups = groups

    def __getitem__(self, key: str) -> Any:
        return self._groups[0][key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise ValueError("MirroredOptimizer.param_groups[i]['params'] cannot be set: each replica's group "
                             "holds its own copy's parameters. Make a new mirror_optimizer instead.")
        for group in self._groups:
            group[key] = value

    def __delitem__(self, key: str) -> None:
        for group in self._groups:
            del group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups[0])

    def __len__(self) -> int:
        return len(self._groups[0])

    def __repr__(self) -> str:
        return f"MirroredGroup({ {k: v for k, v in self._groups[0].items() if k != 'params'} })"


def _to_device(state: Any, device: torch.device) -> Any:
    if isinstance(state, Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    return state


def _same_keys(states: list[dict], what: str) -> None:
    """Raises OutOfSyncError naming the keys one copy has and replica 0's has not, or the reverse."""
    from mirrored.distribute.strategy import OutOfSyncError

    first = set(states[0])
    for r, state in enumerate(states[1:], start=1):
        if set(state) != first:
            only_0, only_r = sorted(map(str, first - set(state))), sorted(map(str, set(state) - first))
            raise OutOfSyncError(f"{what} differs in its entries: replica 0 alone has {only_0 or 'none'}, replica "
                                 f"{r} alone has {only_r or 'none'}; a change reached some copies only (make it "
                                 "through the mirrored module, or on every copy).")


def named_copies(obj: Any) -> Iterator[tuple[str, list[Tensor]]]:
    """(name, one tensor per replica) for every tensor of a mirrored module, optimizer or variable."""
    from mirrored.distribute.variables import SyncOnReadVariable, Variable

    if isinstance(obj, MirroredModule):
        states = [m.state_dict(keep_vars=True) for m in obj.replicas]
        _same_keys(states, "the module's state_dict")
        for name in states[0]:
            yield name, [s[name] for s in states]
    elif isinstance(obj, MirroredOptimizer):
        states = [opt.state_dict()["state"] for opt in obj.replicas]
        _same_keys(states, "the optimizer's state (parameters with state)")
        for index in states[0]:
            _same_keys([s[index] for s in states], f"the optimizer's state of parameter {index}")
            for key, value in states[0][index].items():
                if isinstance(value, Tensor):
                    yield f"optimizer state[{index}][{key!r}]", [s[index][key] for s in states]
    elif isinstance(obj, SyncOnReadVariable):
        raise TypeError(f"check_in_sync({obj.name!r}): a SyncOnReadVariable's copies differ by design "
                        "(each replica accumulates its own); only mirrored state is kept in sync.")
    elif isinstance(obj, Variable):
        yield f"variable {obj.name!r}", list(obj.values)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from named_copies(item)
    else:
        raise TypeError(f"check_in_sync: expected a mirrored module, optimizer or variable; got "
                        f"{type(obj).__name__}.")
