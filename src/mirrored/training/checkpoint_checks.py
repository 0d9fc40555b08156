"""Does a checkpoint fit what it is loaded into? Checked in full before anything is assigned.

Model.load and Model.load_weights read a file with checkpoint.py, and mr.train.Checkpoint (so
BackupAndRestore too) checks every entry with these before it assigns any: `state_dict` and
`module_state` (every tensor's name, shape and dtype against the module's), `optimizer_state` (the
param groups against the optimizer's own, each state tensor against its parameter, mr.optimizers'
step count, accumulated gradients and moving averages), `tensor` (a variable's value), `rng_state`
(each state set on a fresh generator, which checks exactly what the restore will), `epoch_state`
and `object_state` (a get_state() against the object's own), `build_module` (the recorded
architecture against the model factory's arguments and bounds, built on the meta device first so a
forged size never reaches the allocator) and `model_metadata` (a Model file's JSON fields). The
optimizer's JSON is decoded by checkpoint.decode_value, the one decoder of the format, whose checks
name the file through Origin.damaged. A problem is a CheckpointError (a ValueError) naming the
file, the key and both values. Uses torch, numpy, checkpoint.py and mirrored.models.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mirrored.training import checkpoint
from mirrored.training.checkpoint import CheckpointError

__all__ = ["Origin", "build_module", "epoch_state", "is_count", "model_metadata",
           "module_state", "object_state", "optimizer_state", "rng_state", "state_dict", "tensor"]

_KERAS_KEY = "keras"  # mr.optimizers' own state in a state_dict (optimizers.py)
_MAX_DEPTH = 32  # JSON nesting deeper than any optimizer setting: a damaged file, not recursion
_MAX_CUDA_DEVICES = 1 << 12
_PRECISIONS = (None, "fp32", "bf16", "fp16")
# Optimizer state tensors are scalars (a step count) or shaped like their parameter, except these
# (torch.optim.Adafactor's factored second moments): key -> the shape for a parameter's shape.
_FACTORED_SHAPES = {
    "row_var": lambda shape: (*shape[:-1], 1),
    "col_var": lambda shape: (*shape[:-2], 1, shape[-1]),
}


# Keys torch's LR schedulers add to an optimizer's param groups (OneCycleLR, CyclicLR), and torch's own
# param_names: a file saved with a scheduler attached holds them, an optimizer built afresh not yet.
_SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "param_names")


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a checkpoint is being loaded: names the file in every error, says how to fix a mismatch."""

    where: str  # e.g. "Model.load('run/model.safetensors')"
    mismatch_fix: str = "Load it into the model (and optimizer) that saved it."

    def mismatch(self, problem: str, error: type[CheckpointError] = CheckpointError) -> CheckpointError:
        return error(f"{self.where}: {problem}. {self.mismatch_fix}")

    def damaged(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {problem}; the file is damaged or was not written by "
                               "mirrored. Use another copy (a backup, an earlier checkpoint).")


# --------------------------------------------------------------------------------------------
# Tensors


def state_dict(origin: Origin, tensors: Mapping[str, Tensor], expected: Mapping[str, Any],
               prefix: str = "model/", owner: str = "the model") -> dict[str, Tensor]:
    """The file's tensors under `prefix` (prefix removed), once their names, shapes and dtypes match
    `expected` (a state_dict; meta tensors will do)."""
    return module_state(origin, tensors, expected, prefix, owner, complete=True)[0]


def module_state(origin: Origin, tensors: Mapping[str, Tensor], expected: Mapping[str, Any], prefix: str,
                 owner: str, complete: bool = False, error: type[CheckpointError] = CheckpointError
                 ) -> tuple[dict[str, Tensor], list[str], list[str]]:
    """The file's tensors under `prefix` that `expected` (a state_dict) also has, each checked for shape and
    dtype, with the names only `expected` has (missing) and only the file has (unused). With complete=True
    either kind of name is an `error` instead."""
    got = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
    want = {k: v for k, v in expected.items() if isinstance(v, Tensor)}
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    if complete and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"{owner} has {_few(missing)}, which the file lacks")
        if unexpected:
            parts.append(f"the file holds {_few([prefix + k for k in unexpected])}, which {owner} lacks")
        raise origin.mismatch(f"the tensors do not match {owner}: {'; '.join(parts)}", error)
    for k, ref in want.items():
        if k in got:
            _check_tensor(origin, prefix + k, got[k], tuple(ref.shape), ref.dtype, owner)
    return {k: got[k] for k in want if k in got}, missing, unexpected


def tensor(origin: Origin, tensors: Mapping[str, Tensor], key: str, like: Any, owner: str) -> Tensor:
    """The file's tensor `key`, once its shape and dtype fit `like` (a tensor or a variable)."""
    t = tensors.get(key)
    if t is None:
        raise origin.damaged(f"the metadata lists {owner}, but the file holds no tensor {key!r}")
    _check_tensor(origin, key, t, tuple(like.shape), like.dtype, owner)
    return t


def _check_tensor(origin: Origin, key: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                  owner: str) -> None:
    if tuple(t.shape) != shape:
        raise origin.mismatch(f"tensor {key!r} has shape {tuple(t.shape)} in the file but {shape} in {owner}")
    # A floating tensor loads into another floating dtype (cast, as torch's load_state_dict does);
    # an integer count read into a float (or the reverse) is another tensor, not a rounding.
    if t.dtype != dtype and not (t.dtype.is_floating_point and dtype.is_floating_point):
        raise origin.mismatch(f"tensor {key!r} has dtype {t.dtype} in the file but {dtype} in {owner}")


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def build_module(origin: Origin, config: Any, tensors: Mapping[str, Tensor]) -> nn.Module:
    """The module the file's `model_config` records, built only once its arguments pass the model
    factory's checks and a meta-device copy (no memory) has exactly the file's tensor shapes: so a
    forged num_classes=10**12 is an error, not an allocation."""
    from mirrored import models

    if (not isinstance(config, dict) or not isinstance(config.get("name"), str)
            or not isinstance(config.get("kwargs", {}), dict)):
        raise origin.damaged(f"the recorded architecture {config!r:.200} is not "
                             "{'name': str, 'kwargs': dict}")
    name, kwargs = config["name"], config.get("kwargs", {})
    try:
        models.check_config(name, kwargs)
        skeleton = models.skeleton(name, **kwargs)
    except (TypeError, ValueError) as e:
        raise origin.damaged(f"the recorded architecture {name}({_kwargs(kwargs)}) cannot be built: {e}") from None
    state_dict(origin, tensors, skeleton.state_dict(), owner=f"{name}({_kwargs(kwargs)})")
    return models.get(name, **kwargs)


def _kwargs(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r:.40}" for k, v in kwargs.items())


# --------------------------------------------------------------------------------------------
# Optimizer state


def optimizer_state(origin: Origin, tensors: Mapping[str, Tensor], meta: Any, optimizer: torch.optim.Optimizer,
                    param_names: Sequence[str] | None = None, prefix: str = "optimizer") -> dict[str, Any]:
    """The state_dict for optimizer.load_state_dict(), once it fits `optimizer`: as many groups of
    as many parameters, the same settings of the same kinds, every state tensor a scalar or shaped
    like its parameter, and mr.optimizers' own state (under "keras") of the kinds it holds. (torch
    checks only the group sizes: a momentum buffer of the wrong shape would load and fail in the
    first step.) `prefix` is the optimizer's tensors' prefix in the file, for the messages."""
    if (not isinstance(meta, dict) or not isinstance(meta.get("state"), dict)
            or not isinstance(meta.get("param_groups"), list)):
        raise origin.damaged(f"the {prefix} metadata is not a dict with 'state' and 'param_groups'")
    cls = type(optimizer).__name__
    live_groups, saved_groups = optimizer.param_groups, meta["param_groups"]
    if len(saved_groups) != len(live_groups):
        raise origin.mismatch(f"the {prefix} state has {len(saved_groups)} parameter group(s) but the "
                              f"{cls} optimizer has {len(live_groups)}")
    params: dict[int, tuple[Tensor, str]] = {}
    in_order: list[tuple[Tensor, str]] = []
    names = iter(param_names or ())
    groups = []
    for g, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        key = f"{prefix} param_groups[{g}]"
        ids = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(ids, list) or not all(_is_count(i) for i in ids):
            raise origin.damaged(f"{key} is not a dict whose 'params' is a list of parameter indices")
        if len(ids) != len(live["params"]):
            raise origin.mismatch(f"{key} holds {len(ids)} parameters but the {cls} optimizer's group "
                                  f"holds {len(live['params'])}")
        for i, p in zip(ids, live["params"]):
            if i in params:
                raise origin.damaged(f"{key} lists parameter {i} twice")
            params[i] = (p, next(names, f"parameter {i}"))
            in_order.append(params[i])  # as the optimizer's own list (mr.optimizers' state follows it)
        groups.append(_group(origin, key, saved, live, tensors, optimizer))
    group_of = {i: g for g, saved in enumerate(saved_groups) for i in saved["params"]}
    layouts: dict[tuple, dict[str, bool] | None] = {}
    state: dict[int, dict[str, Any]] = {}
    for index, entries in meta["state"].items():
        pid = int(index) if isinstance(index, str) and index.isdigit() and len(index) < 19 else None
        if pid not in params or not isinstance(entries, dict):
            raise origin.mismatch(f"the {prefix} state has an entry {index!r:.40} that is not one of the "
                                  f"{len(params)} parameters' indices")
        param, pname = params[pid]
        g = group_of[pid]
        at = (g, param.dim() > 1, param.dtype, param.device)
        if at not in layouts:
            layouts[at] = _state_layout(optimizer, groups[g], param)
        layout = layouts[at]
        if layout is not None and set(entries) != set(layout):
            missing, extra = sorted(set(layout) - set(entries)), sorted(set(entries) - set(layout))
            raise origin.mismatch(
                f"the {prefix} state of parameter {pid} ({pname}) holds {sorted(entries)!r:.120}, but {cls} with "
                f"param_groups[{g}]'s settings keeps {sorted(layout)!r:.120}"
                + (f" (missing {missing!r:.80})" if missing else "")
                + (f" (not its own: {extra!r:.80})" if extra else ""))
        state[pid] = {name: _state_value(origin, prefix, pid, name, value, tensors, param, pname,
                                         None if layout is None else layout[name])
                      for name, value in entries.items()}
    result: dict[str, Any] = {"state": state, "param_groups": groups}
    extra = meta.get("extra", {})
    if not isinstance(extra, dict):
        raise origin.damaged(f"the {prefix} metadata's 'extra' is not a dict")
    result.update({k: _decode(origin, v, tensors, f"{prefix} {k!r}") for k, v in extra.items()})
    if _KERAS_KEY in result:
        _keras_state(origin, prefix, result[_KERAS_KEY], in_order)
    return result


def _keras_state(origin: Origin, prefix: str, value: Any, params: Sequence[tuple[Tensor, str]]) -> None:
    """mr.optimizers' own state: {"iterations": the step count, "accumulators": this replica's gradient
    sums (None where a parameter has none), "averages": the moving averages, "replica_accumulators":
    every replica's accumulators (their count is the saved run's replica count)}."""
    key = f"'{prefix}/{_KERAS_KEY}'"  # as the file names its tensors
    if not isinstance(value, dict) or not set(value) <= {"iterations", "accumulators", "averages",
                                                         "replica_accumulators"}:
        raise origin.damaged(f"{key} is {value!r:.80}, not mr.optimizers' state (iterations, accumulators, "
                             "averages)")
    steps = value.get("iterations", 0)
    if not _is_count(steps) or steps >= 1 << 63:
        raise origin.damaged(f"{key}['iterations'] is {steps!r:.40}, not a step count (a whole number >= 0)")
    _like_params(origin, f"{key}['accumulators']", value.get("accumulators"), params, holes=True)
    _like_params(origin, f"{key}['averages']", value.get("averages"), params, holes=False)
    replicas = value.get("replica_accumulators")
    if replicas is not None:
        if not isinstance(replicas, list) or not replicas:
            raise origin.damaged(f"{key}['replica_accumulators'] is {replicas!r:.60}, not a list with one entry "
                                 "per replica")
        for r, per_replica in enumerate(replicas):
            _like_params(origin, f"{key}['replica_accumulators'][{r}]", per_replica, params, holes=True)


def _like_params(origin: Origin, key: str, values: Any, params: Sequence[tuple[Tensor, str]], holes: bool) -> None:
    """None, or one floating tensor per parameter shaped like it (`holes`: None for a parameter is allowed)."""
    if values is None:
        return
    if not isinstance(values, list) or len(values) != len(params):
        count = f"a list of {len(values)}" if isinstance(values, list) else f"{values!r:.60}"
        raise origin.mismatch(f"{key} is {count}, but the optimizer has {len(params)} parameters")
    for i, (v, (param, pname)) in enumerate(zip(values, params)):
        if v is None and holes:
            continue
        if not isinstance(v, Tensor):
            raise origin.damaged(f"{key}[{i}] is {v!r:.60}, not a tensor")
        if tuple(v.shape) != tuple(param.shape):
            raise origin.mismatch(f"{key}[{i}] has shape {tuple(v.shape)} in the file but {pname} has shape "
                                  f"{tuple(param.shape)}")
        if v.is_floating_point() != param.is_floating_point():
            raise origin.mismatch(f"{key}[{i}] has dtype {v.dtype} in the file but {pname} is {param.dtype}")


def _group(origin: Origin, key: str, saved: dict, live: dict, tensors: Mapping[str, Tensor],
           optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    cls = type(optimizer).__name__
    # Settings scale the parameters' own dtype in the update: 1e308 is finite but not in float32.
    dtype = next((p.dtype for p in live["params"] if p.is_floating_point()), torch.float32)
    limit = torch.finfo(dtype).max
    group: dict[str, Any] = {}
    for name, raw in saved.items():
        if name == "params":
            group[name] = raw
            continue
        value = _decode(origin, raw, tensors, f"{key}[{name!r}]")
        if name not in live and name not in _SCHEDULER_KEYS:  # (set by lr schedulers / torch)
            raise origin.mismatch(f"{key} has the setting {name!r}, which {cls} does not have: the state "
                                  f"was saved from another optimizer")
        like = live.get(name, 0.0 if name in _SCHEDULER_KEYS and name != "param_names" else value)
        # (An int setting reaches torch's kernels as a 64-bit integer: 2**70 fits a float32, not them.)
        if _number(value) is not None and (not abs(_number(value)) <= limit
                                           or isinstance(value, int) and not -(1 << 63) <= value < 1 << 63):
            raise origin.damaged(f"{key}[{name!r}] is {value!r:.40}, not a finite number the parameters' "
                                 f"{dtype} can hold")
        if not _same_kind(value, like):
            raise origin.mismatch(f"{key}[{name!r}] is {value!r:.60} in the file but {like!r:.60} in the "
                                  f"{cls} optimizer, a value of another kind")
        if name in ("lr", *_SCHEDULER_KEYS) and _number(value) is not None and not _number(value) >= 0:
            raise origin.damaged(f"{key}[{name!r}] is {value!r}, not a learning rate >= 0")
        group[name] = value
    missing = [n for n in optimizer.defaults if n not in saved]
    if missing:
        raise origin.mismatch(f"{key} lacks the {cls} setting(s) {missing}: the state was saved from "
                              f"another optimizer")
    return group


def _state_layout(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], param: Tensor) -> dict[str, bool] | None:
    """The state `optimizer`'s class keeps for a parameter like `param` under `group`'s settings (what
    load_state_dict will use): {entry name: whether it is a scalar (Adam's step) rather than shaped
    like the parameter}, learnt from one step of a fresh optimizer (mr.optimizers': of the torch class
    they build on) on a small stand-in parameter of the same dtype, device and rank kind. None where
    that cannot be done (a class with another constructor, a closure-driven one such as LBFGS): then
    only the shapes are checked."""
    if not param.is_floating_point():
        return None
    try:
        settings = {k: group[k] for k in optimizer.defaults if k in group}
        stand_in = torch.zeros((2, 3) if param.dim() > 1 else (3,), dtype=param.dtype, device=param.device,
                               requires_grad=True)
        stand_in.grad = torch.full_like(stand_in, 1e-3)
        cls = type(optimizer)
        if cls.__module__.startswith("mirrored."):  # mr.optimizers' recipes keep torch's per-parameter state
            cls = next(c for c in cls.__mro__ if c.__module__.startswith("torch.optim"))
        probe = cls([stand_in], **settings)
        probe.step()
        kept = probe.state.get(stand_in, {})
    except Exception:  # noqa: BLE001 - any failure only means the layout is unknown
        return None
    return {name: not isinstance(v, Tensor) or v.dim() == 0 for name, v in kept.items()}


def _state_value(origin: Origin, prefix: str, pid: int, name: str, value: Any, tensors: Mapping[str, Tensor],
                 param: Tensor, pname: str, scalar: bool | None = None) -> Any:
    """One state entry, decoded and checked: a scalar where the optimizer keeps one (`scalar`), else a
    tensor shaped like its parameter (`scalar` None: the optimizer's layout is unknown, and a scalar
    tensor passes)."""
    where = f"{prefix} state {name!r} of parameter {pid} ({pname}, shape {tuple(param.shape)})"
    value = _decode(origin, value, tensors, where)
    if scalar and isinstance(value, Tensor) and value.dim() != 0:
        raise origin.mismatch(f"tensor '{prefix}/state/{pid}/{name}' has shape {tuple(value.shape)} in the file, "
                              f"but the optimizer keeps a scalar there (one number, as Adam's step), shape ()")
    if scalar is False and not (isinstance(value, Tensor) and (value.dim() != 0 or param.dim() == 0)):
        raise origin.mismatch(f"{where} is {value!r:.60} in the file, but the optimizer keeps a tensor shaped "
                              f"like {pname}, {tuple(param.shape)}")
    if isinstance(value, Tensor):
        shape = tuple(value.shape)
        expected = _FACTORED_SHAPES[name](tuple(param.shape)) if (
            name in _FACTORED_SHAPES and param.dim() > 1) else tuple(param.shape)
        if value.dim() != 0 and shape != expected:
            raise origin.mismatch(f"tensor '{prefix}/state/{pid}/{name}' has shape {shape} in the file but "
                                  f"{pname} has shape {expected}")
        if value.dim() != 0 and value.is_floating_point() != param.is_floating_point():
            raise origin.mismatch(f"tensor '{prefix}/state/{pid}/{name}' has dtype {value.dtype} in the "
                                  f"file but {pname} is {param.dtype}")
        return value
    if not (value is None or isinstance(value, (bool, int, float))) or (
            isinstance(value, int) and not -(1 << 63) <= value < 1 << 63):
        raise origin.damaged(f"{where} is {value!r:.60}; optimizer state holds tensors and numbers (64-bit)")
    return value


def _decode(origin: Origin, value: Any, tensors: Mapping[str, Tensor], where: str) -> Any:
    """checkpoint.decode_value, its errors naming the file."""
    return checkpoint.decode_value(value, tensors, where, origin.damaged)


def _kind(value: Any) -> Any:
    if value is None or isinstance(value, bool):  # flags: torch writes foreach=None, fused=None or a bool
        return "flag"
    if isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.numel() == 1):
        return "number"
    if isinstance(value, (tuple, list)):
        return "sequence"
    return type(value).__name__


def _same_kind(saved: Any, live: Any, inside: bool = False) -> bool:
    """Equal kinds, elementwise for sequences of one length; numbers must be finite. Inside a sequence
    None stands for a number too (Adafactor's eps=(None, 1e-3) means "use the default")."""
    if inside and (saved is None or live is None):
        return True
    if _kind(saved) != _kind(live):
        return False
    if _kind(saved) == "number":
        return math.isfinite(_number(saved))
    if isinstance(saved, (tuple, list)):
        return len(saved) == len(live) and all(_same_kind(a, b, True) for a, b in zip(saved, live))
    return True


def _number(value: Any) -> float | None:
    if isinstance(value, Tensor):
        return float(value) if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# --------------------------------------------------------------------------------------------
# RNG state and the JSON fields


def rng_state(origin: Origin, tensors: Mapping[str, Tensor], meta: Any, prefix: str = "rng") -> None:
    """Sets each saved state on a fresh generator (torch, Python, numpy), which checks exactly what
    checkpoint.restore_rng_state() will, without touching the global ones. `tensors` are the file's
    under `prefix` (prefix removed)."""
    if not isinstance(meta, dict) or "python" not in meta or "numpy" not in meta or "torch_cpu" not in tensors:
        raise origin.damaged(f"the RNG state {prefix!r} is incomplete (it needs 'python', 'numpy' and the tensor "
                             f"'{prefix}/torch_cpu')")
    cpu = tensors["torch_cpu"]
    if cpu.dtype != torch.uint8 or cpu.dim() != 1:
        raise origin.damaged(f"tensor '{prefix}/torch_cpu' is {cpu.dtype} of shape {tuple(cpu.shape)}, not a "
                             "generator state (1-D uint8)")
    try:
        torch.Generator().set_state(cpu)
        version, internal, gauss_next = meta["python"]
        if not isinstance(internal, list) or not (gauss_next is None or isinstance(gauss_next, float)):
            raise TypeError("not (version, list, float or None)")
        random.Random().setstate((version, tuple(internal), gauss_next))
        kind, keys, pos, has_gauss, cached = meta["numpy"]
        if not isinstance(keys, list) or not all(isinstance(k, int) and 0 <= k < 1 << 32 for k in keys):
            raise TypeError("keys are not a list of 32-bit whole numbers")
        np.random.RandomState().set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    except Exception as e:  # noqa: BLE001 - whatever a fresh generator refuses (numpy: IndexError for short keys)
        raise origin.damaged(f"the RNG state {prefix!r} cannot be restored ({type(e).__name__}: "
                             f"{str(e)[:160]})") from None
    saved = meta.get("cuda_devices", 0)
    if not _is_count(saved) or saved > _MAX_CUDA_DEVICES:
        raise origin.damaged(f"the RNG state's cuda_devices is {saved!r:.40}, not a device count")
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(min(saved, present)):
        t = tensors.get(f"cuda/{i}")
        if t is None or t.dtype != torch.uint8 or tuple(t.shape) != tuple(torch.cuda.get_rng_state(i).shape):
            raise origin.damaged(f"the CUDA RNG state of device {i} (tensor '{prefix}/cuda/{i}') is missing or "
                                 "not a generator state")


def model_metadata(origin: Origin, meta: Mapping[str, Any]) -> None:
    """The fields of a Model file (saved replicas and compile settings) are of the kinds save() writes."""
    replicas = meta.get("replicas", 1)
    if not _is_count(replicas) or replicas < 1:
        raise origin.damaged(f"'replicas' is {replicas!r:.40}, not a replica count")
    cfg = meta.get("compile")
    if cfg is None:
        return
    if not isinstance(cfg, dict):
        raise origin.damaged(f"the compile settings are {cfg!r:.60}, not a dict")
    opt = cfg.get("optimizer")
    if not (_is_config(opt) or _is_object_note(opt) or (isinstance(opt, dict) and isinstance(opt.get("name"), str))):
        raise origin.damaged(f"the compiled optimizer is {opt!r:.60}, neither a config {{'class_name': ..., "
                             "'config': {...}} nor an object's note")
    options = opt.get("config", opt) if isinstance(opt, dict) else {}
    lr = options.get("learning_rate")
    if lr is not None and not _is_config(lr) and (_number(lr) is None or not math.isfinite(lr) or lr < 0):
        raise origin.damaged(f"the optimizer's learning_rate is {lr!r:.40}, not a number >= 0 or a schedule")
    loss = cfg.get("loss")
    if not _per_output(loss, _is_recorded, lists=False):
        raise origin.damaged(f"the compiled loss is {loss!r:.60}, neither a name, a config nor an object's note (or a "
                             "dict or list of them, one per output)")
    weights = cfg.get("loss_weights")
    if not _per_output(weights, lambda w: _number(w) is not None, lists=False):
        raise origin.damaged(f"the compiled loss_weights are {weights!r:.60}, not a number or numbers per output")
    for key in ("metrics", "weighted_metrics"):
        metrics = cfg.get(key, [])
        if not (metrics is None or (isinstance(metrics, (list, dict)) and _per_output(metrics, _is_recorded,
                                                                                      lists=True))):
            raise origin.damaged(f"the compiled {key} are {metrics!r:.60}, not a list of names and configs (or such "
                                 "lists per output)")
    if cfg.get("precision") not in _PRECISIONS:
        raise origin.damaged(f"the compiled precision is {cfg.get('precision')!r:.40}, not one of {_PRECISIONS}")


def _is_recorded(value: Any) -> bool:
    """One loss or metric as compile() records it: a name, a config, or an object's note."""
    return isinstance(value, str) or _is_object_note(value) or _is_config(value)


def _per_output(value: Any, leaf: Any, lists: bool, depth: int = 0) -> bool:
    """None, a leaf, or a dict / list of them (one per output); with lists, each entry may be a list of
    leaves too (an output's metrics)."""
    if value is None or leaf(value):
        return True
    if depth >= (2 if lists else 1):
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _per_output(v, leaf, lists, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_per_output(v, leaf, lists, depth + 1) for v in value)
    return False


def _is_config(value: Any) -> bool:
    """{"class_name": str, "config": dict}, as serialize() writes a loss, metric, optimizer or schedule."""
    return (isinstance(value, dict) and set(value) == {"class_name", "config"} and isinstance(value["class_name"], str)
            and isinstance(value["config"], dict))


def _is_object_note(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"object"} and isinstance(value["object"], str)


def epoch_state(origin: Origin, key: str, state: Any, like: Mapping[str, Any], steps_per_epoch: int | None,
                continuing: bool, batches_per_pass: int | None, max_learning_rate: float | None = None) -> None:
    """A saved EpochIterator.get_state() (fit's place: epoch, step, data position, learning rate) fits the
    EpochIterator whose get_state() is `like`: its data position has the structure of this run's input
    pipeline and lies within its epochs and passes, and its rate can be set on this run's optimizer.
    `continuing`: epochs continue one pass of the data (steps_per_epoch given), else each is a pass."""
    if not isinstance(state, dict) or not {"epoch", "step", "data"} <= set(state) or not set(state) <= {
            "epoch", "step", "data", "learning_rate"}:
        raise origin.damaged(f"{key!r} is {state!r:.120}, not fit's state {{'epoch', 'step', 'data', "
                             "'learning_rate'}")
    for field in ("epoch", "step"):
        if not _is_count(state[field]) or state[field] >= 1 << 63:
            raise origin.damaged(f"'{key}.{field}' is {state[field]!r:.40}, not a whole number >= 0")
    # (An epoch that is a pass, whose position is kept in examples, may have counted more, smaller batches: a
    # global batch that changed with the replica count. The restore reads past the examples instead.)
    in_examples = not continuing and isinstance(state["data"], dict) and "examples" in state["data"]
    if steps_per_epoch is not None and state["step"] > steps_per_epoch and not in_examples:
        raise origin.mismatch(f"'{key}.step' is {state['step']}, past this fit's {steps_per_epoch} steps per epoch: "
                              "it was saved from a fit with other data or another steps_per_epoch")
    lr = state.get("learning_rate")
    if lr is not None and (_number(lr) is None or not math.isfinite(lr) or lr < 0):
        raise origin.damaged(f"'{key}.learning_rate' is {lr!r:.40}, not a learning rate >= 0")
    if lr is not None and max_learning_rate is not None and lr > max_learning_rate:
        # (torch's kernels take the rate in the parameters' dtype: 3.41e38 overflowed float32 in the first step)
        raise origin.damaged(f"'{key}.learning_rate' is {lr!r:.40}, more than the parameters' dtype holds "
                             f"({max_learning_rate:.6g})")
    if lr is not None and like.get("learning_rate") is None:
        raise origin.mismatch(f"'{key}.learning_rate' is {lr!r}, but this fit's optimizer takes its rate from a "
                              "schedule, which cannot be set: it was saved from a fit with another optimizer")
    _like(origin, f"{key}.data", state["data"], _as_saved(state["data"], like["data"]), 0)
    drawn = state["data"]["drawn"] if isinstance(state["data"], dict) else None
    if not _is_count(drawn):
        return  # like["data"] had no count there either: a dataset that is not resumable
    examples = state["data"].get("examples", drawn)
    if not (examples >= drawn and (examples == 0) == (drawn == 0)):  # (every batch handed out holds examples)
        raise origin.damaged(f"'{key}.data.examples' is {examples}, which {drawn} batches cannot hold")
    if batches_per_pass is not None and drawn > batches_per_pass and "examples" not in state["data"]:
        raise origin.mismatch(f"'{key}.data.drawn' is {drawn} batches into a pass of the data, but this fit's data "
                              f"has {batches_per_pass} batches a pass: it was saved from a fit with other data")
    # A pass spans the epochs since it began (continuing) or is the epoch's own: it cannot be further
    # along than the steps counted. (Resuming replays `drawn` batches; a forged count must not mean hours.)
    most = state["epoch"] * steps_per_epoch + state["step"] if continuing and steps_per_epoch else state["step"]
    if drawn > most:
        raise origin.damaged(f"'{key}.data.drawn' is {drawn} batches into the pass, more than the {most} steps "
                             f"done by epoch {state['epoch']}, step {state['step']}")


def object_state(origin: Origin, key: str, state: Any, like: Any, strict: bool) -> None:
    """A saved get_state() fits the object whose get_state() is now `like`. `strict` (mirrored's own objects:
    datasets, distributed iterators, whose states are fixed by their pipelines) compares the whole
    structure; otherwise (a user's object, whose state may grow) the outline: the same JSON kind and,
    for a dict, the same keys."""
    if strict:
        _like(origin, key, state, _as_saved(state, like), 0)
        return
    if _kind(state) != _kind(like) or (isinstance(like, dict) and set(state) != set(like)):
        raise origin.mismatch(f"the saved state {key!r} is {state!r:.120} but the object's get_state() is "
                              f"{like!r:.120}: it was saved from another kind of object")


def _as_saved(state: Any, like: Any) -> Any:
    """A distributed iterator's state `like`, without "examples" where the saved `state` (of a version that
    counted the position in batches only) has none."""
    if isinstance(like, dict) and isinstance(state, dict) and "drawn" in like and "examples" not in state:
        return {k: v for k, v in like.items() if k != "examples"}
    return like


def is_count(value: Any) -> bool:
    """A whole number >= 0 (not a bool), as JSON holds counts."""
    return _is_count(value)


def _like(origin: Origin, key: str, value: Any, like: Any, depth: int) -> None:
    """`value` has the structure of `like`: the same keys, list lengths and leaf kinds, equal strings."""
    if depth > _MAX_DEPTH:
        raise origin.damaged(f"{key!r} is nested too deeply")
    if isinstance(like, dict):
        if not isinstance(value, dict) or set(value) != set(like):
            raise origin.mismatch(f"the saved data position {key!r} is {value!r:.120} but this run's "
                                  f"dataset has {like!r:.120}: it was saved with another input pipeline")
        for k in like:
            _like(origin, f"{key}.{k}", value[k], like[k], depth + 1)
    elif isinstance(like, list):
        if not isinstance(value, list) or len(value) != len(like):
            raise origin.mismatch(f"the saved data position {key!r} is {value!r:.120} but this run's "
                                  f"dataset has {like!r:.120}: it was saved with another input pipeline")
        for i, (v, w) in enumerate(zip(value, like)):
            _like(origin, f"{key}[{i}]", v, w, depth + 1)
    elif isinstance(like, str):
        if value != like:
            raise origin.mismatch(f"the saved data position {key!r} is {value!r:.60} but this run's dataset "
                                  f"has {like!r:.60}: it was saved with another input pipeline")
    elif isinstance(like, int) and not isinstance(like, bool):  # a seed (torch's are 64-bit unsigned), or a count
        if (not isinstance(value, int) or isinstance(value, bool) or not -(1 << 63) <= value < 1 << 64
                or (key.endswith(("epoch", "drawn")) and value < 0)):
            raise origin.damaged(f"the saved data position {key!r} is {value!r:.60}, where a whole number "
                                 f"like {like!r:.40} belongs")
    elif _kind(value) != _kind(like) or (isinstance(value, float) and not math.isfinite(value)):
        raise origin.damaged(f"the saved data position {key!r} is {value!r:.60}, where a value like "
                             f"{like!r:.40} belongs")


def loss_scale(origin: Origin, state: Any) -> dict[str, Any]:
    """A GradScaler's state_dict as save() records it: numbers of the right kinds (an empty dict for a
    disabled scaler)."""
    fields = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
              "_growth_tracker": int}
    if not isinstance(state, dict) or not set(state) <= set(fields):
        raise origin.damaged(f"the loss scale is {state!r:.80}, not a GradScaler's state")
    for key, value in state.items():
        number = _number(value)
        if number is None or not math.isfinite(number) or number < 0 or (fields[key] is int and not _is_count(value)):
            raise origin.damaged(f"the loss scale's {key!r} is {value!r:.40}, not a finite number >= 0")
    return state
