"""What mr.Model does to the data users hand it, before and inside a step: arrays, lists and datasets
into a dataset of GLOBAL batches (as_dataset), a batch into (x, y, sample_weight)
(unpack_x_y_sample_weight, Keras's name), floating-point inputs into the module's dtype and integer
labels into int64, sample weights shaped like the per-example losses; and the checks that refuse a
pass that could never end or holds nothing. A module receives exactly what the data yields: nothing
here guesses a layout from a shape. Uses torch, numpy, the public names of mirrored.distribute and
mirrored.data, and epochs.py.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

import mirrored.distribute as md
from mirrored.training import epochs as epochs_lib

logger = logging.getLogger(__name__)

INFINITE = -1  # mr.data's INFINITE_CARDINALITY


def unpack_x_y_sample_weight(data: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) from a dataset element, as keras.utils.unpack_x_y_sample_weight (and a
    TFDS feature dict's "image" and "label")."""
    if isinstance(data, (tuple, list)):
        if len(data) == 1:
            return data[0], None, None
        if len(data) == 2:
            return data[0], data[1], None
        if len(data) == 3:
            return data[0], data[1], data[2]
        raise ValueError(f"a dataset element has {len(data)} parts; expected (x,), (x, y) or (x, y, sample_weight).")
    if isinstance(data, dict) and "image" in data and "label" in data:
        return data["image"], data["label"], None
    return data, None, None


def as_array(value: Any, where: str, arg: str) -> Any:
    """Array data as the user gives it: a numpy array or tensor as is; a (nested) list or tuple of
    numbers becomes a numpy array (anything else is a dataset, or None)."""
    if not isinstance(value, (list, tuple)) or not _numbers(value):
        return value
    try:
        return np.asarray(value)
    except ValueError as e:  # a ragged list
        raise ValueError(f"Model.{where}: {arg} is a list of numbers but not a rectangular array ({e}). Give "
                         "one row per example, all of the same shape.") from None


def _numbers(value: Any) -> bool:
    """Whether a list or tuple holds numbers (down its first elements), not batches or arrays."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return isinstance(value, (bool, int, float, np.number))


def as_input(value: Any, device: torch.device) -> Any:
    """One input of model(x): an array as a tensor on the module's device."""
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value, device=device)
    return value.to(device) if isinstance(value, Tensor) else value


def device_of(module: Any) -> torch.device:
    """The device of a module's first parameter or buffer (the CPU for a module without any)."""
    t = _first_tensor(module, floating=False)
    return t.device if t is not None else torch.device("cpu")


def module_dtype(net: Any) -> torch.dtype | None:
    """The dtype of the module's floating-point parameters (its buffers' without any)."""
    t = _first_tensor(net, floating=True)
    return t.dtype if t is not None else None


def _first_tensor(module: Any, floating: bool) -> Tensor | None:
    """The first of module.parameters() (of its floating-point ones, if `floating`), else of its
    buffers(), or None. A step asks three times: read from torch's dicts, depth first, stopping at the
    first found (module.parameters() builds a generator and a name string per module on the way)."""
    if isinstance(module, md.MirroredModule):
        module = module.module  # (the calling replica's copy, as its parameters() reads)
    if not isinstance(module, torch.nn.Module):  # (anything else with parameters() and buffers())
        return next((t for t in itertools.chain(module.parameters(), module.buffers())
                     if not floating or t.is_floating_point()), None)
    for kind in ("_parameters", "_buffers"):
        seen: set[int] = set()
        stack = [module]
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            for t in getattr(m, kind).values():
                if t is not None and (not floating or t.is_floating_point()):
                    return t
            stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return None


def cast_inputs(x: Any, dtype: torch.dtype | None) -> Any:
    """Floating-point inputs in the module's dtype, as Keras casts inputs to floatx: float64 numpy data
    meets a float32 module, and a float64 module keeps float64. Nothing else changes: integer inputs
    (token ids, uint8 images) stay, and the layout is the module's business (it is never guessed)."""
    if dtype is None:
        return x
    return md.map_structure(
        lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype else t, x)


def as_labels(y: Any) -> Any:
    """Integer labels as int64, which torch's losses and metrics take (numpy's int32 labels too)."""
    if isinstance(y, Tensor) and not (y.is_floating_point() or y.is_complex()) and y.dtype not in (torch.int64,
                                                                                                    torch.bool):
        return y.long()
    return y


def weights_like(sw: Any, per_example: Tensor) -> Any:
    """Sample weights shaped like the per-example losses: (B, 1) is squeezed to (B,), as Keras does."""
    if sw is None:
        return None
    while isinstance(sw, Tensor) and sw.dim() > per_example.dim() and sw.shape[-1] == 1:
        sw = sw.squeeze(-1)
    if isinstance(sw, Tensor) and sw.dim() > per_example.dim():
        raise ValueError(f"sample_weight of shape {tuple(sw.shape)} does not fit per-example losses of shape "
                         f"{tuple(per_example.shape)}: give one weight per example, shape (batch,) or (batch, 1).")
    if isinstance(sw, Tensor) and 0 < sw.dim() < per_example.dim():  # one weight per example, for all its values
        sw = sw.reshape(*sw.shape, *[1] * (per_example.dim() - sw.dim()))
    return sw


def rows(x: Any) -> int:
    """The examples in a batch: the length of its first leaf."""
    return len(md.flatten(x)[0])


def check_validation_freq(freq: Any) -> None:
    """Keras's validation_freq: validate every `freq` epochs (an int >= 1), or after the epochs
    listed (1-based, e.g. [1, 5, 10]). Checked before training, not after the first epoch."""
    if isinstance(freq, bool) or not (
            (isinstance(freq, int) and freq >= 1)
            or (isinstance(freq, (list, tuple, set, range)) and freq
                and all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in freq))):
        raise ValueError(f"fit(validation_freq={freq!r}): give an int >= 1 (validate every that many epochs) or "
                         "a list of 1-based epoch numbers, e.g. [1, 5, 10].")


def should_validate(epoch: int, freq: int | Iterable[int]) -> bool:
    return (epoch + 1) % freq == 0 if isinstance(freq, int) else epoch + 1 in freq


def steps_left(per_epoch: int | None, epochs_after: int, done: int) -> int | None:
    """Batches fit has left: the rest of this epoch and the epochs after it (None: unknown length)."""
    return None if per_epoch is None else max(per_epoch - done, 0) + epochs_after * per_epoch


def as_dataset(x: Any, y: Any, batch_size: int | None, sample_weight: Any, shuffle: bool, where: str,
               replicas: int) -> Iterable[Any]:
    """The data of fit / evaluate / predict as an iterable of GLOBAL batches: arrays batched by
    `batch_size` (default 32 per replica), a dataset or any re-iterable as it is."""
    from mirrored.data import Dataset

    if x is None:
        raise ValueError(f"Model.{where}: no data given (x=None).")
    x, y = as_array(x, where, "x"), _per_output_arrays(y, where, "y")
    sample_weight = _per_output_arrays(sample_weight, where, "sample_weight")
    # class ids: what torch's losses take
    y = md.map_structure(lambda a: a.astype(np.int64) if isinstance(a, np.ndarray) and a.dtype.kind in "iu" else a, y)
    if is_arrays(x):
        n = _rows_of(x, where)
        if batch_size is None:
            batch_size = 32 * replicas
            logger.info("%s: batch_size not given; using %d (32 per replica)", where, batch_size)
        parts = tuple(p for p in (x, y, sample_weight) if p is not None)
        for p in parts:
            for leaf in md.flatten(p):
                if len(leaf) != n:
                    raise ValueError(f"Model.{where}: x has {n} rows but another array has {len(leaf)}; "
                                     "x, y and sample_weight must have one row per example.")
        if n == 0:
            shape = {k: tuple(v.shape) for k, v in x.items()} if isinstance(x, Mapping) else tuple(x.shape)
            raise ValueError(f"Model.{where}: x has no rows (shape {shape}), so there is nothing to train or "
                             "evaluate on. Pass at least one example.")
        ds = Dataset.from_tensor_slices(parts if len(parts) > 1 else parts[0])
        if shuffle:
            ds = ds.shuffle(n)
        return ds.batch(batch_size)
    if y is not None:
        raise ValueError(f"Model.{where}: y= is only for arrays; a dataset yields (x, y) pairs itself.")
    if batch_size is not None:
        raise ValueError(f"Model.{where}: batch_size= is only for arrays; a dataset is batched already "
                         "(by the GLOBAL batch size).")
    if isinstance(x, Iterator):  # (a DataLoader is Iterable; its iterator, like a generator, is one pass)
        raise TypeError(f"Model.{where}: got a {type(x).__name__}, which can be read only once, but every epoch "
                        "(and validation) reads the data again. Give something re-iterable that yields GLOBAL "
                        "batches: a torch DataLoader, a list of batches, mr.data.Dataset.from_generator(fn) "
                        "(fn returns a new generator each pass), or arrays with batch_size=.")
    if not isinstance(x, Iterable):
        raise TypeError(f"Model.{where}: expected an mr.data.Dataset of GLOBAL batches (or arrays with "
                        f"batch_size=, a torch DataLoader, a list of batches); got {type(x).__name__}.")
    return x


def _per_output_arrays(value: Any, where: str, arg: str) -> Any:
    """Labels or sample weights as arrays: one array (a list of numbers too), or one per output - a dict,
    or a list or tuple of arrays, which becomes a tuple (a dataset reads a list as one tensor)."""
    if isinstance(value, Mapping):
        return {k: as_array(v, where, f"{arg}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (np.ndarray, Tensor)) for v in value) \
            and not _numbers(value):
        return tuple(value)
    return as_array(value, where, arg)


def train_validation_split(x: Any, y: Any, sample_weight: Any, validation_split: float
                           ) -> tuple[tuple[Any, Any, Any], tuple[Any, ...]]:
    """fit(validation_split=...): the last `validation_split` of the rows of array data for validation,
    the rest for training, taken before any shuffling, as Keras's train_validation_split: (x, y,
    sample_weight) to train on and the validation_data tuple."""
    check_validation_split(validation_split)
    x = as_array(x, "fit", "x")
    if not is_arrays(x):
        raise ValueError(f"Model.fit(validation_split={validation_split}): x is a {type(x).__name__}, not arrays; a "
                         "dataset cannot be split without reading it, so validation_split is only for arrays (as in "
                         "Keras). Give validation_data= (e.g. ds.take(n) for it and ds.skip(n) to train on).")
    y = _per_output_arrays(y, "fit", "y")
    sample_weight = _per_output_arrays(sample_weight, "fit", "sample_weight")
    n = _rows_of(x, "fit")
    split_at = int(np.floor(n * (1.0 - validation_split)))
    if split_at == 0 or split_at == n:
        raise ValueError(f"Model.fit(validation_split={validation_split}): x has {n} row(s), too few to split into "
                         f"training and validation rows ({split_at} would train). Give more data or another "
                         "validation_split.")

    def part(value: Any, start: int, end: int) -> Any:
        return None if value is None else md.map_structure(lambda a: a[start:end], value)

    train = tuple(part(v, 0, split_at) for v in (x, y, sample_weight))
    val = tuple(part(v, split_at, n) for v in (x, y, sample_weight))
    return train, (val if val[2] is not None else val[:2])


def check_validation_split(validation_split: Any) -> None:
    if isinstance(validation_split, bool) or not isinstance(validation_split, (int, float)) \
            or not 0 <= validation_split < 1:
        raise ValueError(f"Model.fit(validation_split={validation_split!r}): give a fraction in [0, 1), e.g. 0.2 "
                         "to validate on the last 20% of the rows.")


def check_class_weight(class_weight: Any, where: str) -> None:
    """{class id: weight}, as Keras takes it."""
    if not isinstance(class_weight, Mapping) or not class_weight or not all(
            isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0
            and isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
            for k, v in class_weight.items()):
        raise ValueError(f"Model.{where}(class_weight={class_weight!r:.120}): give a dict from class ids (ints >= 0) "
                         "to weights (numbers), e.g. {0: 1.0, 1: 3.0}.")


def with_class_weight(data: Any, class_weight: Mapping[int, float]) -> tuple[Any, Any, Any]:
    """A batch (x, y) with the sample weights class_weight gives its labels, as Keras's
    class_weight_to_sample_weights: one-hot labels by their argmax, labels of shape (B, 1) squeezed,
    rounded to class ids; a class not in the dict weighs 1. Refuses a batch that has sample weights or
    labels of several outputs."""
    x, y, sample_weight = unpack_x_y_sample_weight(data)
    if sample_weight is not None:
        raise ValueError("Model.fit(class_weight=...): the dataset's batches hold sample weights too; Keras takes "
                         "one or the other. Fold the class weights into the dataset's weights, or drop one.")
    if isinstance(y, (Mapping, list, tuple)):
        raise ValueError("Model.fit(class_weight=...): the batches hold labels of several outputs, and class_weight is "
                         "only for a single output (as in Keras). Give per-output sample weights instead.")
    if not isinstance(y, Tensor):
        raise ValueError("Model.fit(class_weight=...): the batches have no labels (y) to weigh by class; give (x, y) "
                         "batches.")
    labels = y.detach()
    if labels.dim() > 1:
        labels = labels.argmax(dim=-1) if labels.shape[-1] != 1 else labels.squeeze(-1)
    if labels.dim() > 1:
        raise ValueError(f"Model.fit(class_weight=...): labels of shape {tuple(y.shape)} hold more than one class per "
                         "example; class_weight weighs an example by its one class (labels of shape (batch,), "
                         "(batch, 1) or one-hot (batch, classes)). Give sample_weight instead.")
    ids = labels.double().round().long()
    top = max(int(k) for k in class_weight)
    table = torch.tensor([float(class_weight.get(c, 1.0)) for c in range(top + 1)], dtype=torch.float32,
                         device=ids.device)
    known = (ids >= 0) & (ids <= top)
    weights = torch.where(known, table[ids.clamp(0, top)], torch.ones((), dtype=torch.float32, device=ids.device))
    return x, y, weights


def is_arrays(x: Any) -> bool:
    """Whether x is array data: an array or tensor, or a dict of them (Keras's named inputs)."""
    if isinstance(x, Mapping):
        return bool(x) and all(isinstance(v, (np.ndarray, Tensor)) for v in x.values())
    return isinstance(x, (np.ndarray, Tensor))


def _rows_of(x: Any, where: str) -> int:
    """The examples of array data: its first dim, the same for every input of a dict."""
    if not isinstance(x, Mapping):
        return len(x)
    lengths = {k: len(v) for k, v in x.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"Model.{where}: the inputs of x have different numbers of rows ({lengths}); give one row "
                         "per example in each.")
    return next(iter(lengths.values()))


def prefetched(dataset: Any) -> Any:
    """fit's input with a batch made ahead on a thread while the replicas train: an mr.data.Dataset
    without a prefetch anywhere gets .prefetch(1), which yields the same batches in the same order;
    other iterables (lists, DataLoaders with their own workers) are read as they are."""
    from mirrored.data import Dataset

    if isinstance(dataset, Dataset) and "prefetch" not in dataset.get_state()["pipeline"]:
        return dataset.prefetch(1)
    return dataset


def check_ends(dataset: Any, steps: int | None, where: str, steps_arg: str) -> None:
    """Refuses, before anything runs, a dataset that cannot end a pass (infinite, with no `steps_arg`)
    or that has nothing in it. Keras 3 trains forever on the first and only warns on the second."""
    cardinality = getattr(dataset, "cardinality", None)
    n = int(cardinality()) if callable(cardinality) else epochs_lib.len_or_none(dataset)
    if n == INFINITE and steps is None:
        raise ValueError(f"Model.{where}: the dataset repeats forever ({dataset!r}) and {steps_arg} is not set, so "
                         f"the first pass would never end. Pass {steps_arg}=N (the batches per pass), or drop the "
                         ".repeat().")
    if n == 0:
        raise ValueError(f"Model.{where}: the dataset yields no batches ({dataset!r}). Check the source (an empty "
                         "file list or split, a filter that drops everything, a batch with drop_remainder=True "
                         "larger than the data).")


def no_batches(where: str, dataset: Any, what: str) -> ValueError:
    return ValueError(f"Model.{where}: the dataset yielded no batches in {what} ({dataset!r}). Check the source (an "
                      "empty file list or split, a filter that drops everything, a batch with drop_remainder=True "
                      "larger than the data).")
