"""Mirrored torch modules: `strategy.mirror(net)`, one copy of an nn.Module per replica.

Inside strategy.run a call, an attribute and every method use the calling replica's copy; a submodule
(mnet.encoder, mnet[0]) is mirrored too, so that calling it is noted as calling the module. Outside
it (cross-replica context) each public nn.Module method is one of three kinds, listed in
MirroredModule.EVERY_COPY, READS and REFUSED: it reaches every copy (train, to(dtype), apply,
load_state_dict, register_forward_hook, ...), reads replica 0's copy, which equals the others
(parameters, state_dict, ...), or is refused with the fix; nothing changes replica 0 alone by
falling through to its copy. A test enumerates nn.Module's methods against these lists.
MirroredOptimizer (optimizer.py) keeps the copies in sync; `named_copies` lists their tensors for
check_in_sync. A change that reaches some copies only all the same (through what a read returned:
`p.requires_grad = False` on replica 0's parameter) is caught when the replicas' gradients meet, by
the module's CopyWatch (_copy_watch.py). A layer above may register how a kind of module is
copied (register_copier), which of its tensors besides buffers a step changes
(register_state_tensors) and which others the copies keep equal (register_synced_tensors, for
check_in_sync): training/'s Keras adapter does, for Keras 3 models, loaded for a Keras
model through the loader mirrored/__init__.py registers (register_adapter_loader). Uses context.py,
devices.py, guards.py, random.py, rollback.py and
_copy_watch.py.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from mirrored.distribute import context, guards
from mirrored.distribute._copy_watch import CopyWatch, copies_difference
from mirrored.distribute.devices import torch_device
from mirrored.distribute.random import WithoutReplicaRandom
from mirrored.distribute.rollback import StepJournal, journal_of, modules_in_order, saved_item

if TYPE_CHECKING:
    from mirrored.distribute.strategy import Strategy


# Finders of the state tensors a module keeps outside its buffers (a Keras 3 model's non-trainable
# variables are Parameters with requires_grad=False), registered by the layer that knows the module
# kind, since this package may not import it. Each returns [(tensor, "mean" | "first")], or None for
# a module that is not of its kind.
_STATE_FINDERS: OrderedDict[int, Callable[[nn.Module], list[tuple[Tensor, str]] | None]] = OrderedDict()  # (RemovableHandle refers to it weakly)


def register_state_tensors(finder: Callable[[nn.Module], list[tuple[Tensor, str]] | None]) -> RemovableHandle:
    """Makes sync_buffers also sync the tensors `finder(copy)` names: "mean" ones averaged across the
    replicas (weighted as buffers are), "first" ones set to replica 0's; until the handle's remove()."""
    handle = RemovableHandle(_STATE_FINDERS)
    _STATE_FINDERS[handle.id] = finder
    return handle


# Copiers for module kinds that copy.deepcopy does not copy as objects (a Keras model pickles itself
# through its saving library), registered the same way; each returns the copy, or None.
_COPIERS: OrderedDict[int, Callable[[nn.Module], nn.Module | None]] = OrderedDict()  # (RemovableHandle refers to it weakly)


def register_copier(copier: Callable[[nn.Module], nn.Module | None]) -> RemovableHandle:
    """Makes the replicas' copies of a module come from `copier(module)` where it returns one; until
    the handle's remove()."""
    handle = RemovableHandle(_COPIERS)
    _COPIERS[handle.id] = copier
    return handle


# Finders of the tensors a module copy holds outside its state_dict that the replicas keep equal all the
# same (a Keras optimizer's variables, which a Keras model does not register with torch), for
# check_in_sync; registered as the others. Each returns [(name, tensor)], or None for another kind.
_SYNCED_FINDERS: OrderedDict[int, Callable[[nn.Module], list[tuple[str, Tensor]] | None]] = OrderedDict()


def register_synced_tensors(finder: Callable[[nn.Module], list[tuple[str, Tensor]] | None]) -> RemovableHandle:
    """Makes check_in_sync of a mirrored module also compare the tensors `finder(copy)` names on each
    copy (state a step keeps equal outside the module's state_dict); until the handle's remove()."""
    handle = RemovableHandle(_SYNCED_FINDERS)
    _SYNCED_FINDERS[handle.id] = finder
    return handle


def _synced_tensors(copies: Sequence[nn.Module]) -> Iterator[tuple[str, list[Tensor]]]:
    for finder in list(_SYNCED_FINDERS.values()):
        found = [finder(c) for c in copies]
        if found[0] is None:
            continue
        if any(f is None or len(f) != len(found[0]) for f in found):
            from mirrored.distribute.strategy import OutOfSyncError

            raise OutOfSyncError(f"the copies of the module hold different state besides their state_dict "
                                 f"({[None if f is None else len(f) for f in found]} tensors): a change reached some "
                                 "copies only.")
        for j, (name, _) in enumerate(found[0]):
            yield name, [f[j][1] for f in found]


# Loaders of the adapters for module kinds defined in other packages (a Keras 3 model), by the
# top-level package of the module's classes. Set by mirrored/__init__.py, which knows both this
# package and the layer that holds the adapter; this package names neither keras nor training/.
_ADAPTER_LOADERS: dict[str, Callable[[], None]] = {}


def register_adapter_loader(package: str, load: Callable[[], None]) -> None:
    """Makes copy_module call `load()` (which registers a copier and state finder) before it copies a
    module one of whose classes is defined in the top-level package `package`, such as "keras"."""
    _ADAPTER_LOADERS[package] = load


def _register_adapters(module: nn.Module) -> None:
    """Loads the adapter for `module`'s kind, so that its copier and state finder are registered even
    when the program used only strategy.mirror (without them a custom loop's Keras
    BatchNormalization statistics would drift apart silently)."""
    if not _ADAPTER_LOADERS:
        return
    packages = {c.__module__.partition(".")[0] for c in type(module).__mro__}
    for package, load in list(_ADAPTER_LOADERS.items()):
        if package in packages:
            load()


def copy_module(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """An independent copy of `module`: a registered copier's, else copy.deepcopy's (with `memo`)."""
    _register_adapters(module)
    for copier in list(_COPIERS.values()):
        copied = copier(module)
        if copied is not None:
            return copied
    return copy.deepcopy(module, memo)


# Each live mirror's copies, by copy, with the mirror (weakly both ways: a mirror dropped releases its
# copies), so that a layer above can refuse to change one replica's copy alone (mirror_holding).
_MIRRORS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _remember_copies(mirror: MirroredModule) -> None:
    for copy_ in mirror.replicas:
        _MIRRORS[copy_] = weakref.ref(mirror)


def mirror_holding(module: nn.Module) -> MirroredModule | None:
    """The live MirroredModule one of whose copies is or contains `module` (the module given to
    strategy.mirror is replica 0's copy), else None: a change to `module` alone would reach one replica."""
    for copy_, ref in list(_MIRRORS.items()):
        mirror = ref()
        if mirror is not None and (copy_ is module or any(m is module for m in copy_.modules())):
            return mirror
    return None


def _found_state(module: nn.Module) -> list[Tensor]:
    """The tensors registered finders name in `module` (not its buffers): the optimizer syncs them
    after a step, so the copies' CopyWatch does not compare their writes before it."""
    return [t for t, _ in found_state(module)]


def buffers_of(module: nn.Module) -> list[Tensor]:
    """module.buffers(), read from torch's dicts directly: the same tensors in the same order, without
    its name strings or a torch call (a mirrored optimizer checks with it, every step, that the
    buffers it synced last step are still the module's)."""
    return list({id(b): b for m in modules_in_order(module) for b in m._buffers.values() if b is not None}.values())


def state_tensors(module: nn.Module) -> list[tuple[Tensor, str]]:
    """A module copy's tensors that steps change outside the optimizer, with how replicas combine
    them: its buffers (floating point "mean", others "first") and what a registered finder adds."""
    return [(b, "mean" if b.is_floating_point() else "first") for b in buffers_of(module)] + found_state(module)


def found_state(module: nn.Module) -> list[tuple[Tensor, str]]:
    """What registered finders add to state_tensors(module) (a Keras model's moving statistics)."""
    found = []
    for finder in list(_STATE_FINDERS.values()):
        extra = finder(module)
        if extra:
            found.extend(extra)
    return found


class _Shared:
    """What a mirrored module and the views of its submodules share: each replica's count of the
    examples its copy saw since its optimizer last stepped (kept once an optimizer with
    gradient_reduction="mean" needs it), the no_sync() blocks open, and the watch over the whole
    copies (where there are several)."""

    __slots__ = ("examples", "run_start", "last_reduction", "no_sync_all", "no_sync", "grad_sync", "watch", "layout")

    def __init__(self, copies: list[nn.Module], devices: tuple[str, ...]):
        self.examples: list[tuple[int, int]] | None = None  # per replica: (examples, forward calls)
        # Per replica, for the optimizers' example weights: the count before the copy's first call in the
        # latest run (with that run's journal), and which optimizer of the module reduced last, in which run.
        self.run_start: list[tuple[Any, int, int]] = [(None, 0, 0)] * len(copies)
        self.last_reduction: list[tuple[Any, Any]] = [(None, None)] * len(copies)
        self.no_sync_all = 0  # blocks opened outside strategy.run (they hold for every replica)
        self.no_sync = [0] * len(copies)  # blocks opened by each replica inside strategy.run
        # Taken now, while the copies are equal: a change that later reaches some of them only is
        # caught when their gradients meet. One copy (a worker of a multi-worker strategy) has no
        # other to differ from.
        self.watch = CopyWatch(copies, devices, _found_state) if len(copies) > 1 else None
        # The optimizer that all-reduces this module's gradients when backward ends ("mean", as DDP), if
        # any: told of each forward and of zero_grad (MirroredOptimizer.before_forward / grads_cleared).
        self.grad_sync: Any = None
        self.layout = _Layout()

    def count_examples(self) -> None:
        if self.examples is None:
            self.examples = [(0, 0) for _ in self.no_sync]

    def add_examples(self, rid: int, journal: StepJournal | None, args: tuple, kwargs: dict) -> None:
        # (Python ints, not a tensor: a count is read on the host every step, and each torch call on the
        # step's path hands the GIL to the other replicas)
        examples, calls = self.examples[rid]
        if journal is not None:  # a failed step puts the count back with the gradients
            journal.before_change(self.examples, functools.partial(saved_item, self.examples, rid))
            if self.run_start[rid][0] is not journal:
                self.run_start[rid] = (journal, examples, calls)
        first = next(_tensors((args, kwargs)), None)
        self.examples[rid] = (examples + (1 if first is None or first.dim() == 0 else first.shape[0]), calls + 1)

    def in_no_sync(self, rid: int) -> bool:
        return self.no_sync_all > 0 or self.no_sync[rid] > 0


class MirroredModule:
    """One copy of a module per replica (`.values`), kept identical by a MirroredOptimizer.

    Inside strategy.run, calls and attributes go to the calling replica's copy. Outside it, see the
    module docstring: methods reach every copy, read replica 0's, or are refused. A submodule
    (mnet.fc, mnet[0], iterating) is itself mirrored, so mnet.fc.requires_grad_(False) freezes it
    everywhere; methods of your own module class are refused outside strategy.run (call them on
    every copy: for m in mnet.values: m.method()). Calling mnet(x) outside strategy.run uses replica
    0's copy, for inference: in training mode with BatchNorm statistics, or with a backward
    through its output, it would change replica 0 alone and is refused."""

    # Outside strategy.run these reach every copy; inside it the first five act on the replica's own
    # copy (every replica runs the same code) and the rest are refused (change the module before run).
    EVERY_COPY = frozenset({
        "train", "eval", "requires_grad_", "zero_grad", "apply",
        "to", "cpu", "cuda", "bfloat16", "double", "float", "half", "type", "share_memory", "compile",
        "load_state_dict", "set_extra_state", "add_module", "register_module", "set_submodule", "register_buffer",
        "register_parameter", "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
        "register_full_backward_pre_hook", "register_backward_hook", "register_state_dict_pre_hook",
        "register_state_dict_post_hook", "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook",
    })
    _OWN_COPY_IN_RUN = frozenset({"train", "eval", "requires_grad_", "zero_grad", "apply"})
    # Replica 0's copy outside strategy.run (every copy holds the same), the replica's own inside it.
    READS = frozenset({
        "parameters", "named_parameters", "buffers", "named_buffers", "children", "named_children", "modules",
        "named_modules", "state_dict", "get_parameter", "get_buffer", "get_submodule", "get_extra_state",
        "extra_repr", "forward",
    })
    # Moves to another device: a strategy's copies stay on its devices.
    REFUSED = frozenset({"to_empty", "ipu", "xpu", "mtia"})

    def __init__(self, strategy: Strategy, module: nn.Module, memory_format: str = "auto"):
        if not isinstance(module, nn.Module):
            raise TypeError(f"strategy.mirror(module={type(module).__name__}): expected a torch.nn.Module.")
        if isinstance(module, MirroredModule):
            raise TypeError("strategy.mirror: this module is already mirrored.")
        lazy = [name for name, t in itertools.chain(module.named_parameters(), module.named_buffers()) if is_lazy(t)]
        if lazy:
            # Each copy would draw its own initial values at its first forward: replicas out of sync.
            raise ValueError(
                f"strategy.mirror: {type(module).__name__} has parameters that are not initialised yet ({', '.join(lazy[:4])}"
                f"{', ...' if len(lazy) > 4 else ''}: a Lazy module such as LazyLinear). Run it once on a sample batch "
                "before mirroring it (module(x[:1]) initialises them), or give the layer its input size (nn.Linear).")
        _check_memory_format(memory_format, "strategy.mirror")
        devices = strategy.extended.worker_devices
        first = module.to(torch_device(devices[0]))
        # Converted before the copies are made: each copy is then made once, in the format it runs in.
        layout = _Layout()
        layout.apply([first], memory_format, devices)
        copies = [first] + [copy_module(first).to(torch_device(d)) for d in devices[1:]]
        guards.allow_modules(copies)
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "replicas", tuple(copies))
        object.__setattr__(self, "_shared", _Shared(copies, devices))
        self._shared.layout = layout
        _remember_copies(self)

    @classmethod
    def _of(cls, strategy: Strategy, copies: Any, shared: _Shared) -> MirroredModule:
        """The mirror of existing copies (one per replica, e.g. a submodule of each): nothing copied."""
        view = object.__new__(cls)
        object.__setattr__(view, "_strategy", strategy)
        object.__setattr__(view, "replicas", tuple(copies))
        object.__setattr__(view, "_shared", shared)
        return view

    @property
    def distribute_strategy(self) -> Strategy:
        """The strategy that mirrored this module (whose random state a Checkpoint of it saves)."""
        return self._strategy

    def _replica(self) -> int | None:
        """The calling replica's copy index, None in cross-replica context."""
        ctx = context.replica_of(self._strategy)
        return None if ctx is None else ctx.local_replica_id

    def _view(self, copies: list[Any]) -> Any:
        return MirroredModule._of(self._strategy, copies, self._shared) if isinstance(copies[0], nn.Module) \
            else copies[0]

    @property
    def values(self) -> tuple[nn.Module, ...]:
        """The module's copies, one per replica, in replica order (as a DistributedValues')."""
        return self.replicas

    @property
    def module(self) -> nn.Module:
        """The current replica's copy (replica 0's in cross-replica context)."""
        return self.replicas[self._replica() or 0]

    @property
    def memory_format(self) -> str:
        """The memory format the convolutions' weights run in: "channels_last", "channels_last_3d",
        both ("channels_last+channels_last_3d"), or "as given" (no conversion: preserve, or no convolution)."""
        return self._shared.layout.running

    def set_memory_format(self, memory_format: str) -> MirroredModule:
        """Converts the convolutions' weights of every copy to `memory_format` ("auto", "channels_last",
        "preserve": see strategy.mirror), outside strategy.run and before mirror_optimizer(), whose
        gradient buckets follow the weights' layout. Values never change, only their memory order."""
        _check_memory_format(memory_format, "MirroredModule.set_memory_format")
        self._targets("set_memory_format")
        self._shared.layout.apply(self.replicas, memory_format, self._strategy.extended.worker_devices)
        self._restructured()
        return self

    # ---- calls ------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(None, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The copy's forward without its hooks, as nn.Module.forward: the same rules as a call."""
        return self._call("forward", args, kwargs)

    def _call(self, method: str | None, args: tuple, kwargs: dict) -> Any:
        ctx = context.replica_of(self._strategy)
        if ctx is None:
            return self._cross_replica_call(method, args, kwargs)
        rid = ctx.local_replica_id
        copy_ = self.replicas[rid]
        with WithoutReplicaRandom():  # (only the module's own forward draws)
            journal = journal_of(ctx)
            if journal is not None:  # a failed step puts this copy's gradients and buffers back
                journal.before_forward(copy_)
                for t in _found_state(copy_):  # and the state a registered finder names (Keras's moving statistics)
                    journal.before_write(t)
            # gradient_reduction="mean" weighs replicas by their examples; a forward without grad (an
            # evaluation between training steps) adds no gradient, so it adds no weight either.
            if self._shared.examples is not None and torch.is_grad_enabled():
                self._shared.add_examples(rid, journal, args, kwargs)
            if self._shared.grad_sync is not None and torch.is_grad_enabled():
                self._shared.grad_sync.before_forward(ctx)
        return (copy_ if method is None else copy_.forward)(*args, **kwargs)

    def _cross_replica_call(self, method: str | None, args: tuple, kwargs: dict) -> Any:
        """Replica 0's copy, for inference: what would change that copy alone is refused."""
        first = self.replicas[0]
        several = len(self.replicas) > 1
        if several and any(isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
                           for m in first.modules()):
            raise RuntimeError(f"{self!r} was called outside strategy.run in training mode: its BatchNorm statistics "
                               "would change in replica 0's copy only. Call mnet.eval() first (for inference), or "
                               "call it inside strategy.run, where every replica updates its own.")
        out = (first if method is None else first.forward)(*args, **kwargs)
        if several and torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(_refuse_cross_replica_backward)
        return out

    # ---- attributes -------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name in ("_strategy", "replicas", "_shared") or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)  # (during construction, and protocols that must not reach a copy)
        rid = self._replica()
        value = getattr(self.replicas[rid or 0], name)
        if isinstance(value, nn.Module):
            # A submodule is mirrored too, inside strategy.run as outside: a call of it is the replica's
            # copy's, noted in the step's journal and counted in its examples as the module's own calls.
            return self._view([getattr(m, name) for m in self.replicas])
        if rid is not None:
            return value
        if inspect.ismethod(value) and value.__self__ is self.replicas[0]:
            return _refused_method(self, name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot set {name!r} on a MirroredModule: set it on every copy "
                             "(for m in mnet.values: ...) so the replicas stay identical.")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete {name!r} from a MirroredModule: delete it from every copy "
                             "(for m in mnet.values: ...) so the replicas stay identical.")

    def __getitem__(self, index: Any) -> Any:
        return self._view([m[index] for m in self.replicas])

    def __len__(self) -> int:
        return len(self.module)

    def __bool__(self) -> bool:  # a module is true, whatever its len (which Python would ask otherwise)
        return True

    def __contains__(self, key: Any) -> bool:
        return key in self.module

    def __iter__(self) -> Iterator[Any]:
        return (self._view(list(parts)) for parts in zip(*self.replicas))

    def __deepcopy__(self, memo: dict) -> MirroredModule:
        """Independent copies of every replica's module, mirrored by the same strategy (which is shared,
        not copied: a strategy owns threads)."""
        copies = [copy_module(m, memo) for m in self.replicas]
        guards.allow_modules(copies)
        mirror = MirroredModule._of(self._strategy, copies, _Shared(copies, self._strategy.extended.worker_devices))
        _remember_copies(mirror)
        return mirror

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a MirroredModule cannot be pickled (it holds a strategy's replicas): save "
                        "mnet.state_dict(), or pickle one copy, mnet.values[0].")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.replicas[0])))

    def __repr__(self) -> str:
        return f"MirroredModule({len(self.replicas)} replicas of {type(self.replicas[0]).__name__})"

    # ---- what reaches every copy --------------------------------------------------------------
    def _targets(self, what: str) -> tuple[nn.Module, ...]:
        """The copies `what` acts on: all of them outside strategy.run; inside it the replica's own for
        the calls every replica makes alike (_OWN_COPY_IN_RUN), and none for the others (refused)."""
        rid = self._replica()
        if rid is None:
            return self.replicas
        if what in self._OWN_COPY_IN_RUN:
            return (self.replicas[rid],)
        raise RuntimeError(f"MirroredModule.{what}() was called inside strategy.run, where each replica would "
                           f"change the module on its own. Call mnet.{what}(...) before strategy.run (in "
                           "cross-replica context): it then reaches every copy at once.")

    def _each(self, what: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(m, what)(*args, **kwargs) for m in self._targets(what)]

    def train(self, mode: bool = True) -> MirroredModule:
        """Sets training mode on every copy (inside strategy.run, on the replica's own copy)."""
        self._each("train", mode)
        return self

    def eval(self) -> MirroredModule:
        """Sets evaluation mode on every copy (inside strategy.run, on the replica's own copy)."""
        self._each("eval")
        return self

    def requires_grad_(self, requires_grad: bool = True) -> MirroredModule:
        """Sets requires_grad on every copy's parameters (inside strategy.run, on the replica's own)."""
        self._each("requires_grad_", requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the current replica's gradients inside strategy.run, every replica's outside it."""
        self._each("zero_grad", set_to_none=set_to_none)
        if self._shared.grad_sync is not None:
            self._shared.grad_sync.grads_cleared()

    def apply(self, fn: Callable[[nn.Module], None]) -> MirroredModule:
        """fn(submodule) on every copy's submodules (inside strategy.run, on the replica's own copy)."""
        self._each("apply", fn)
        self._restructured()  # (fn may replace parameters or submodules)
        return self

    def _restructured(self) -> None:
        """Every copy's structure may have changed alike (outside strategy.run): the watch walks them again."""
        if self._shared.watch is not None and self._replica() is None:
            self._shared.watch.rewalk()

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
        self._each("to", dtype=dtype, non_blocking=non_blocking, memory_format=memory_format)
        self._restructured()  # (new parameters where torch overwrites them on conversion)
        return self

    def cpu(self) -> MirroredModule:
        """A no-op where every copy is on the CPU already; a move is refused (see to())."""
        return self.to("cpu")  # a no-op where every copy is on the CPU already; refused otherwise

    def cuda(self, device: Any = None) -> MirroredModule:
        """A no-op where every copy is on CUDA already; a move to one device is refused (see to())."""
        return self.to("cuda" if device is None else torch.device("cuda", device) if isinstance(device, int)
                       else device)

    def double(self) -> MirroredModule:
        """Casts every copy to float64."""
        return self.to(torch.float64)

    def float(self) -> MirroredModule:
        """Casts every copy to float32."""
        return self.to(torch.float32)

    def half(self) -> MirroredModule:
        """Casts every copy to float16."""
        return self.to(torch.float16)

    def bfloat16(self) -> MirroredModule:
        """Casts every copy to bfloat16."""
        return self.to(torch.bfloat16)

    def type(self, dst_type: Any) -> MirroredModule:
        """nn.Module.type on every copy (a dtype; a device type that moves the copies fails in torch)."""
        self._each("type", dst_type)
        return self

    def share_memory(self) -> MirroredModule:
        """nn.Module.share_memory on every copy."""
        self._each("share_memory")
        return self

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch.compile of every copy's forward, in place (nn.Module.compile)."""
        self._each("compile", *args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Loads `state_dict` into every copy; with assign=True each copy gets its own tensors on its device."""
        results = []
        for m, device in zip(self._targets("load_state_dict"), self._devices()):
            state = {k: v.detach().to(device, copy=True) if assign and isinstance(v, Tensor) else v
                     for k, v in state_dict.items()} if assign else state_dict
            results.append(m.load_state_dict(state, strict=strict, assign=assign))
        self._restructured()  # (assign=True puts new parameters in)
        return results[0]

    def set_extra_state(self, state: Any) -> None:
        """Gives every copy its own deep copy of `state`."""
        for m in self._targets("set_extra_state"):
            m.set_extra_state(copy.deepcopy(state))

    # New state: each copy gets its own, on its device.
    def _one_process(self, what: str) -> None:
        """New state copied within this process only: workers of a multi-worker strategy would each add
        their own (mirror() broadcasts rank 0's state; this does not)."""
        if self._strategy.num_workers > 1:
            raise ValueError(f"MirroredModule.{what} on a multi-worker strategy: each worker would add its own "
                             "value. Add it to the module before strategy.mirror(), which broadcasts rank 0's.")

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """Adds the buffer to every copy, each its own tensor on its device (one process only)."""
        self._one_process("register_buffer")
        for m, device in zip(self._targets("register_buffer"), self._devices()):
            m.register_buffer(name, None if tensor is None else tensor.detach().to(device, copy=True), persistent)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Adds the parameter to every copy (an optimizer made before does not know it, as in torch)."""
        self._one_process("register_parameter")
        for m, device in zip(self._targets("register_parameter"), self._devices()):
            m.register_parameter(name, None if param is None else
                                 nn.Parameter(param.detach().to(device, copy=True), param.requires_grad))
        self._restructured()

    def add_module(self, name: str, module: nn.Module | None) -> None:
        """Adds a deep copy of `module` to every copy, on its device (one process only)."""
        self._new_module("add_module", lambda m, new: m.add_module(name, new), module)

    def register_module(self, name: str, module: nn.Module | None) -> None:
        """Adds a deep copy of `module` to every copy, on its device (one process only)."""
        self._new_module("register_module", lambda m, new: m.register_module(name, new), module)

    def set_submodule(self, target: str, module: nn.Module, strict: bool = False) -> None:
        """Replaces `target` in every copy with its own deep copy of `module` (one process only)."""
        self._new_module("set_submodule", lambda m, new: m.set_submodule(target, new, strict=strict), module)

    def _new_module(self, what: str, put: Callable[[nn.Module, Any], None], module: nn.Module | None) -> None:
        self._one_process(what)
        for m, device in zip(self._targets(what), self._devices()):
            new = None if module is None else copy_module(module).to(device)
            put(m, new)
            if new is not None:
                guards.allow_modules([new])
        self._restructured()

    def _devices(self) -> list[torch.device]:
        return [torch_device(d) for d in self._strategy.extended.worker_devices]

    # Hooks: registered on every copy; each runs on its replica's thread, with that replica's copy.
    def register_forward_hook(self, hook: Callable[..., Any], **kwargs: Any) -> HookHandles:
        """Registers `hook` on every copy; it runs on each replica's thread with its copy."""
        return HookHandles(self._each("register_forward_hook", hook, **kwargs))

    def register_forward_pre_hook(self, hook: Callable[..., Any], **kwargs: Any) -> HookHandles:
        """Registers `hook` on every copy; it runs on each replica's thread with its copy."""
        return HookHandles(self._each("register_forward_pre_hook", hook, **kwargs))

    def register_full_backward_hook(self, hook: Callable[..., Any], prepend: bool = False) -> HookHandles:
        """Registers `hook` on every copy; it runs on each replica's thread with its copy."""
        return HookHandles(self._each("register_full_backward_hook", hook, prepend=prepend))

    def register_full_backward_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> HookHandles:
        """Registers `hook` on every copy; it runs on each replica's thread with its copy."""
        return HookHandles(self._each("register_full_backward_pre_hook", hook, prepend=prepend))

    def register_backward_hook(self, hook: Callable[..., Any]) -> HookHandles:
        """Registers `hook` on every copy (torch's deprecated form; prefer the full hook)."""
        return HookHandles(self._each("register_backward_hook", hook))

    def register_state_dict_pre_hook(self, hook: Callable[..., Any]) -> HookHandles:
        """Registers `hook` on every copy's state_dict()."""
        return HookHandles(self._each("register_state_dict_pre_hook", hook))

    def register_state_dict_post_hook(self, hook: Callable[..., Any]) -> HookHandles:
        """Registers `hook` on every copy's state_dict()."""
        return HookHandles(self._each("register_state_dict_post_hook", hook))

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any]) -> HookHandles:
        """Registers `hook` on every copy's load_state_dict()."""
        return HookHandles(self._each("register_load_state_dict_pre_hook", hook))

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any]) -> HookHandles:
        """Registers `hook` on every copy's load_state_dict()."""
        return HookHandles(self._each("register_load_state_dict_post_hook", hook))

    # ---- reads: the replica's copy inside strategy.run, replica 0's outside it (they are equal) -------
    def _read(self) -> nn.Module:
        return self.replicas[self._replica() or 0]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of the replica's copy inside strategy.run, of replica 0's outside it (equal)."""
        return self._read().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As parameters(), with names."""
        return self._read().named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        """The buffers of the replica's copy inside strategy.run, of replica 0's outside it (equal)."""
        return self._read().buffers(recurse)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        """As buffers(), with names."""
        return self._read().named_buffers(*args, **kwargs)

    def children(self) -> Iterator[nn.Module]:
        """The replica's copy's children inside strategy.run, replica 0's outside it."""
        return self._read().children()

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        """As children(), with names."""
        return self._read().named_children()

    def modules(self) -> Iterator[nn.Module]:
        """The replica's copy's modules inside strategy.run, replica 0's outside it."""
        return self._read().modules()

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        """As modules(), with names."""
        return self._read().named_modules(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The state_dict of replica 0's copy (equal to every other's), or the replica's own inside run."""
        return self._read().state_dict(*args, **kwargs)

    def get_parameter(self, target: str) -> nn.Parameter:
        """The parameter `target` of the replica's copy (replica 0's outside strategy.run)."""
        return self._read().get_parameter(target)

    def get_buffer(self, target: str) -> Tensor:
        """The buffer `target` of the replica's copy (replica 0's outside strategy.run)."""
        return self._read().get_buffer(target)

    def get_submodule(self, target: str) -> nn.Module:
        """The submodule `target` of the replica's copy (replica 0's outside strategy.run)."""
        return self._read().get_submodule(target)

    def get_extra_state(self) -> Any:
        """The extra state of the replica's copy (replica 0's outside strategy.run)."""
        return self._read().get_extra_state()

    def extra_repr(self) -> str:
        """The extra_repr of the wrapped module."""
        return self._read().extra_repr()

    # ---- refused -------------------------------------------------------------------------------
    def _refuse_move(self, what: str) -> None:
        raise ValueError(f"MirroredModule.{what}(): the copies live on their replicas' devices "
                         f"({', '.join(self._strategy.extended.worker_devices)}), which the strategy chose; "
                         "build the module where it belongs before strategy.mirror, or make the strategy with "
                         "MirroredStrategy(devices=[...]).")

    def to_empty(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the copies live on their replicas' devices."""
        self._refuse_move("to_empty")

    def ipu(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the copies live on their replicas' devices."""
        self._refuse_move("ipu")

    def xpu(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the copies live on their replicas' devices."""
        self._refuse_move("xpu")

    def mtia(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the copies live on their replicas' devices."""
        self._refuse_move("mtia")

    # ---- DDP's no_sync ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A block of micro-steps whose gradients accumulate locally (DDP's no_sync): a mirrored
        optimizer's step() is refused inside it, and the first backward after it (with
        gradient_reduction="mean") or step() all-reduces what accumulated, once. Backward never
        communicates inside the block; open it outside strategy.run (for every replica) or inside it."""
        rid = self._replica()
        shared = self._shared
        if rid is None:
            shared.no_sync_all += 1
        else:
            shared.no_sync[rid] += 1
        try:
            yield
        finally:
            if rid is None:
                shared.no_sync_all -= 1
            else:
                shared.no_sync[rid] -= 1


class HookHandles:
    """The hooks one registration put on every copy: remove() removes them all (a RemovableHandle's API)."""

    def __init__(self, handles: list[Any]):
        self.handles = handles

    def remove(self) -> None:
        """Removes the hook from every replica's copy."""
        for h in self.handles:
            h.remove()

    def __enter__(self) -> HookHandles:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


MEMORY_FORMATS = ("auto", "channels_last", "preserve")
# Per convolution rank, the memory format whose kernels are fastest: oneDNN (CPU) and cuDNN (tensor
# cores) compute convolutions in channels-last order, and convert NCHW operands to it and back on
# every call (1.4-1.6x slower on a 2-core CPU).
_CONV_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}
_FORMAT_NAMES = {torch.channels_last: "channels_last", torch.channels_last_3d: "channels_last_3d"}
# dtypes whose channels-last kernels are the fast ones (float64 has no oneDNN or tensor-core kernel).
_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_memory_format(memory_format: Any, where: str) -> None:
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"{where}(memory_format={memory_format!r}): use \"auto\" (channels_last for modules "
                         "with 2-D or 3-D convolutions on CPU and CUDA), \"channels_last\" (always, for those "
                         "convolutions) or \"preserve\" (the module's own memory format, as given).")


def _conv_weights(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of every 2-D and 3-D convolution (transposed ones too), in module order."""
    return [(f"{name}.weight" if name else "weight", m.weight) for name, m in module.named_modules()
            if isinstance(m, nn.modules.conv._ConvNd) and isinstance(m.weight, Tensor) and m.weight.dim() in (4, 5)]


class _Layout:
    """The memory format a mirrored module's convolutions run in, and which weights it converted (so
    that "preserve" gives back the module's own format). Values never change: only memory order."""

    def __init__(self) -> None:
        self.running = "as given"
        self.converted: set[str] = set()  # weights this changed from the module's own format

    def apply(self, copies: Sequence[nn.Module], memory_format: str, devices: Sequence[str]) -> None:
        """Converts every copy's convolution weights (and gradients) in place, keeping each Parameter
        object: optimizers and hooks that hold them stay valid."""
        weights = [_conv_weights(c) for c in copies]
        if memory_format == "auto":
            fast = all(torch_device(d).type in ("cpu", "cuda") for d in devices) and all(
                w.dtype in _FAST_DTYPES for _, w in weights[0])
            memory_format = "channels_last" if fast else "preserve"
        formats = set()
        for per_copy in weights:
            for name, w in per_copy:
                if memory_format == "preserve":
                    target = torch.contiguous_format if name in self.converted else None
                else:
                    target = _CONV_FORMATS[w.dim()]
                    formats.add(_FORMAT_NAMES[target])
                    if not w.is_contiguous(memory_format=target) and w.is_contiguous():
                        self.converted.add(name)
                if target is not None and not w.is_contiguous(memory_format=target):
                    w.data = w.data.contiguous(memory_format=target)
                    if w.grad is not None:
                        w.grad = w.grad.contiguous(memory_format=target)
        if memory_format == "preserve":
            self.converted.clear()
        self.running = "+".join(sorted(formats)) if formats else "as given"


def _refused_method(mnet: MirroredModule, name: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{mnet!r}.{name}() was called outside strategy.run, where it would run on replica 0's "
                           f"copy only. Call it on every copy (for m in mnet.values: m.{name}(...)) to change them "
                           f"alike, on mnet.values[0] to read, or inside strategy.run, where each replica calls "
                           "its own.")
    return refused


def _refuse_cross_replica_backward(grad: Tensor) -> Tensor:
    raise RuntimeError("backward through the output of a mirrored module called outside strategy.run: the "
                       "gradients would reach replica 0's copy only, and its next step would add them in alone. "
                       "Compute the loss inside strategy.run (each replica on its part of the batch), or call the "
                       "module under torch.no_grad() for inference.")


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in a nest of tuples, lists and dicts, in order."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


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
    from mirrored.distribute.optimizer import MirroredOptimizer
    from mirrored.distribute.variables import SyncOnReadVariable, Variable

    if isinstance(obj, MirroredModule):
        states = [m.state_dict(keep_vars=True) for m in obj.replicas]
        _same_keys(states, "the module's state_dict")
        problem = copies_difference(obj.replicas, obj._strategy.extended.worker_devices)
        if problem is not None:  # equal values that the copies would use differently
            from mirrored.distribute.strategy import OutOfSyncError

            raise OutOfSyncError(f"the copies of the module differ: {problem}")
        for name in states[0]:
            yield name, [s[name] for s in states]
        yield from _synced_tensors(obj.replicas)
    elif isinstance(obj, nn.Module) and _held_as_first(obj) is not None:
        # The module strategy.mirror() took (a Keras model Keras's own fit distributed): its mirror's copies.
        yield from named_copies(_held_as_first(obj))
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
        raise TypeError(f"check_in_sync: expected a mirrored module, optimizer or variable (or the module "
                        f"strategy.mirror took); got {type(obj).__name__}.")


def _held_as_first(module: nn.Module) -> MirroredModule | None:
    """The live mirror whose replica 0's copy is `module` itself, else None."""
    ref = _MIRRORS.get(module)
    mirror = ref() if ref is not None else None
    return mirror if mirror is not None and mirror.replicas[0] is module else None


def copies_checked(obj: Any) -> None:
    """check_in_sync found the copies of `obj` (a mirrored module, or a list of objects) equal: their
    count of in-place writes starts again from here (see _copy_watch.py)."""
    if isinstance(obj, nn.Module) and not isinstance(obj, MirroredModule) and _held_as_first(obj) is not None:
        obj = _held_as_first(obj)
    if isinstance(obj, MirroredModule):
        if obj._shared.watch is not None:
            obj._shared.watch.equal_now(obj.replicas)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            copies_checked(item)
