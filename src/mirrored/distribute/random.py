"""Random numbers inside replica steps: each replica draws from generators of its own.

torch's default CPU generator is one per process, so replica threads drawing from it (dropout,
torch.rand) would get numbers in whatever order the threads reach it. `StrategyRandom` holds a
strategy's seed and how many steps it ran; each step, `ReplicaRandom` - a thread-local
TorchFunctionMode pushed on the replica's thread around its function - gives the replica a
torch.Generator per device seeded by (seed, step, replica_id_in_sync_group): ops that take
`generator=` (torch.rand, Tensor.uniform_, nn.init, ...) get it; ops that take none (the dropout
family, rrelu, RNN and attention dropout) run with the default generator's state swapped for the
replica's, under one lock. Neither thread order nor a restart (the state is (seed, steps), saved in
checkpoints) changes what a replica draws.

With per_example_random=True, the dropout family and rrelu draw each example's mask from a counter
hash of (seed, step, op, index of the example in the global batch), so a run draws the same masks
on any number of replicas; any other random op in a step is refused by name. The mode routes every
torch call of the replica's thread through Python, which slows a replica step by a few percent on a
CPU, so a rerunnable step function (strategy.run's RunOptions; fit's own steps) whose first step drew
nothing runs without it, watched by `DefaultGenerators`: torch's default generators are the only way
to draw without a generator, so a step that drew anyway moved them, and the step is redone with the
mode. That policy is one object per run, `StepRandom`, which strategy.run asks whether the step runs
with the mode and what to do after it. WithoutReplicaRandom lifts the mode for mirrored's own work in
a step, which draws nothing. Uses torch and mirrored._seeds.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from mirrored._seeds import derive_seed

logger = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
# Borrowing a default generator swaps its state; the lock keeps two replicas from swapping it at once.
# It is the one process-wide lock here because torch's default generators are process-wide.
_BORROW_LOCK = threading.Lock()


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash, elementwise on int64 values in [0, 2**32) (Wellons's lowbias32 variant
    with multipliers below 2**31, so no int64 product overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _mix32_(x: Tensor) -> Tensor:
    """_mix32 in place (x must be a fresh int64 tensor): a third of the allocations on large tensors."""
    x.bitwise_xor_(x >> 16)
    x.mul_(0x21F0AAAD).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(0x735A2D97).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def keyed_bits(key: int, first_example: int, examples: int, per_example: int, device: torch.device) -> Tensor:
    """(examples, per_example) int64 hashes in [0, 2**32): entry (e, j) depends only on
    (key, first_example + e, j), never on which replica computes it. Each example's key is hashed
    twice; its elements then take one round (fewer ops than torch's bernoulli_ on CPU)."""
    k1, k2 = key & _M32, (key >> 32) & _M32
    rows = torch.arange(first_example, first_example + examples, dtype=torch.int64, device=device)
    row_key = _mix32(_mix32(rows ^ k1) ^ k2).unsqueeze(1)
    cols = torch.arange(per_example, dtype=torch.int64, device=device)
    return _mix32_(cols ^ row_key)


class DrewWithoutMode(Exception):
    """A step run without the replica random mode drew from a default generator before its update:
    strategy.run rolls it back and runs it again with the mode (it reaches the caller only if a replica
    did not stop in time to be rolled back)."""

    def __init__(self) -> None:
        super().__init__("a step of fit run without the replica random mode drew random numbers from torch's "
                         "default generator; it was to be run again with the mode, but a replica did not stop "
                         "in time to roll it back, so the replicas may differ: restore a checkpoint.")


class StrategyRandom:
    """A strategy's randomness: its seed, the number of steps (strategy.run calls) it ran, and its
    policy for running a step without the replica random mode. get_state()/set_state() put the first
    two in checkpoints, so a resumed run draws what the first would have; begin() decides each run's."""

    def __init__(self, seed: int | None, per_example: bool):
        self._seed = seed
        self.per_example = per_example
        self.steps = 0
        self.seed_given = seed is not None  # by the strategy's seed= or set_state(); else decided at first use
        # Per object a rerunnable step function is bound to (an mr.Model; the function itself otherwise),
        # the codes of its functions whose first step drew nothing (they run without the mode) and of
        # those seen drawing (always with it: a function does not go quiet again). Weak: a verdict goes
        # with its model, and a new model at a dead one's address starts afresh.
        self._quiet: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()
        self._drawing: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()

    @property
    def seed(self) -> int:
        """The seed; with seed=None, torch.initial_seed() when first needed (so torch.manual_seed or
        mr.utils.set_random_seed before the first step decides it)."""
        if self._seed is None:
            self._seed = int(torch.initial_seed())
        return self._seed

    def get_state(self) -> dict[str, Any]:
        """{"seed", "steps", "per_example_random"} as JSON, for mr.train.Checkpoint."""
        return {"seed": self.seed, "steps": self.steps, "per_example_random": self.per_example}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from get_state()'s seed and step count (per_example_random stays the strategy's)."""
        seed, steps = state.get("seed"), state.get("steps")
        if not (isinstance(seed, int) and isinstance(steps, int) and steps >= 0):
            raise ValueError(f"replica random state {state!r}: expected {{'seed': int, 'steps': int >= 0}}, as "
                             "get_state() returns; pass the saved state unchanged.")
        self._seed, self.steps = seed, steps
        self.seed_given = True

    def begin_step(self) -> int:
        """The number of the step about to run (0 for the first)."""
        step = self.steps
        self.steps += 1
        return step

    def begin(self, fn: Callable[..., Any], number: int, rerunnable: bool, devices: list[torch.device],
              watchable: bool) -> StepRandom:
        """The randomness of one strategy.run of `fn`, step `number`: with the mode, or - for a rerunnable
        function (RunOptions) whose first step drew nothing, where a draw would show on torch's default
        generators of this process (`watchable`) - without it, watched."""
        key = step_key(fn) if rerunnable else None
        quiet = watchable and self.quiet(key)
        return StepRandom(self, key, number, quiet, devices)

    def quiet(self, key: StepKey | None) -> bool:
        """Whether the step function of `key` (step_key) runs without the replica random mode: its first
        step, run with the mode, drew nothing."""
        return key is not None and key[0] in self._quiet.get(key[1], ())

    def _observed(self, key: StepKey | None, modes: list[ReplicaRandom]) -> None:
        """A step of `key` ran with `modes`: if none of them drew, `key` runs without them from now on
        (unless it drew before, or per_example_random keys every draw)."""
        if key is None or self.per_example or key[0] in self._drawing.get(key[1], ()):
            return
        verdicts = self._drawing if any(m.drew for m in modes) else self._quiet
        verdicts.setdefault(key[1], set()).add(key[0])

    def _drew(self, key: StepKey) -> None:
        """A step of `key` drew without the mode: it runs with it from now on."""
        self._quiet.get(key[1], set()).discard(key[0])
        self._drawing.setdefault(key[1], set()).add(key[0])

    def __repr__(self) -> str:
        return f"StrategyRandom(seed={self._seed}, steps={self.steps}, per_example={self.per_example})"


StepKey = tuple[Any, Any]  # (code of a step function, the object it is bound to, or the function itself)


def step_key(fn: Callable[..., Any]) -> StepKey | None:
    """The key of a step function's verdict: its code, and the object it is bound to (fit makes a new
    bound method each step) or the function itself. A wrapper made with functools.wraps (a benchmark's
    timer) counts as what it wraps. None for a callable without code (a C function, a partial)."""
    func = getattr(fn, "__func__", fn)
    code = getattr(getattr(func, "__wrapped__", func), "__code__", None)
    if code is None:
        return None
    owner = getattr(fn, "__self__", None)
    if owner is None:
        owner = func
    try:
        weakref.ref(owner)
    except TypeError:
        return None
    return code, owner


class StepRandom:
    """One strategy.run's randomness, as StrategyRandom.begin decided it.

    With the mode (`quiet` False): modes() gives each replica its generators for the step. Quiet: the
    function runs without them, and torch's default generators - where any draw without a generator
    comes from - are watched: at every meeting of the replicas (meeting_check), or right before the
    update on a lone replica (update_check), a draw before any update fails the step with
    DrewWithoutMode; redo() then says to roll it back and run it again with the mode, same step
    number. A draw after the update cannot be undone: the step stands, with a warning. Either way the
    function runs with the mode from then on. finished() records, after a step run with the mode,
    whether it drew."""

    __slots__ = ("_state", "_key", "number", "quiet", "_watch", "_modes")

    def __init__(self, state: StrategyRandom, key: StepKey | None, number: int, quiet: bool,
                 devices: list[torch.device]):
        self._state, self._key, self.number, self.quiet = state, key, number, quiet
        self._watch = DefaultGenerators(devices) if quiet else None
        self._modes: list[ReplicaRandom] | None = None

    def modes(self, first_replica_id: int, count: int, parts: list[tuple[int, int]] | None
              ) -> list[ReplicaRandom] | None:
        """Each of `count` local replicas' randomness for this step (None when quiet); with
        per_example_random, `parts` holds where each replica's part of the global batch starts and its
        size (None: the step has no batch to key by)."""
        if self.quiet:
            return None
        seed, per_example = self._state.seed, self._state.per_example
        if not per_example:
            modes = [ReplicaRandom(seed, self.number, first_replica_id + i) for i in range(count)]
        elif parts is None:
            modes = [ReplicaRandom(seed, self.number, first_replica_id + i, True) for i in range(count)]
        else:
            modes = [ReplicaRandom(seed, self.number, first_replica_id + i, True, start, size)
                     for i, (start, size) in enumerate(parts)]
        self._modes = modes
        return modes

    def meeting_check(self, updating: Callable[[], bool]) -> Callable[[], None] | None:
        """For a quiet step on replica threads: what the last replica to reach a meeting calls, when every
        replica's draws so far are in. `updating()` says whether some replica began its update."""
        if not self.quiet:
            return None
        watch = self._watch

        def check() -> None:
            if watch.moved() and not updating():
                raise DrewWithoutMode()
        return check

    def update_check(self) -> Callable[[], None] | None:
        """For a quiet step of a lone replica (no meeting to check at): the journal's check right before
        the update (StepJournal.check)."""
        return self._watch.refuse_moved if self.quiet else None

    def redo(self, caught: bool, failed: bool, updating: bool, can_roll_back: bool, fn: Any) -> bool:
        """After an attempt: whether to roll it back and run it again with the mode. `caught`: a check
        raised DrewWithoutMode; `failed`: the attempt failed otherwise; `updating`: an update began;
        `can_roll_back`: every replica stopped, none failed by itself."""
        if not self.quiet or (not caught and (failed or not self._watch.moved())):
            return False
        self._state._drew(self._key)
        if caught or not updating:
            self.quiet = not can_roll_back  # (a replica stuck, or a failure of its own: raised as it is)
            return can_roll_back
        _warn_late_draw(fn, self.number)
        return False

    def finished(self) -> None:
        """The step succeeded: a step run with the mode tells whether its function draws."""
        if self._modes is not None:
            self._state._observed(self._key, self._modes)


def _warn_late_draw(fn: Callable[..., Any], number: int) -> None:
    logger.warning(
        "step %d of %s ran without the replica random mode (its first step drew nothing), and torch's "
        "default generator moved after the update was applied: a draw there (a step hook adding noise), "
        "or another thread's (a map function calling torch.rand without a generator). Draws of the step "
        "after its update came in thread order, so this one step may not be reproducible; it runs with "
        "the mode from now on. Draw from the first step on, or give such draws a generator.",
        number, getattr(fn, "__qualname__", None) or repr(fn))


class DefaultGenerators:
    """The states of torch's default generators that replicas on `devices` would draw from without a
    generator (the CPU one; each CUDA device's, if CUDA is initialized when it is made: a replica's
    device is, after its first step), to tell whether a step without the replica random mode drew
    (~2 us per look). They are process-wide, so another thread's draw (a map function calling
    torch.rand) looks like the step's. `watchable(devices)` is False for other device types: their
    steps keep the mode."""

    __slots__ = ("_generators", "_states")

    def __init__(self, devices: list[torch.device]):
        cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self._generators = [torch.default_generator]
        if cuda and torch.cuda.is_initialized():
            self._generators += [torch.cuda.default_generators[i] for i in cuda]
        self._states = self._read()

    @staticmethod
    def watchable(devices: list[torch.device]) -> bool:
        return all(d.type in ("cpu", "cuda") for d in devices)

    def _read(self) -> list[bytes]:
        return [g.get_state().numpy().tobytes() for g in self._generators]

    def moved(self) -> bool:
        """Whether any of them drew since this object was made."""
        return self._read() != self._states

    def refuse_moved(self) -> None:
        """Raises DrewWithoutMode if any of them drew (a check before an update: StepJournal.check)."""
        if self.moved():
            raise DrewWithoutMode()


class ReplicaRandom(TorchFunctionMode):
    """One replica's randomness for one step, active on its thread while its function runs.

    Args:
      seed, step: the strategy's seed and the step's number.
      replica_id: the replica's id in the sync group (its place).
      per_example: key draws by example instead (the batch's examples first_example.. of the global batch).
      first_example, examples: where this replica's part of the global batch starts, and its size
        (None: the step had no batch tensor to key by).
    """

    def __init__(self, seed: int, step: int, replica_id: int, per_example: bool = False,
                 first_example: int = 0, examples: int | None = None):
        super().__init__()
        self._seed, self._step, self._replica_id = seed, step, replica_id
        self._per_example = per_example
        self._first_example, self._examples = first_example, examples
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self._ops = 0  # random ops keyed so far in this step (per_example)
        self.drew = False  # whether the step drew through this mode (StrategyRandom._observed)

    def generator(self, device: torch.device) -> torch.Generator:
        """This replica's generator on `device` for this step, seeded on first use."""
        device = torch.device(device)
        index = device.index if device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" else 0)
        key = (device.type, index)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(torch.device(device.type, index) if device.type != "cpu" else "cpu")
            place = 0 if device.type == "cpu" else 1 + index  # not hash(key): str hashes vary per process
            gen.manual_seed(derive_seed(self._seed, self._step, self._replica_id, place))
            self._generators[key] = gen
        return gen

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kind = _KINDS.get(func)
        if kind is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = dict(kwargs) if kwargs else {}
        if kwargs.get("generator") is None and (kind is _INJECT or _BORROW_DRAWS.get(func, _always)(args, kwargs)):
            self.drew = True  # (a call with its own generator, or dropout in eval, needs no mode)
        if self._per_example:
            keyed = _KEYED.get(func)
            if keyed is not None:
                return keyed(self, func, args, kwargs)
            if kind is _INJECT and kwargs.get("generator") is not None:  # the caller's own stream: theirs
                return func(*args, **kwargs)
            if kind is _BORROW and not _BORROW_DRAWS.get(func, _always)(args, kwargs):
                return func(*args, **kwargs)
            raise RuntimeError(
                f"{_name(func)} was called in a replica step of a strategy with per_example_random=True, which keys "
                "each random draw by the example it is for; this op's draws cannot be tied to examples of the batch "
                f"(covered: {', '.join(sorted(_name(f) for f in _KEYED))} on tensors whose dim 0 is the batch). "
                "Draw it outside strategy.run, pass generator= explicitly, or use per_example_random=False.")
        if kind is _INJECT:
            if kwargs.get("generator") is None:
                kwargs["generator"] = self.generator(_device_of(args, kwargs))
            return func(*args, **kwargs)
        return self._borrow(func, args, kwargs)

    def _borrow(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Runs a random op that takes no generator with the device's default generator in this replica's state."""
        device = _device_of(args, kwargs)
        own = self.generator(device)
        default = torch.default_generator if device.type == "cpu" else torch.cuda.default_generators[own.device.index]
        with _BORROW_LOCK:
            saved = default.get_state()
            default.set_state(own.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                own.set_state(default.get_state())
                default.set_state(saved)

    # ---- per-example draws -------------------------------------------------------------------------
    def keyed_bits(self, what: str, x: Tensor, per_example: int) -> Tensor:
        """Hashes for the examples of `x` (dim 0 is the batch), per_example of them for each."""
        if self._examples is None:
            raise RuntimeError(f"{what} in a replica step with per_example_random=True, but strategy.run got no "
                               "tensor argument to find the batch in. Pass the batch (e.g. the distributed "
                               "dataset's element) to strategy.run.")
        if x.dim() == 0 or x.shape[0] != self._examples:
            raise RuntimeError(f"{what} on a tensor of shape {tuple(x.shape)} with per_example_random=True: its dim 0 "
                               f"must be this replica's batch ({self._examples} examples), so that draws are keyed by "
                               "example. Apply it to a batch-first tensor, or use per_example_random=False.")
        key = derive_seed(self._seed, self._step, self._ops, 0x5EED)
        self._ops += 1
        return keyed_bits(key, self._first_example, self._examples, per_example, x.device)


class WithoutReplicaRandom:
    """`with WithoutReplicaRandom():` mirrored's own work in a replica step (its reductions, buffer sync
    and step journal, which draw nothing) runs without the replica's ReplicaRandom on top of torch's
    function-mode stack: the mode routes every torch call through Python (~1 us each, ~1,000 calls
    per ResNet-20 step). A mode the caller entered above it stays, and so does this one."""

    __slots__ = ("_mode",)

    def __enter__(self) -> None:
        self._mode = torch._C._pop_torch_function_stack() if current_mode() is not None else None

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            torch._C._push_on_torch_function_stack(self._mode)
            self._mode = None


def current_mode() -> ReplicaRandom | None:
    """The replica random mode this thread runs in (a ReplicaRandom on top of torch's function-mode
    stack), or None: a quiet step, or outside a replica step."""
    depth = torch._C._len_torch_function_stack()
    top = torch._C._get_function_stack_at(depth - 1) if depth else None
    return top if isinstance(top, ReplicaRandom) else None


def _always(args: tuple, kwargs: dict) -> bool:
    return True


def _name(func: Callable) -> str:
    module = getattr(func, "__module__", None) or ""
    qual = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
    if "TensorBase" in qual or qual.startswith("Tensor."):
        return "Tensor." + qual.rsplit(".", 1)[-1]
    if module.startswith("torch.nn.functional"):
        return "torch.nn.functional." + qual
    if module.startswith("torch.nn.init"):
        return "torch.nn.init." + qual
    return "torch." + getattr(func, "__name__", qual)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    for a in args:
        if isinstance(a, Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor):
            return a[0].device
    return torch.get_default_device()


# ---- which ops draw, and how each is handled --------------------------------------------------------
_INJECT, _BORROW = 1, 2

_INJECTED = [torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.multinomial,
             torch.normal, torch.poisson, torch.binomial, Tensor.uniform_, Tensor.normal_, Tensor.bernoulli_,
             Tensor.bernoulli, Tensor.random_, Tensor.exponential_, Tensor.geometric_, Tensor.log_normal_,
             Tensor.cauchy_, Tensor.multinomial, torch.nn.init.uniform_, torch.nn.init.normal_,
             torch.nn.init.trunc_normal_, torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_,
             torch.nn.init.kaiming_uniform_, torch.nn.init.kaiming_normal_, torch.nn.init.orthogonal_,
             torch.nn.init.sparse_]
_BORROWED = [F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             F.rrelu, F.rrelu_, F.gumbel_softmax, F.multi_head_attention_forward, F.scaled_dot_product_attention,
             F.fractional_max_pool2d, F.fractional_max_pool3d, torch.dropout, torch.dropout_, torch.feature_dropout,
             torch.feature_dropout_, torch.alpha_dropout, torch.alpha_dropout_, torch.feature_alpha_dropout,
             torch.feature_alpha_dropout_, torch.native_dropout, torch.rrelu, torch.rrelu_, torch.lstm, torch.gru,
             torch.rnn_tanh, torch.rnn_relu]
for _f in ("fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices"):
    if hasattr(F, _f):
        _BORROWED.append(getattr(F, _f))
for _f in (torch.rand_like, torch.randn_like, torch.randint_like):  # generator= is recent in these
    try:
        _f(torch.zeros(1), *([2] if _f is torch.randint_like else []), generator=torch.Generator())
        _INJECTED.append(_f)
    except TypeError:
        _BORROWED.append(_f)
_KINDS: dict[Any, int] = {**{f: _INJECT for f in _INJECTED}, **{f: _BORROW for f in _BORROWED}}


def _rnn_draws(args: tuple, kwargs: dict) -> bool:
    # lstm/gru/rnn_* take (..., num_layers, dropout: float, train: bool, ...): dropout is their one float.
    for i, a in enumerate(args):
        if type(a) is float:
            return a > 0 and bool(args[i + 1]) if i + 1 < len(args) else a > 0
    return False


def _sdpa_draws(args: tuple, kwargs: dict) -> bool:
    p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return bool(p)


def _mha_draws(args: tuple, kwargs: dict) -> bool:
    p = args[10] if len(args) > 10 else kwargs.get("dropout_p", 0.0)
    training = args[13] if len(args) > 13 else kwargs.get("training", True)
    return bool(p) and bool(training)


def _fractional_draws(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("_random_samples") is None and not (len(args) > 5 and args[5] is not None)


def _dropout_draws(training_default: bool, training_at: int = 2, p_at: int = 1):
    def draws(args: tuple, kwargs: dict) -> bool:
        training = args[training_at] if len(args) > training_at else kwargs.get("training", kwargs.get(
            "train", training_default))
        p = args[p_at] if len(args) > p_at else kwargs.get("p", 0.5)
        return bool(training) and not (isinstance(p, (int, float)) and p == 0)
    return draws


_BORROW_DRAWS: dict[Any, Callable[[tuple, dict], bool]] = {
    **{f: _dropout_draws(True) for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)},
    **{f: _dropout_draws(False) for f in (F.alpha_dropout, F.feature_alpha_dropout)},
    **{f: _dropout_draws(True) for f in (torch.dropout, torch.dropout_, torch.feature_dropout, torch.feature_dropout_,
                                           torch.alpha_dropout, torch.alpha_dropout_, torch.feature_alpha_dropout,
                                           torch.feature_alpha_dropout_, torch.native_dropout)},
    torch.lstm: _rnn_draws, torch.gru: _rnn_draws, torch.rnn_tanh: _rnn_draws, torch.rnn_relu: _rnn_draws,
    F.scaled_dot_product_attention: _sdpa_draws, F.multi_head_attention_forward: _mha_draws,
    F.fractional_max_pool2d: _fractional_draws, F.fractional_max_pool3d: _fractional_draws,
}


# ---- per-example implementations (autograd differentiates them: a mask times the input) -------------
def _per_example(x: Tensor) -> int:
    """Elements per example of a batch-first tensor (a 0-d one is refused by keyed_bits)."""
    if x.dim() == 0:
        return 1
    return x.numel() // x.shape[0] if x.shape[0] else 0


def _keep_mask(mode: ReplicaRandom, what: str, x: Tensor, p: float, feature: bool) -> Tensor:
    """1.0 where an element (or, feature=True, a channel) is kept, with probability 1 - p."""
    bits = mode.keyed_bits(what, x, x.shape[1] if feature else _per_example(x))
    keep = (bits >= int(p * 4294967296.0)).to(x.dtype)
    if feature:
        return keep.view(x.shape[0], x.shape[1], *([1] * (x.dim() - 2)))
    return keep.view(x.shape)


def _check_p(what: str, p: float) -> None:
    if p < 0.0 or p > 1.0:
        raise ValueError(f"{what}: dropout probability has to be between 0 and 1, but got {p}")


def _dropout(mode: ReplicaRandom, what: str, x: Tensor, p: float, training: bool, inplace: bool,
             feature: bool, alpha: bool) -> Tensor:
    _check_p(what, p)
    if not training or p == 0:  # (an empty part of the batch still counts the op, as on the other replicas)
        return x
    if feature and x.dim() < 2:
        raise RuntimeError(f"{what}: feature dropout needs a batch and a channel dim; got shape {tuple(x.shape)}.")
    keep = _keep_mask(mode, what, x, p, feature)
    if alpha:  # torch's formula (ATen's _dropout_impl): keeps the self-normalizing mean and variance
        if p == 1:
            return x.mul_(0) if inplace else x * 0
        a_const = 1.7580993408473766
        a = 1.0 / ((a_const * a_const * p + 1) * (1 - p)) ** 0.5
        b = (keep - 1) * (a_const * a) + a_const * a * p
        noise = keep * a
        return x.mul_(noise).add_(b) if inplace else x * noise + b
    noise = keep * (1.0 / (1 - p)) if p < 1 else keep * 0
    return x.mul_(noise) if inplace else x * noise


def _f_dropout(feature: bool, alpha: bool, batched_dims: tuple[int, ...] | None, training_default: bool):
    def keyed(mode: ReplicaRandom, func: Callable, args: tuple, kwargs: dict) -> Tensor:
        names = ("input", "p", "training", "inplace")
        values = dict(zip(names, args)) | kwargs
        x = values["input"]
        what = _name(func)
        if batched_dims is not None and x.dim() not in batched_dims:
            raise RuntimeError(f"{what} on an input of shape {tuple(x.shape)} with per_example_random=True: only a "
                               f"batched input ({' or '.join(f'{d}-D' for d in batched_dims)}) has its examples on dim "
                               "0. Give it a batch dim.")
        return _dropout(mode, what, x, float(values.get("p", 0.5)), bool(values.get("training", training_default)),
                        bool(values.get("inplace", False)), feature, alpha)
    return keyed


def _torch_dropout(feature: bool, alpha: bool, inplace: bool):
    def keyed(mode: ReplicaRandom, func: Callable, args: tuple, kwargs: dict) -> Tensor:
        values = dict(zip(("input", "p", "train"), args)) | kwargs
        return _dropout(mode, _name(func), values["input"], float(values["p"]), bool(values["train"]), inplace,
                        feature, alpha)
    return keyed


def _rrelu(inplace_default: bool | None):
    def keyed(mode: ReplicaRandom, func: Callable, args: tuple, kwargs: dict) -> Tensor:
        values = dict(zip(("input", "lower", "upper", "training", "inplace"), args)) | kwargs
        x = values["input"]
        lower, upper = float(values.get("lower", 1.0 / 8)), float(values.get("upper", 1.0 / 3))
        training = bool(values.get("training", False))  # torch's default for F.rrelu and torch.rrelu
        inplace = inplace_default if inplace_default is not None else bool(values.get("inplace", False))
        if not training:
            slope = (lower + upper) / 2
            return F.leaky_relu(x, slope, inplace=inplace)
        bits = mode.keyed_bits(_name(func), x, _per_example(x))
        u = bits.to(torch.float64).mul_(1.0 / 4294967296.0).to(x.dtype).view(x.shape)
        noise = torch.where(x >= 0, torch.ones((), dtype=x.dtype, device=x.device), lower + (upper - lower) * u)
        return x.mul_(noise) if inplace else x * noise
    return keyed


_KEYED: dict[Any, Callable[[ReplicaRandom, Callable, tuple, dict], Tensor]] = {
    F.dropout: _f_dropout(False, False, None, True),
    F.dropout1d: _f_dropout(True, False, (3,), True),
    F.dropout2d: _f_dropout(True, False, (3, 4), True),
    F.dropout3d: _f_dropout(True, False, (5,), True),
    F.alpha_dropout: _f_dropout(False, True, None, False),
    F.feature_alpha_dropout: _f_dropout(True, True, None, False),
    torch.dropout: _torch_dropout(False, False, False), torch.dropout_: _torch_dropout(False, False, True),
    torch.feature_dropout: _torch_dropout(True, False, False),
    torch.feature_dropout_: _torch_dropout(True, False, True),
    torch.alpha_dropout: _torch_dropout(False, True, False), torch.alpha_dropout_: _torch_dropout(False, True, True),
    torch.feature_alpha_dropout: _torch_dropout(True, True, False),
    torch.feature_alpha_dropout_: _torch_dropout(True, True, True),
    F.rrelu: _rrelu(None), F.rrelu_: _rrelu(True), torch.rrelu: _rrelu(False), torch.rrelu_: _rrelu(True),
}
