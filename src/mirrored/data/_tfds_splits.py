"""The splits of a TFDS dataset and the split specs that select from them.

SplitInfo (one split's shard lengths and file names) and SplitDict ({name: SplitInfo}, which also
answers a spec such as splits["train[:80%]"]); parse_split() turns a spec ("train[:80%]+test",
"train[-5:]", "train[:2shard]") into ReadInstructions as TFDS does, split_ranges() into example
ranges, and _shard_takes() into the records of each shard a range takes (FileInstruction).
tfds.py re-exports the public names, which users import from there. Uses the standard library only.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

DEFAULT_FILEPATH_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """One split: examples per shard file (tfds.core.SplitInfo). A sub-split such as
    info.splits["train[:10%]"] lists the examples it takes from each shard instead."""

    name: str
    shard_lengths: tuple[int, ...]
    num_bytes: int = 0
    filepath_template: str | None = DEFAULT_FILEPATH_TEMPLATE

    @property
    def num_examples(self) -> int:
        """The examples of the split: the sum of its shards' lengths."""
        return sum(self.shard_lengths)

    @property
    def num_shards(self) -> int:
        """How many files (shards) the split has."""
        return len(self.shard_lengths)

    def filenames(self, dataset_name: str) -> list[str]:
        """The shard file names, in shard order."""
        if self.filepath_template is None:
            raise ValueError(f"SplitInfo {self.name!r} is a sub-split; its files are those of its split.")
        n = self.num_shards
        return [self.filepath_template.replace("{DATASET}", dataset_name).replace("{SPLIT}", self.name)
                .replace("{FILEFORMAT}", "tfrecord").replace("{SHARD_X_OF_Y}", f"{i:05d}-of-{n:05d}")
                .replace("{SHARD_INDEX}", f"{i:05d}").replace("{NUM_SHARDS}", f"{n:05d}") for i in range(n)]

    def __repr__(self) -> str:
        return f"<SplitInfo {self.name!r} num_examples={self.num_examples}, num_shards={self.num_shards}>"


class SplitDict(dict):
    """{split name: SplitInfo}; a spec such as splits["train[:80%]"] gives that sub-split's SplitInfo."""

    def __getitem__(self, key: str) -> SplitInfo:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        lengths: list[int] = []
        for name, start, stop in split_ranges(key, self):
            lengths += [take for _, _, take in _shard_takes(self.get(name).shard_lengths, start, stop)]
        return SplitInfo(str(key), tuple(lengths), 0, None)

    @property
    def total_num_examples(self) -> int:
        """The examples of every split together (tfds's SplitDict.total_num_examples)."""
        return sum(s.num_examples for s in self.values())


# One part of a spec: name, then an optional [from:to] with ints, floats with %, or "shard" units.
_PART_RE = re.compile(r"^\s*(?P<name>[\w-]+)\s*(?:\[(?P<slice>[^\]]*)\])?\s*$")
_BOUND_RE = re.compile(r"^\s*(?P<value>[-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?P<unit>%|shard)?\s*$")


@dataclasses.dataclass(frozen=True)
class ReadInstruction:
    """One parsed part of a split spec: split name and slice bounds in `unit` ('abs', '%', 'shard')."""

    split: str
    start: float | None = None
    stop: float | None = None
    unit: str = "abs"


def parse_split(spec: str) -> list[ReadInstruction]:
    """Parses a TFDS split spec: parts joined by '+', each `name`, `name[a:b]` (examples, negative
    from the end), `name[a%:b%]` (percent, may be fractional), `name[a shard:b shard]` or `name[k shard]`;
    "all" is every split."""
    if not isinstance(spec, str):
        raise TypeError(f"split must be a str such as 'train[:80%]'; got {spec!r} ({type(spec).__name__}).")
    out = []
    for part in spec.split("+"):
        match = _PART_RE.match(part)
        if not match:
            raise ValueError(f"split {spec!r}: cannot parse {part.strip()!r}. Write e.g. 'train', 'train[:80%]', "
                             "'train[10:20]', 'train[-5:]' or 'train[:50%]+test'.")
        name, selector = match["name"], match["slice"]
        if selector is None:
            out.append(ReadInstruction(name))
            continue
        if name == "all":
            raise ValueError(f"split {spec!r}: 'all' cannot be sliced; slice the splits and join them with '+'.")
        out.append(_parse_slice(name, selector, spec))
    return out


def _parse_slice(name: str, selector: str, spec: str) -> ReadInstruction:
    pieces = selector.split(":")
    bounds = [None if not p.strip() else _BOUND_RE.match(p) for p in pieces]
    bad = len(pieces) > 2 or any(p.strip() and b is None for p, b in zip(pieces, bounds)) or not any(bounds)
    if bad:
        raise ValueError(f"split {spec!r}: cannot parse the slice [{selector}]. Write [from:to] with ints "
                         "(examples), percents such as [:80%] or [10%:], or shards such as [:2shard].")
    units = {b["unit"] for b in bounds if b is not None and b["unit"]}
    if len(units) > 1:
        raise ValueError(f"split {spec!r}: the slice [{selector}] mixes units {sorted(units)}; use one unit.")
    unit = {"%": "%", "shard": "shard"}.get(units.pop() if units else "", "abs")
    if len(pieces) == 1:  # name[k shard]: one shard
        if unit != "shard":
            raise ValueError(f"split {spec!r}: [{selector}] needs a colon, e.g. [{selector}:] or [:{selector}]; "
                             "only shards can be picked by a single index ([3shard]).")
        k = int(bounds[0]["value"])
        return ReadInstruction(name, k, k + 1 if k != -1 else None, unit)
    values = []
    for b in bounds:
        if b is None:
            values.append(None)
        elif unit == "%":
            values.append(float(b["value"]))
        elif re.fullmatch(r"[-+]?\d+", b["value"].strip()):
            values.append(int(b["value"]))
        else:
            raise ValueError(f"split {spec!r}: {b['value']} is not a whole number; only percents may be "
                             "fractional ([:33.3%]).")
    if unit == "%" and any(v is not None and abs(v) > 100 for v in values):
        raise ValueError(f"split {spec!r}: percent bounds must be within [-100%, 100%].")
    return ReadInstruction(name, values[0], values[1], unit)


def _percent_to_index(percent: float, num_examples: int) -> int:
    # TFDS' default "closest" rounding: Python's round() (ties to even) of the float product, so
    # train[:50%] of 5 examples has 2 and train[:50%] of 7 has 4, exactly as tfds.load gives them.
    return int(round(percent * num_examples / 100.0))


def split_ranges(spec: str, splits: Mapping[str, SplitInfo | int]) -> list[tuple[str, int, int]]:
    """`spec` as (split, start, stop) example ranges, given each split's SplitInfo or size.
    An unknown split is a ValueError listing the available ones."""
    out = []
    for instr in parse_split(spec):
        names = list(splits) if instr.split == "all" else [instr.split]
        for name in names:
            if name not in splits:
                raise ValueError(f"split {spec!r}: unknown split {name!r}; the dataset has "
                                 f"{', '.join(map(repr, splits))}. Use one of those (sliced if you like, e.g. "
                                 f"'{next(iter(splits), 'train')}[:80%]'), or 'all'.")
            info = splits[name]
            n = info if isinstance(info, int) else info.num_examples
            start, stop = _absolute(instr, n, info, spec)
            out.append((name, start, max(start, stop)))
    return out


def _absolute(instr: ReadInstruction, n: int, info: SplitInfo | int, spec: str) -> tuple[int, int]:
    start, stop = instr.start, instr.stop
    if instr.unit == "%":
        start = 0 if start is None else _percent_to_index(start, n)
        stop = n if stop is None else _percent_to_index(stop, n)
    elif instr.unit == "shard":
        lengths = list(info.shard_lengths) if isinstance(info, SplitInfo) else [n]
        if any(abs(b) > len(lengths) for b in (start, stop) if b is not None):
            raise ValueError(f"split {spec!r}: shard bound out of range; split {instr.split!r} has "
                             f"{len(lengths)} shard(s).")
        start = 0 if start is None else sum(lengths[:start])
        stop = n if stop is None else sum(lengths[:stop]) if stop > 0 else sum(lengths[:len(lengths) + stop])
    else:
        start, stop = (0 if start is None else start), (n if stop is None else stop)
        if abs(start) > n or abs(stop) > n:
            raise ValueError(f"split {spec!r}: slice [{instr.start if instr.start is not None else ''}:"
                             f"{instr.stop if instr.stop is not None else ''}] is out of range for split "
                             f"{instr.split!r} of {n} examples; use bounds within [-{n}, {n}], or percents.")
    return (n + start if start < 0 else start), (n + stop if stop < 0 else stop)


@dataclasses.dataclass(frozen=True)
class FileInstruction:
    """Read `take` records of shard `path` after skipping `skip` (tfds' FileInstruction)."""

    path: str
    skip: int
    take: int


def _shard_takes(shard_lengths: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """(shard index, skip, take) covering examples [start, stop) of shards of these lengths."""
    out, first = [], 0
    for index, length in enumerate(shard_lengths):
        lo, hi = max(start, first), min(stop, first + length)
        if lo < hi:
            out.append((index, lo - first, hi - lo))
        first += length
    return out
