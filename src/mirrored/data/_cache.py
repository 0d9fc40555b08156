"""The file format of `Dataset.cache(filename)`: elements streamed to one file, never pickled.

Layout: a magic line, then one record per element, then an end record. A record is a little-endian
u32 length, a JSON header, and the raw bytes of the element's tensors and strings. The header lists
each leaf as [kind, ...]: "T" torch tensor (dtype name, shape, byte count), "N" numpy array (dtype
descr, shape, byte count), "s"/"b" str/bytes (byte count), "v" string vector (item kinds, byte
counts), "i"/"f"/"o" int/float/bool (the value, inline), "z" None. A header carries the element's
structure ("t") only when it differs from the previous element's. The end record is {"end": count}.

`CacheWriter` writes to a temporary file beside the target and renames it over the target only
when `commit()` is called after a complete pass, so a pass cut short never leaves a file that a
later epoch (or process) would read as complete. `Cache` is the node of Dataset.cache(), in memory
or through this format. Uses torch, numpy, _structure.py, _threads.py and _pipeline.Node.
"""
from __future__ import annotations

import collections
import json
import os
import struct
import threading
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from mirrored._strings import nest_strings, string_items, string_tensor_shape
from mirrored.data._pipeline import Node
from mirrored.data._structure import (
    _DICT,
    _LIST,
    _NAMEDTUPLE,
    _TUPLE,
    Tree,
    flatten,
    unflatten,
)
from mirrored.data._threads import close_iterator

MAGIC = b"mirrored.data cache v1\n"
_LENGTH = struct.Struct("<I")
_JSON_KEYS = (str, int, float, bool, type(None))


def _tree_to_json(tree: Tree, namedtuples: dict[tuple, type]) -> Any:
    if tree is None:
        return None
    kind = tree[0]
    if kind == _DICT:
        for key in tree[1]:
            if not isinstance(key, _JSON_KEYS):
                raise TypeError(
                    f"Dataset.cache(filename): dict key {key!r} ({type(key).__name__}) cannot be "
                    "written to the cache file. Use str or int keys, or cache in memory (filename='')."
                )
        return {"dict": [[k, _tree_to_json(c, namedtuples)] for k, c in zip(tree[1], tree[2])],
                "ordered": tree[3] is collections.OrderedDict}
    if kind == _NAMEDTUPLE:
        cls = tree[1]
        namedtuples.setdefault((cls.__name__, tuple(cls._fields)), cls)
        return {"namedtuple": cls.__name__, "fields": list(cls._fields),
                "items": [_tree_to_json(c, namedtuples) for c in tree[2]]}
    return {("tuple" if kind == _TUPLE else "list"): [_tree_to_json(c, namedtuples) for c in tree[1]]}


def _tree_from_json(obj: Any, namedtuples: dict[tuple, type]) -> Tree:
    if obj is None:
        return None
    if "dict" in obj:
        keys = tuple(k for k, _ in obj["dict"])
        children = tuple(_tree_from_json(c, namedtuples) for _, c in obj["dict"])
        return (_DICT, keys, children, collections.OrderedDict if obj["ordered"] else dict)
    if "namedtuple" in obj:
        key = (obj["namedtuple"], tuple(obj["fields"]))
        if key not in namedtuples:  # written by another process: a stand-in class, same name and fields
            namedtuples[key] = collections.namedtuple(obj["namedtuple"], obj["fields"])
        return (_NAMEDTUPLE, namedtuples[key], tuple(_tree_from_json(c, namedtuples) for c in obj["items"]))
    kind, items = (_TUPLE, obj["tuple"]) if "tuple" in obj else (_LIST, obj["list"])
    return (kind, tuple(_tree_from_json(c, namedtuples) for c in items))


def _encode_leaf(leaf: Any, payloads: list[Any]) -> list[Any]:
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach().cpu().resolve_conj().resolve_neg().contiguous()
        if t.numel():
            payloads.append(t.reshape(-1).view(torch.uint8).numpy())
        return ["T", str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()]
    if isinstance(leaf, (np.ndarray, np.generic)):
        shape = np.shape(leaf)
        a = np.ascontiguousarray(leaf)  # (may add a dimension to a 0-d value: keep `shape`)
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise TypeError(
                f"Dataset.cache(filename): a numpy leaf of dtype {a.dtype} cannot be written without "
                "pickle. Convert it to a numeric dtype or to str, or cache in memory (filename='')."
            )
        if a.size:
            payloads.append(a.reshape(-1).view(np.uint8))
        return ["N", a.dtype.str, list(shape), a.nbytes]
    if isinstance(leaf, str):
        data = leaf.encode("utf-8")
        payloads.append(data)
        return ["s", len(data)]
    if isinstance(leaf, bytes):
        payloads.append(leaf)
        return ["b", len(leaf)]
    if type(leaf) is list:  # a string tensor (flatten() only leaves those as list leaves)
        items = string_items(leaf)
        data = [s.encode("utf-8") if isinstance(s, str) else s for s in items]
        payloads.extend(data)
        entry = ["v", "".join("s" if isinstance(s, str) else "b" for s in items), [len(d) for d in data]]
        shape = string_tensor_shape(leaf)
        return entry if len(shape) == 1 else [*entry, list(shape)]  # rank 1 as before this took more
    if isinstance(leaf, bool):
        return ["o", leaf]
    if isinstance(leaf, int):
        return ["i", leaf]
    if isinstance(leaf, float):
        return ["f", leaf]
    if leaf is None:
        return ["z"]
    raise TypeError(
        f"Dataset.cache(filename): cannot write a leaf of type {type(leaf).__name__} to the cache "
        "file (tensors, numpy arrays, str, bytes, int, float, bool and None can be written). "
        "Convert it in a map before cache(), or cache in memory (filename='')."
    )


class CacheWriter:
    """Streams elements to `path` + a unique temporary suffix; `commit()` renames it into place.
    Namedtuple classes met on the way are added to `namedtuples`, for read_cache to rebuild."""

    def __init__(self, path: str, namedtuples: dict[tuple, type]):
        self.path, self.namedtuples = path, namedtuples
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self._file.write(MAGIC)
        self._last_tree: Any = object()
        self._count = 0

    def write(self, element: Any) -> None:
        leaves, tree = flatten(element)
        payloads: list[Any] = []
        header: dict[str, Any] = {"l": [_encode_leaf(leaf, payloads) for leaf in leaves]}
        if tree != self._last_tree:
            header["t"] = _tree_to_json(tree, self.namedtuples)
            self._last_tree = tree
        self._write_record(header)
        for p in payloads:
            self._file.write(p)
        self._count += 1

    def _write_record(self, header: dict[str, Any]) -> None:
        data = json.dumps(header, separators=(",", ":")).encode("utf-8")
        self._file.write(_LENGTH.pack(len(data)))
        self._file.write(data)

    def commit(self) -> None:
        self._write_record({"end": self._count})
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


def _corrupt(path: str, detail: str) -> ValueError:
    return ValueError(
        f"Dataset.cache: the cache file {path} is not a complete mirrored.data cache ({detail}). "
        "It may be from another program or damaged: delete it and the next pass rebuilds it."
    )


def _read_exact(f: Any, n: int, path: str) -> bytearray:
    buf = bytearray(n)
    if n and f.readinto(buf) != n:
        raise _corrupt(path, "the file ends in the middle of a record")
    return buf


def _decode_leaf(entry: list[Any], f: Any, path: str) -> Any:
    kind = entry[0]
    if kind == "T":
        dtype = getattr(torch, entry[1], None)
        if not isinstance(dtype, torch.dtype):
            raise _corrupt(path, f"unknown tensor dtype {entry[1]!r}")
        buf = _read_exact(f, entry[3], path)
        if not buf:
            return torch.empty(entry[2], dtype=dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(entry[2])
    if kind == "N":
        dtype = np.dtype(entry[1])
        if dtype.hasobject:
            raise _corrupt(path, f"object dtype {entry[1]!r}")
        return np.frombuffer(_read_exact(f, entry[3], path), dtype=dtype).reshape(entry[2])
    if kind == "s":
        return _read_exact(f, entry[1], path).decode("utf-8")
    if kind == "b":
        return bytes(_read_exact(f, entry[1], path))
    if kind == "v":
        items = [bytes(_read_exact(f, n, path)) for n in entry[2]]
        strings = [b.decode("utf-8") if k == "s" else b for k, b in zip(entry[1], items)]
        return nest_strings(strings, entry[3]) if len(entry) > 3 else strings
    if kind in ("i", "f", "o"):
        return entry[1]
    if kind == "z":
        return None
    raise _corrupt(path, f"unknown leaf kind {kind!r}")


def read_cache(path: str, namedtuples: dict[tuple, type]) -> Iterator[Any]:
    """Yields the elements stored at `path`. `namedtuples` maps (name, fields) to the classes to
    rebuild; missing ones get a stand-in namedtuple class (added to the dict)."""
    with open(path, "rb", buffering=1 << 20) as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise _corrupt(path, "wrong magic bytes at the start")
        tree: Any = None
        count = 0
        while True:
            raw = f.read(_LENGTH.size)
            if len(raw) != _LENGTH.size:
                raise _corrupt(path, f"no end record after {count} elements")
            try:
                header = json.loads(_read_exact(f, _LENGTH.unpack(raw)[0], path))
            except json.JSONDecodeError as e:
                raise _corrupt(path, f"bad record header: {e}") from None
            if "end" in header:
                if header["end"] != count:
                    raise _corrupt(path, f"the end record counts {header['end']} elements, read {count}")
                return
            if "t" in header:
                tree = _tree_from_json(header["t"], namedtuples)
            leaves = [_decode_leaf(entry, f, path) for entry in header["l"]]
            count += 1
            yield unflatten(tree, leaves)


class Cache(Node):
    kind = "cache"
    passes_elements = True

    def __init__(self, input: Node, filename: str):
        super().__init__(input)
        self.filename = filename
        self.elements: list[Any] | None = None  # the memory cache, once a pass completed
        self.namedtuples: dict[tuple, type] = {}  # classes seen while writing, to rebuild them
        self.lock = threading.Lock()

    def iterate(self, probe: bool) -> Iterator[Any]:
        if probe:
            return self.inputs[0].iterate(probe)
        if not self.filename:
            if self.elements is not None:
                return iter(self.elements)
            return self._fill_memory(self.inputs[0].iterate(probe))
        if os.path.exists(self.filename):
            return read_cache(self.filename, self.namedtuples)
        return self._fill_file(self.inputs[0].iterate(probe))

    def _fill_memory(self, upstream: Iterator[Any]) -> Iterator[Any]:
        elements: list[Any] = []
        complete = False
        try:
            for element in upstream:
                elements.append(element)
                yield element
            complete = True
        except GeneratorExit:
            _warn_partial()
            raise
        finally:
            close_iterator(upstream)
            if complete:
                with self.lock:
                    if self.elements is None:
                        self.elements = elements

    def _fill_file(self, upstream: Iterator[Any]) -> Iterator[Any]:
        writer = CacheWriter(self.filename, self.namedtuples)
        complete = False
        try:
            for element in upstream:
                writer.write(element)
                yield element
            complete = True
        except GeneratorExit:
            _warn_partial()
            raise
        finally:
            close_iterator(upstream)
            if complete:
                writer.commit()
            else:
                writer.abort()

    def describe(self) -> str:
        return f"cache({self.filename!r})" if self.filename else "cache()"


def _warn_partial() -> None:
    warnings.warn(
        "Dataset.cache: a pass ended before reading the whole dataset, so what it cached was "
        "discarded (a partial cache would silently truncate later epochs). Put take()/skip() "
        "after cache() only if every pass reads to the end; cache() then take() caches nothing.",
        stacklevel=3,
    )
