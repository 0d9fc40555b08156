"""Catches a change that reached some copies of a mirrored module only, before any replica updates.

Outside strategy.run, reads of a MirroredModule (mnet.parameters(), mnet[0].weight, mnet.modules())
give replica 0's copy, which equals the others. A change made through what they return -
`p.requires_grad = False`, `nn.init.zeros_(mnet[2].weight)`, `m.eval()` - reaches that copy alone,
and the replicas then compute different things under one name (the other replicas' gradients even
train a parameter frozen on replica 0). A CopyWatch holds, per copy, what the replicas compare in
the meeting where their gradients are all-reduced (a MirroredOptimizer passes `signature()` as the
strategy's `copies=`): each parameter's requires_grad, each module's training flag, and how often
each parameter was written in place since the copies were last known equal. The last is torch's
version counter of the tensor (`_version`: every in-place write through the tensor or a view of
it advances it, a write through `.data` excepted); a normal step writes every copy alike, so the
counts stay equal. Where only counts differ, the values decide: equal values (one change made on
every copy, in different numbers of writes) become the new baseline, different ones fail the step.

A signature costs 14-30 us per replica per meeting for a ResNet-20 (59 parameters, 65 modules;
timeit on the 2-core box, idle to loaded), against a step of 100+ ms there; comparing them adds no
meeting. Used by modules.py (which owns a watch per mirrored module), optimizer.py and strategy.py.
Uses torch; strategy.py's OutOfSyncError and _cross_replica's _bitwise_equal when the copies differ.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

# C-level attribute reads: a list(map(...)) over 60 parameters costs ~4 us, a Python loop ~6.
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")
_VERSION = operator.attrgetter("_version")  # torch's in-place write counter of a tensor (autograd checks it too)

Signature = tuple[list[bool], list[bool], list[int]]  # requires_grad, training, in-place writes since equal


class CopiesDiffer(Exception):
    """Raised on every replica by the strategy's gradient all-reduce when the replicas passed different
    `copies=` signatures: nothing was reduced; CopyWatch.settle() tells a real difference from none."""

    def __init__(self, signatures: list[Any]):
        super().__init__("the replicas' module copies differ (see CopyWatch.settle)")
        self.signatures = signatures


class CopyWatch:
    """The copies of one mirrored module: per copy its modules and parameters (walked once, and again
    after a change of structure), and each parameter's version when the copies were last known equal."""

    __slots__ = ("_copies", "_devices", "_modules", "_params", "_base", "_module_names", "_param_names", "_synced")

    def __init__(self, copies: Sequence[nn.Module], devices: Sequence[str],
                 synced: Callable[[nn.Module], list[Tensor]] | None = None):
        self._copies = tuple(copies)
        self._devices = tuple(devices)
        # Parameters a step may write differently on each copy until the optimizer syncs them (a Keras
        # model's moving statistics, a replica with an empty part skipping its forward): not watched.
        self._synced = synced
        n = len(self._copies)
        self._modules: list[list[nn.Module]] = [[] for _ in range(n)]
        self._params: list[list[Tensor]] = [[] for _ in range(n)]
        self._base: list[list[int]] = [[] for _ in range(n)]
        self._module_names: list[str] = []
        self._param_names: list[str] = []
        self.rewalk()

    def rewalk(self) -> None:
        """Walks the copies again after a change of their structure made on every copy (add_module,
        load_state_dict, apply): a parameter seen before keeps its baseline, a new one starts now."""
        walks = [_walk(c) for c in self._copies]
        if self._synced is not None:
            walks = [_without(walk, self._synced(c)) for walk, c in zip(walks, self._copies)]
        for r, (_, modules, _, params) in enumerate(walks):
            old = dict(zip(map(id, self._params[r]), self._base[r]))  # (the old parameters are alive: ids hold)
            self._base[r] = [old.get(id(p), p._version) for p in params]
            self._modules[r], self._params[r] = modules, params
        self._module_names, self._param_names = walks[0][0], walks[0][2]

    def equal_now(self, copies: Sequence[nn.Module] | None = None) -> None:
        """The copies are known equal now (check_in_sync passed): their write counts start again here.
        `copies`, one module per replica (a submodule's copies), limits this to their parameters."""
        for r, params in enumerate(self._params):
            if copies is None:
                self._base[r] = list(map(_VERSION, params))
            else:
                mine = {id(p) for p in copies[r].parameters()}
                self._base[r] = [p._version if id(p) in mine else b for p, b in zip(params, self._base[r])]

    def signature(self, rid: int) -> Signature:
        """What replica `rid` brings to the meeting: equal on every replica while the copies are alike."""
        params = self._params[rid]
        return (list(map(_REQUIRES_GRAD, params)), list(map(_TRAINING, self._modules[rid])),
                list(map(operator.sub, map(_VERSION, params), self._base[rid])))

    def settle(self, rid: int, signatures: list[Signature], where: str) -> None:
        """The replicas' signatures differed: raises OutOfSyncError (the same on every replica: each reads
        the same signatures and tensors) naming the first difference and the fix, unless only write
        counts differ, over values equal on every copy; then replica `rid`'s counts start again here."""
        problem = self._difference(signatures)
        if problem is not None:
            from mirrored.distribute.strategy import OutOfSyncError

            raise OutOfSyncError(f"{where}: the replicas' copies of the module differ, so no replica may apply "
                                 f"this step: {problem} The step was rolled back on every replica.")
        self._base[rid] = list(map(_VERSION, self._params[rid]))

    def _difference(self, signatures: list[Signature]) -> str | None:
        first = signatures[0]
        for r, sig in enumerate(signatures[1:], start=1):
            if len(sig[0]) != len(first[0]) or len(sig[1]) != len(first[1]):
                return (f"replica 0's copy has {len(first[0])} parameters in {len(first[1])} modules, replica "
                        f"{r}'s ({self._devices[r]}) {len(sig[0])} in {len(sig[1])}: a module or parameter was "
                        "added to or removed from some copies only. Change the structure through the mirrored "
                        "module (mnet.add_module, mnet.register_parameter: every copy), or before strategy.mirror().")
        for i, name in enumerate(self._param_names):
            r = _first_other(signatures, 0, i)
            if r is not None:
                return requires_grad_difference(name, first[0][i], signatures[r][0][i], r, self._devices[r])
        for i, name in enumerate(self._module_names):
            r = _first_other(signatures, 1, i)
            if r is not None:
                return training_difference(name, self._modules[0][i], first[1][i], r, self._devices[r])
        for i, name in enumerate(self._param_names):
            if _first_other(signatures, 2, i) is None:
                continue
            values = [params[i] for params in self._params]
            r = next((r for r in range(1, len(values)) if not _same(values[0], values[r])), None)
            if r is not None:
                return written_difference(name, values[0], values[r], signatures[0][2][i], signatures[r][2][i], r,
                                          self._devices[r])
        return None


def _without(walk: tuple, skip: list[Tensor]) -> tuple:
    """A _walk() result without the parameters in `skip`."""
    if not skip:
        return walk
    ids = {id(t) for t in skip}
    module_names, modules, param_names, params = walk
    kept = [(n, p) for n, p in zip(param_names, params) if id(p) not in ids]
    return module_names, modules, [n for n, _ in kept], [p for _, p in kept]


def copies_difference(copies: Sequence[nn.Module], devices: Sequence[str]) -> str | None:
    """The first parameter whose requires_grad, or module whose training flag, differs between the
    copies (what strategy.check_in_sync reports besides values), or None."""
    walks = [_walk(c) for c in copies]
    module_names, modules, param_names, params = walks[0]
    for r, (_, other_modules, _, other_params) in enumerate(walks[1:], start=1):
        for name, p, q in zip(param_names, params, other_params):
            if p.requires_grad != q.requires_grad:
                return requires_grad_difference(name, p.requires_grad, q.requires_grad, r, devices[r])
        for name, m, o in zip(module_names, modules, other_modules):
            if m.training != o.training:
                return training_difference(name, m, m.training, r, devices[r])
    return None


def requires_grad_difference(name: str, first: bool, other: bool, r: int, device: str) -> str:
    frozen = 0 if not first else r
    return (f"parameter {name!r} has requires_grad={first} on replica 0's copy but {other} on replica {r}'s "
            f"({device}), so the other replicas' gradients would still train the copy frozen on replica {frozen}. "
            "`p.requires_grad = False` on a parameter read outside strategy.run (mnet.parameters(), "
            "mnet[0].weight) reaches replica 0's copy only. Set it on every copy: for m in mnet.values: "
            f"m.get_parameter({name!r}).requires_grad_({first}), or for a whole submodule "
            f"{_expr(_owner(name))}.requires_grad_({first}) (a submodule of a mirrored module is mirrored too); or "
            "set it before strategy.mirror().")


def training_difference(name: str, module: nn.Module, first: bool, r: int, device: str) -> str:
    what = f"module {name!r} ({type(module).__name__})" if name else f"the module ({type(module).__name__})"
    return (f"{what} is in {_mode(first)} mode on replica 0's copy but in {_mode(not first)} mode on replica "
            f"{r}'s ({device}), so the replicas would compute differently (BatchNorm, Dropout). m.eval() or m.train() "
            "on a module read outside strategy.run (mnet.modules(), mnet.children(), mnet.get_submodule()) reaches "
            f"replica 0's copy only. Set the mode on every copy: {_expr(name)}.{'train' if first else 'eval'}() "
            "(a submodule of a mirrored module is mirrored too), or for m in mnet.values: for sub in m.modules(): "
            "...; or set it before strategy.mirror().")


def written_difference(name: str, first: Tensor, other: Tensor, writes_0: int, writes_r: int, r: int,
                       device: str) -> str:
    a, b = first.detach().cpu(), other.detach().cpu()
    gap = (f"max abs difference {(a.double() - b.double()).abs().max().item():.3g}"
           if a.shape == b.shape and a.is_floating_point() and b.is_floating_point()
           else f"shape {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}")
    more, fewer = (f"replica 0's copy", f"replica {r}'s") if writes_0 > writes_r else (f"replica {r}'s copy", "replica 0's")
    param = f"{_expr(_owner(name))}.{name.rpartition('.')[2]}"
    return (f"parameter {name!r} holds different values on replica 0's copy and on replica {r}'s ({device}) ({gap}), "
            f"and since the copies were last known equal {more} was written in place {abs(writes_0 - writes_r)} "
            f"more time(s) than {fewer}. An in-place write outside strategy.run to a parameter read through the "
            f"mirrored module (nn.init.zeros_({param}), p.mul_() over mnet.parameters(), mnet.state_dict()[k].zero_()) "
            "reaches replica 0's copy only. Write every copy alike (for m in mnet.values: "
            f"nn.init.zeros_(m.get_parameter({name!r}))), or load one state into every copy with "
            "mnet.load_state_dict(...); initialise at random before strategy.mirror() (each copy would draw its own "
            "values).")


def _first_other(signatures: list[Signature], kind: int, i: int) -> int | None:
    """The first replica whose entry i of part `kind` differs from replica 0's, or None."""
    first = signatures[0][kind][i]
    return next((r for r, sig in enumerate(signatures) if sig[kind][i] != first), None)


def _same(a: Tensor, b: Tensor) -> bool:
    from mirrored.distribute._cross_replica import _bitwise_equal

    a, b = a.detach().cpu(), b.detach().cpu()
    return a.shape == b.shape and a.dtype == b.dtype and _bitwise_equal(a, b)


def _walk(module: nn.Module) -> tuple[list[str], list[nn.Module], list[str], list[Tensor]]:
    """The names and modules of `module` and every module inside it (each module once, in
    module.modules() order), and the names and parameters they hold (a shared one once per holder).
    Not on the step's path (the watch walks at creation and after a change of structure)."""
    module_names, modules, param_names, params = [], [], [], []
    for name, m in module.named_modules():
        module_names.append(name)
        modules.append(m)
        for key, p in m._parameters.items():
            if p is not None:
                param_names.append(f"{name}.{key}" if name else key)
                params.append(p)
    return module_names, modules, param_names, params


def _owner(param_name: str) -> str:
    """The name of the module that holds parameter `param_name` ("" for the root)."""
    return param_name.rpartition(".")[0]


def _expr(module_name: str) -> str:
    """How a user reaches that module's mirror: "layer1.0.conv1" -> mnet.layer1[0].conv1."""
    return "mnet" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in module_name.split(".") if part)


def _mode(training: bool) -> str:
    return "training" if training else "eval"
