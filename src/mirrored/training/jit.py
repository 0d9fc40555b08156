"""`Model.compile(jit_compile=True)`: each replica's forward (and through AOTAutograd its backward)
compiled with torch.compile, the rest of the step kept eager.

What is compiled is the module call: the forward of each replica's copy, with its hooks, and the
backward AOTAutograd derives from it. The loss, metrics, gradient all-reduce and optimizer stay
eager, because they meet the other replicas (a collective inside a compiled graph would break it)
and cost little next to the convolutions. The replicas share one compiled graph: their copies have
the same structure, dynamo passes parameters as graph inputs, and guards that differ (a device, a
shape, train or eval mode) compile another entry. One thread compiles each new input signature
while the others wait for it: two replica threads that miss dynamo's cache together would each
compile the same graph (dynamo serialises compilation but does not re-check its cache), and the
backward graph is compiled with the forward, under dynamo's compile lock, instead of lazily in
whichever replica thread reaches backward first.

Results: with backend "aot_eager" (dynamo and AOTAutograd, the same kernels) they are bitwise those
of eager mode, bf16 autocast included. With inductor, fused kernels reassociate float sums
(BatchNorm statistics, fused reductions): a forward output moves by a few float32 ulps (~1e-7), and
training compounds that through BatchNorm: the weights of the small ResNet differ from eager by up
to 2e-5 after 3 SGD steps (benchmarks/jit_compile.py prints it); the tests' tiny net stays within
rtol=1e-4, atol=1e-5 of eager after 4 steps. It is not a bitwise-reproducible mode. Every replica
applies the same all-reduced gradient, so replicas stay bitwise identical to each other either way.

Runs eager, with one warning naming the cause and the fix: where torch.compile cannot work (no C++
compiler for inductor on CPU, no triton on CUDA), for modules with SyncBatchNorm (their forward
all-reduces between replicas), and after torch.compile fails on the model. The first run of a step
function (fit's, evaluate's, predict's) is eager too: mirrored's check for modules it did not
mirror is a process-wide module hook during that run, and dynamo would otherwise compile a graph
for it that is thrown away at the next step. Each batch size compiles a static graph once (an uneven
last batch: one or two more, its replicas' parts), and so does each mode (train, eval) and each
intra-op thread count (model(x) on the main thread); see DYNAMIC below. Past dynamo's recompile
limit (8 per model), new signatures run eager.

`jit_compile="auto"` (Keras 3's torch default) starts eager, and fit decides after its first
AUTO_PROBE_STEPS steps: it compiles when the steps left in that fit, at the measured eager
step time, would save more than compiling costs (`pays_back`). Measured on 2 CPU replicas (small
ResNet, benchmarks/jit_compile.py, figures in benchmarks/RESULTS.md) compiled steps are 1.16-1.92x
faster and compiling takes 40-200 s, so short runs stay eager; the decision is logged (INFO). No GPU
figures exist yet: the same constants stand for CUDA until measured.

Custom loops: compile the module's compute, not the replica function: strategy.run(torch.compile(fn))
would trace the all-reduce and the optimizer's meeting of the replicas. `ReplicaCompiler(mnet.values,
strategy.extended.worker_devices)` (this module) compiles each copy of a mirrored module in place and
keeps the mirror's bookkeeping (rollback of a failed step, example counts) around the compiled call.
Uses torch and layers.py.
"""
from __future__ import annotations

import logging
import shutil
import statistics
import threading
import time
import traceback
import types
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from mirrored.training.layers import has_sync_batchnorm

logger = logging.getLogger(__name__)

BACKEND = "inductor"  # what jit_compile=True compiles with, as Keras 3's torch backend
# torch.compile's dynamic=. False: a static graph per batch size, shared by the replicas. None (torch's
# default) would recompile a second size as a dynamic graph, which specialises on the input's storage
# offset (0 for replica 0's slice of the global batch, not for the others': a graph per replica), and
# whose "this size varies" memory is kept per function name, so it would carry over to other models.
# Measured equally fast (benchmarks/jit_compile.py --dynamic auto|false).
DYNAMIC: bool | None = False
_BACKENDS_NEEDING_CXX = ("inductor",)  # backends that compile C++ for CPU tensors
# jit_compile="auto": compile once the steps left would save more than this costs (benchmarks/RESULTS.md,
# "jit_compile": a cold compile of the small ResNet took 40-200 s; compiled steps ran 1.16-1.92x faster,
# so the low end of each is taken: a run compiles only where it pays back even then).
AUTO_COMPILE_S = 120.0
AUTO_SPEEDUP = 1.15
AUTO_PROBE_STEPS = 3  # eager steps fit times first; the first of them (warm-up) is not counted


def resolve(jit_compile: Any, where: str = "Model.compile") -> bool:
    """compile()'s jit_compile as a bool: True, False, or "auto" (eager, as Keras 3 on torch)."""
    if isinstance(jit_compile, bool):
        return jit_compile
    if jit_compile == "auto":
        # Eager at compile(): whether compiling pays is fit's decision, from its measured steps (pays_back).
        return False
    raise ValueError(f"{where}(jit_compile={jit_compile!r}): use True (torch.compile each replica's step), "
                     "False (eager) or \"auto\" (fit compiles where it pays back within the run).")


def pays_back(step_s: float, steps_left: int | None, compile_s: float | None = None,
              speedup: float | None = None) -> tuple[bool, str]:
    """jit_compile="auto"'s decision: whether compiling now saves more than it costs within the run
    (steps_left x step_s x (1 - 1/speedup) > compile_s; AUTO_COMPILE_S and AUTO_SPEEDUP by default),
    and the sentence that says why."""
    compile_s = AUTO_COMPILE_S if compile_s is None else compile_s
    speedup = AUTO_SPEEDUP if speedup is None else speedup
    if steps_left is None:
        return False, (f"eager: the dataset's length is unknown, so the time compiling would save cannot be "
                       f"weighed against ~{compile_s:.0f} s of compiling; pass jit_compile=True for a long run")
    saved = steps_left * step_s * (1 - 1 / speedup)
    verdict = "compiling" if saved > compile_s else "eager"
    return saved > compile_s, (f"{verdict}: {steps_left} steps left at {step_s * 1e3:.1f} ms each would save "
                               f"~{saved:.0f} s at {speedup:.2f}x, against ~{compile_s:.0f} s of compiling")


class AutoCompile:
    """fit's jit_compile="auto": times its first steps (AUTO_PROBE_STEPS), then decides once whether to
    compile (pays_back) and logs why."""

    def __init__(self, devices: Sequence[str]):
        self._devices = list(devices)
        self._times: list[float] = []
        self._last: float | None = None
        self.decided = False

    def after_step(self, batches: int, steps_left: int | None) -> bool:
        """Called after each fit step of `batches` batches; True once, when fit should compile now."""
        if self.decided:
            return False
        for d in self._devices:  # (a GPU's step is its queued work, not the host's launches)
            if d.startswith("cuda"):
                torch.cuda.synchronize(torch.device(d))
        now = time.perf_counter()
        if self._last is not None:
            self._times.append((now - self._last) / max(batches, 1))
        self._last = now
        if len(self._times) < AUTO_PROBE_STEPS - 1:
            return False
        self.decided = True
        compile_now, why = pays_back(statistics.median(self._times), steps_left)
        failure = unavailable(self._devices, BACKEND) if compile_now else None
        if failure is not None:
            compile_now, why = False, f"eager: it would pay back ({why}), but {failure}"
        logger.info('Model.fit(jit_compile="auto"): %s.', why)
        return compile_now


def find_cpp_compiler() -> str | None:
    """The C++ compiler inductor would use for CPU kernels ($CXX, else g++), None where it has none."""
    try:
        from torch._inductor import config

        candidates = [c for c in config.cpp.cxx if c]
    except (ImportError, AttributeError):
        candidates = []
    for name in candidates or ["g++"]:
        found = shutil.which(name)
        if found:
            return found
    return None


def unavailable(devices: Sequence[str], backend: str) -> str | None:
    """Why torch.compile with `backend` cannot run on `devices` here (cause and fix), None if it can."""
    if backend not in _BACKENDS_NEEDING_CXX:
        return None
    if any(d.startswith("cpu") for d in devices) and find_cpp_compiler() is None:
        return ("torch.compile's inductor backend needs a C++ compiler for CPU code and none was found ($CXX, "
                "else g++ on PATH). Install one (e.g. `apt-get install g++`) or set CXX to its path; "
                "jit_compile=False runs eager without this warning")
    if any(d.startswith("cuda") for d in devices):
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - every torch 2.x has it
            return None
        if not has_triton():
            return ("torch.compile's inductor backend needs triton for CUDA code and it is not installed. "
                    "Install it (`pip install triton`, the version your torch names); jit_compile=False runs "
                    "eager without this warning")
    return None


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The function each ReplicaCompiler compiles (a copy of its code each time; see _fresh_call)."""
    return module._call_impl(*args, **kwargs)


def _fresh_call() -> types.FunctionType:
    """_call_module with code of its own: dynamo keeps its graphs and counts recompiles per code
    object, so each model gets its own cache and its own recompile_limit."""
    code = _call_module.__code__.replace()
    return types.FunctionType(code, _call_module.__globals__, _call_module.__name__)


def _eager_backward_backend(backend: str) -> Any:
    """`backend` compiling the backward graph with the forward, under dynamo's compile lock, rather
    than lazily when backward first runs: AOTAutograd's lazy compile takes no lock, so replica
    threads sharing the graph would each compile its backward, at the same time."""
    compile_fn = torch._dynamo.lookup_backend(backend)

    def compile_with_backward(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            return compile_fn(gm, example_inputs, **kwargs)

    return compile_with_backward


def _global_module_hooks() -> bool:
    """Whether a process-wide module hook is installed (torch.nn.modules.module's registries)."""
    return any(getattr(torch_module, name, None) for name in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
        "_global_backward_hooks"))


def _signature(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What decides whether a replica's call may need a new graph: mode, grad mode and the inputs'
    shapes (dynamo guards on more, e.g. the intra-op thread count, which replica threads share)."""
    leaves = [*args, *kwargs.values()]
    shapes = tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a) for a in leaves)
    return module.training, torch.is_grad_enabled(), tuple(kwargs), shapes


class _Slot:
    """What fills nn.Module's `_compiled_call_impl` slot (the one nn.Module.compile fills): a call of
    the module goes through its ReplicaCompiler. Copying or pickling the module leaves the copy
    uncompiled, instead of calling the original's graph with the original's parameters."""

    __slots__ = ("_compiler", "_module")

    def __init__(self, compiler: ReplicaCompiler, module: nn.Module):
        self._compiler = compiler
        self._module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._compiler.call(self._module, args, kwargs)

    def __reduce__(self) -> tuple:
        return _uncompiled, ()


def _uncompiled() -> None:
    return None


class ReplicaCompiler:
    """torch.compile of every replica copy's module call, with one graph shared by the copies.

    Installs itself in each copy (calls of the copy, through a mirror or not, run compiled) until
    remove(); runs eager, warning once with the cause and the fix, where compiling cannot work or
    fails (see the module docstring)."""

    def __init__(self, copies: Sequence[nn.Module], devices: Sequence[str], backend: Any = None,
                 where: str = "Model.compile(jit_compile=True)"):
        backend = backend or BACKEND
        self.backend = backend
        self._where = where
        self._copies = tuple(copies)
        self._lock = threading.Lock()
        self._ready: set[tuple] = set()  # signatures compiled (or known to need no compile)
        self._warned = False
        self.failure: str | None = unavailable(devices, backend)
        if self.failure is None and self._copies and (
                has_sync_batchnorm(self._copies[0])
                or any(isinstance(m, nn.SyncBatchNorm) for m in self._copies[0].modules())):
            # (and a replica holding the compile lock would wait there for one waiting on the lock)
            self.failure = ("the module has SyncBatchNorm, whose forward all-reduces statistics between the "
                            "replicas, which a compiled graph cannot do. Use BatchNorm to compile")
        if self.failure is not None:
            self._warn()
            return
        self._compiled = torch.compile(_fresh_call(), backend=_eager_backward_backend(backend), dynamic=DYNAMIC)
        for c in self._copies:
            c._compiled_call_impl = _Slot(self, c)
        logger.info("%s: each replica's forward and backward compiled with torch.compile(backend=%r)", where,
                    backend)

    @property
    def active(self) -> bool:
        """Whether calls run compiled (False: eager, see `failure`)."""
        return self.failure is None

    def remove(self) -> None:
        """Puts the copies back to eager calls."""
        for c in self._copies:
            if isinstance(c.__dict__.get("_compiled_call_impl"), _Slot):
                c._compiled_call_impl = None

    def call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """`module(*args, **kwargs)`, compiled (eager while it cannot be: see the module docstring)."""
        # Traced by a torch.compile of the user's own: the eager call is what that trace should see.
        # (is_dynamo_compiling, not is_compiling: the latter also reads a process-wide flag that is
        # True while any thread compiles, so a second replica ran eager beside replica 0's compile,
        # and the two deadlocked inside autocast and dynamo now and then.)
        if self.failure is not None or _global_module_hooks() or torch.compiler.is_dynamo_compiling():
            return module._call_impl(*args, **kwargs)
        key = _signature(module, args, kwargs)
        if key in self._ready:
            return self._run(module, args, kwargs)
        with self._lock:  # one replica compiles a new signature; the others then find its graph
            out = self._run(module, args, kwargs)
            self._ready.add(key)
        return out

    def _run(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.failure is not None:  # another replica's compile failed while this one waited
            return module._call_impl(*args, **kwargs)
        try:
            return self._compiled(module, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            # Compiling failed before the graph ran (dynamo traces on fake tensors), so nothing changed:
            # the eager call is the step's real forward. If it fails too, the error is the model's.
            out = module._call_impl(*args, **kwargs)
            cause = getattr(e, "inner_exception", None) or e  # BackendCompilerFailed wraps the backend's error
            first_line = (str(cause).strip().splitlines() or [""])[0][:300]
            self.failure = (f"torch.compile failed on the model ({type(cause).__name__}: {first_line}; the log has "
                            "the whole error). Fix what it names, or pass jit_compile=False")
            # As text: a record holding the traceback would keep the step's frames (and the replicas) alive.
            logger.warning("%s: torch.compile failed:\n%s", self._where, "".join(traceback.format_exception(e)))
            self._warn()
            return out

    def _warn(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self._where}: running eager: {self.failure}.", UserWarning, stacklevel=4)

    def __repr__(self) -> str:
        state = "compiled" if self.active else f"eager ({self.failure})"
        return f"ReplicaCompiler(backend={self.backend!r}, replicas={len(self._copies)}, {state})"
