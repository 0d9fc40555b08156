"""Model.save / save_weights / load_weights / load: one safetensors file through the trackable kinds
of mr.train's checkpoints (_trackables.py), so a Model's file and a Checkpoint of the Model hold its
state the same way: "model/<key>" for the module's state_dict, "model.optimizer/..." for every
replica's optimizer state, "model.loss_scale" (fp16), "model.random" (the replicas' generators).
Beside them the file records what rebuilds the model: the mr.models architecture, the compile
settings, the replica count. Files of the first format (optimizer state under "optimizer/...") are
read by the same kinds once their names are moved. Never unpickles. Uses checkpoint.py,
checkpoint_checks.py, tracking.py, _trackables.py, losses.py, metrics.py and optimizers.py.
"""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mirrored.training import _trackables, checkpoint, checkpoint_checks, compile_utils, losses
from mirrored.training import metrics as metrics_lib, optimizers, tracking

logger = logging.getLogger(__name__)

FORMAT = "mirrored.Model/2"
_FIRST_FORMAT = "mirrored.Model/1"  # optimizer state under "optimizer/", its settings in meta["optimizer"]
_ROOT = "model"


def save(model: Any, path: str | Path, with_optimizer: bool) -> None:
    """Writes `model`'s file (by the chief only, under a multi-worker strategy): its weights, and with
    `with_optimizer` everything a resumed fit needs (optimizer, fp16 loss scale, random state, compile
    settings)."""
    found = (list(_trackables.entries(_ROOT, model)) if with_optimizer
             else [(_ROOT, _trackables.kind_of(model.module), model.module)])
    tensors, objects = tracking.collect(found)
    meta: dict[str, Any] = {"format": FORMAT, "replicas": model.distribute_strategy.num_replicas_in_sync,
                            "model_config": getattr(model.module, "_mirrored_config", None), "objects": objects}
    if with_optimizer and model.mirrored_optimizer is not None:
        meta["compile"] = model._compile_config
    checkpoint.save_checkpoint(path, tensors, meta, where="Model.save" if with_optimizer else "Model.save_weights")


def _read(path: str | Path, where: str) -> tuple[dict[str, Tensor], dict[str, Any], checkpoint_checks.Origin]:
    """A Model file's tensors and metadata (in this format: a first-format file's are moved), checked."""
    tensors, meta = checkpoint.load_checkpoint(path, where=where)
    origin = checkpoint_checks.Origin(f"{where}({str(path)!r})")
    if meta.get("format") == _FIRST_FORMAT:
        tensors, meta = _from_first_format(tensors, meta)
    if meta.get("format") != FORMAT:
        raise checkpoint.CheckpointError(f"{origin.where}: not a mirrored Model file (format "
                                         f"{meta.get('format')!r:.60}).")
    if not isinstance(meta.get("objects"), dict):
        raise origin.damaged(f"its 'objects' are {meta.get('objects')!r:.60}, not a dict of entries")
    checkpoint_checks.model_metadata(origin, meta)
    return tensors, meta, origin


def _from_first_format(tensors: dict[str, Tensor], meta: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A first-format file as this format holds it: the optimizer's tensors under "model.optimizer/", and
    entries for the module, the optimizer and the fp16 loss scale."""
    moved = {(f"{_ROOT}.optimizer/{name[len('optimizer/'):]}" if name.startswith("optimizer/") else name): t
             for name, t in tensors.items()}
    objects: dict[str, Any] = {_ROOT: {"kind": "module"}}
    if "optimizer" in meta:
        objects[f"{_ROOT}.optimizer"] = {"kind": "optimizer", "state": meta["optimizer"]}
    if meta.get("loss_scale") is not None:
        objects[f"{_ROOT}.loss_scale"] = {"kind": "state", "state": meta["loss_scale"]}
    rest = {k: v for k, v in meta.items() if k not in ("optimizer", "loss_scale")}
    return moved, {**rest, "format": FORMAT, "objects": objects}


def check_overwrite(path: str | Path, overwrite: bool, where: str) -> None:
    """Keras's overwrite=False: an existing file is not replaced (Keras asks at a prompt; a library refuses)."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"{where}: overwrite={overwrite!r}; give True or False.")
    if not overwrite and os.path.exists(path):
        raise FileExistsError(f"{where}: {str(path)!r} exists and overwrite=False, so nothing was written. Pass "
                              "overwrite=True (the default) to replace it, or another path.")


def load_weights(model: Any, path: str | Path, skip_mismatch: bool = False) -> None:
    """Loads the weights of a Model file (saved on any number of replicas) into every replica; every
    tensor's name, shape and dtype is checked first (CheckpointError naming the file otherwise). With
    skip_mismatch, the tensors that do not fit (another shape or kind of dtype, or a name only one side
    has) are skipped with one warning, and the others load, as Keras's skip_mismatch."""
    state = checkpoint.load_state_dict(path, where="Model.load_weights")
    origin = checkpoint_checks.Origin(f"Model.load_weights({str(path)!r})")
    expected = model.module.state_dict()
    if not skip_mismatch:
        model._net.load_state_dict(checkpoint_checks.state_dict(origin, state, expected, prefix=""))
        return
    fits, skipped = {}, []
    for name, t in state.items():
        ref = expected.get(name)
        if not isinstance(ref, torch.Tensor):
            skipped.append(f"{name!r} (not in the model)")
        elif tuple(t.shape) != tuple(ref.shape):
            skipped.append(f"{name!r} (shape {tuple(t.shape)} in the file, {tuple(ref.shape)} in the model)")
        elif t.dtype != ref.dtype and not (t.dtype.is_floating_point and ref.dtype.is_floating_point):
            skipped.append(f"{name!r} (dtype {t.dtype} in the file, {ref.dtype} in the model)")
        else:
            fits[name] = t
    missing = [name for name, ref in expected.items() if isinstance(ref, torch.Tensor) and name not in state]
    skipped += [f"{name!r} (not in the file: kept as it is)" for name in missing]
    if skipped:
        warnings.warn(f"Model.load_weights({str(path)!r}, skip_mismatch=True): skipped {len(skipped)} tensor(s) that "
                      f"do not fit: {', '.join(skipped[:8])}{' ...' if len(skipped) > 8 else ''}. The other "
                      f"{len(fits)} loaded.", UserWarning, stacklevel=3)
    model._net.load_state_dict(checkpoint_checks.state_dict(origin, fits, {k: expected[k] for k in fits}, prefix=""),
                               strict=False)


def load(cls: type, path: str | Path, module: Any, compile: bool) -> Any:
    """Model.load: the model of a Model file, built (from mr.models' record or `module`), and with
    `compile` compiled and restored as it was saved."""
    tensors, meta, origin = _read(path, "Model.load")
    if module is None:  # the architecture is checked before it is built
        config = meta.get("model_config")
        if not config:
            raise checkpoint.CheckpointError(
                f"Model.load({str(path)!r}): the file does not record how to build the module (it was not "
                "made by mr.models). Pass module=YourNet(...) to load the weights into.")
        module = checkpoint_checks.build_module(origin, config, tensors)
    state = checkpoint_checks.state_dict(origin, tensors, module.state_dict())
    model = cls(module)
    model._net.load_state_dict(state)
    cfg = meta.get("compile")
    if not (compile and cfg):
        return model
    try:
        _compile_from_config(model, cfg, str(path))
    except checkpoint.CheckpointError:
        raise
    except (TypeError, KeyError, ValueError) as e:  # settings from the file: damaged, or another version's
        raise checkpoint.CheckpointError(
            f"Model.load({str(path)!r}): cannot compile with the settings the file records ({e}). Load "
            "with compile=False and compile(...) yourself; the weights load either way.") from e
    objects = meta["objects"]
    # (a first-format file holds no random state: the model keeps its strategy's)
    found = [entry for entry in _trackables.entries(_ROOT, model) if entry[0] in objects or entry[0] == _ROOT]
    restores, _, _ = tracking.check_entries(found, tensors, objects, origin, complete=True, reader="Model.load")
    tracking.apply_restores(restores, origin)
    groups = model.mirrored_optimizer.replicas[0].param_groups
    if groups and model.optimizer._schedule is None:
        # The saved rate, which a callback may have changed (LearningRateScheduler, ReduceLROnPlateau),
        # is in the torch optimizer's groups; callbacks read and write it through the recipe.
        model.optimizer.learning_rate = groups[0]["lr"]
    return model


def _compile_from_config(model: Any, cfg: dict[str, Any], path: str) -> None:
    """compile() as save() recorded it: names, and configs rebuilt from mirrored's own classes by name;
    a loss or metric argument per output as it was given (a dict keyed by output, or a list)."""
    def loss_of(leaf: Any) -> Any:
        if isinstance(leaf, dict) and "object" in leaf:  # training with another loss would be wrong
            raise ValueError(
                f"Model.load({path!r}): the model was compiled with the loss {leaf['object']}, an object without a "
                "config (a class or function of your own), so the file cannot rebuild it. Load with compile=False "
                "and call model.compile(...) with it again; the weights load either way.")
        return losses.deserialize(leaf) if isinstance(leaf, dict) else leaf

    dropped: list[str] = []

    def metric_of(leaf: Any) -> Any:
        if isinstance(leaf, dict) and "object" in leaf:
            dropped.append(leaf["object"])
            return None
        return metrics_lib.deserialize(leaf) if isinstance(leaf, dict) else leaf

    def metrics_from(recorded: Any) -> Any:
        rebuilt = compile_utils.from_config(recorded, metric_of)
        if isinstance(rebuilt, list) and not any(isinstance(m, (list, dict)) for m in rebuilt):
            rebuilt = [m for m in rebuilt if m is not None]  # (one output's list: a dropped one leaves no gap)
        return rebuilt

    loss = compile_utils.from_config(cfg.get("loss"), loss_of)
    metrics = metrics_from(cfg.get("metrics") or [])
    weighted = metrics_from(cfg.get("weighted_metrics"))
    if dropped:
        warnings.warn(f"Model.load({path!r}): the metrics {', '.join(dropped)} were objects without a config "
                      "(classes or functions of your own); the model is compiled without them. Load with "
                      "compile=False and compile(...) again to have them.", UserWarning, stacklevel=4)
    model.compile(optimizer=_optimizer_from_config(cfg["optimizer"], path), loss=loss,
                  loss_weights=cfg.get("loss_weights"), metrics=metrics, weighted_metrics=weighted,
                  precision=cfg.get("precision"), jit_compile=cfg.get("jit_compile", False),
                  auto_scale_loss=cfg.get("auto_scale_loss", True), memory_format=cfg.get("memory_format", "auto"))


def _optimizer_from_config(cfg: dict[str, Any], path: str) -> optimizers.Optimizer:
    if "class_name" in cfg:
        return optimizers.deserialize(cfg)
    # A file of the first format may hold a torch.optim class's name (ours are named after theirs: SGD,
    # Adam, AdamW, RMSprop) and its torch arguments; never a pickle.
    name = cfg.get("name")
    torch_cls = getattr(torch.optim, str(name), None) if "object" not in cfg else None
    if not (isinstance(torch_cls, type) and issubclass(torch_cls, torch.optim.Optimizer)):
        raise ValueError(f"Model.load({path!r}): the model was compiled with the optimizer {cfg.get('object', name)}, "
                         "which load cannot rebuild (not one of mirrored's or torch.optim's). Load with compile=False "
                         "and compile(...) again; the weights load either way.")
    cfg = {k: v for k, v in cfg.items() if k != "name"}
    return optimizers.Optimizer(torch_cls, cfg.pop("learning_rate"), str(name), **cfg)
