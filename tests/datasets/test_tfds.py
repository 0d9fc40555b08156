"""data/tfds.py: TFDS-prepared directories (read against files TFDS 4.9.10 wrote), split specs
(against TFDS' rounding, worked out by hand), and the layout we write."""
from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage

import mirrored as mr
from mirrored.data import tfds
from mirrored.data.tfrecord import encode_example, parse_example, read_records

LABELS = ["cbb", "cbsd", "cgm", "cmd", "healthy"]


@pytest.fixture
def cassava_dir(fixtures_dir):
    return fixtures_dir / "tfds" / "cassava" / "0.1.0"


@pytest.fixture
def expected(fixtures_dir):
    with open(fixtures_dir / "tfds" / "cassava_expected.json") as f:
        return json.load(f)


def _tiny_jpeg(value: int) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (4, 3), (value, value, value)).save(out, format="JPEG", quality=95)
    return out.getvalue()


def _prepare(root, splits: dict[str, list[tuple[str, bytes, int]]], num_shards: int = 1, encode=None) -> str:
    """A small TFDS-layout directory: {split: [(file name, image bytes, label)]}."""
    directory = root / "toy" / "1.0.0"
    directory.mkdir(parents=True)
    infos = tfds.SplitDict()
    for split, items in splits.items():
        by_key = {name: (image, label) for name, image, label in items}

        def encode_one(key, by_key=by_key):
            image, label = by_key[key]
            return encode_example({"image": image, "image/filename": key.encode(), "label": label})

        infos[split] = tfds.write_split(directory, "toy", split, list(by_key), encode or encode_one,
                                        total_bytes=1000, num_shards=num_shards)
    info = tfds.DatasetInfo(
        name="toy", version="1.0.0", splits=infos, supervised_keys=("image", "label"),
        features=tfds.FeaturesDict({"image": tfds.Image(), "image/filename": tfds.Text(),
                                    "label": tfds.ClassLabel(names=LABELS)}))
    tfds.write_info(directory, info)
    return str(directory)


def _tfds_order(split: str, keys: list[str]) -> list[str]:
    # TFDS sorts a split's examples by the md5 of split name + key (tensorflow_datasets/core/hashing.py).
    return sorted(keys, key=lambda k: int(hashlib.md5(split.encode() + k.encode()).hexdigest(), 16))


def _tf_interleave(sources: list[list], cycle_length: int, block_length: int) -> list:
    """tf.data's interleave order (InterleaveDatasetOp): take block_length elements from a slot, then
    move on; a slot whose input ended is refilled from the next source when the cycle returns."""
    pending, slots, out = iter(sources), [None] * cycle_length, []
    slot = taken = 0
    input_done = False
    while not input_done or any(s is not None for s in slots):
        if slots[slot] is None and not input_done:
            source = next(pending, None)
            if source is None:
                input_done = True
            else:
                slots[slot] = iter(source)
            continue
        element = next(slots[slot], None) if slots[slot] is not None else None
        if element is not None:
            out.append(element)
            taken += 1
            if taken < block_length:
                continue
        else:
            slots[slot] = None
        slot, taken = (slot + 1) % cycle_length, 0
    return out


# ------------------------------------------------------------------ reading TFDS' own files


def test_info_of_the_tfds_written_fixture(cassava_dir):
    info = tfds.PreparedDataset(cassava_dir).info
    assert info.name == "cassava" and info.version == "0.1.0"
    assert info.features["label"].names == LABELS
    assert info.features["label"].num_classes == 5
    assert {s: info.splits[s].num_examples for s in info.splits} == {"train": 20, "test": 10, "validation": 10}
    assert info.splits["train"].num_shards == 1 and info.splits["train"].shard_lengths == (20,)
    assert info.splits["train"].filenames("cassava") == ["cassava-train.tfrecord-00000-of-00001"]
    assert info.supervised_keys == ("image", "label")
    assert info.splits["train[:50%]"].num_examples == 10


@pytest.mark.parametrize("split", ["train", "test", "validation"])
def test_examples_match_what_tfds_reads(cassava_dir, expected, split):
    ds = mr.datasets.load("cassava", split=split, data_dir=cassava_dir.parent.parent)
    got = list(ds)
    want = expected["splits"][split]
    assert len(ds) == len(got) == len(want)
    assert [ex["image/filename"] for ex in got] == [w["file"] for w in want]
    for ex, w in zip(got, want):
        assert ex["label"].dtype == torch.int64 and ex["label"].shape == () and int(ex["label"]) == w["label"]
        assert ex["image"].dtype == torch.uint8 and list(ex["image"].shape) == w["shape"]
        assert abs(ex["image"].double().mean().item() - w["mean"]) < 1.0, ex["image/filename"]
    assert expected["label_names"] == LABELS


def test_as_supervised_gives_pairs(cassava_dir, expected):
    ds = tfds.PreparedDataset(cassava_dir).as_dataset("test", as_supervised=True)
    labels = [int(y) for x, y in ds]
    assert labels == [w["label"] for w in expected["splits"]["test"]]


def test_slices_and_unions_pick_tfds_examples(cassava_dir, expected):
    source = tfds.PreparedDataset(cassava_dir)
    files = {s: [w["file"] for w in expected["splits"][s]] for s in expected["splits"]}

    def names(spec):
        return [ex["image/filename"] for ex in source.as_dataset(spec)]

    assert names("train[10:20]") == files["train"][10:20]
    assert names("train[-5:]") == files["train"][-5:]
    assert names("train[:80%]") == files["train"][:16]
    assert names("train[80%:]") == files["train"][16:]
    assert names("train[:33%]") == files["train"][:7]  # 6.6 -> 7
    # TFDS reads all the shards of a spec through one interleave (16 open, 16 records each), so
    # a union is not a concatenation once a part has more than 16 examples.
    assert names("train+validation") == _tf_interleave([files["train"], files["validation"]], 16, 16)
    assert names("train[:50%]+test") == files["train"][:10] + files["test"]
    assert names("all") == _tf_interleave([files["train"], files["test"], files["validation"]], 16, 16)
    one_by_one = source.as_dataset("train+validation", read_config={"interleave_cycle_length": 1})
    assert [ex["image/filename"] for ex in one_by_one] == files["train"] + files["validation"]


def test_written_info_files_are_byte_identical_to_tfds(cassava_dir, tmp_path):
    info = tfds.PreparedDataset(cassava_dir).info
    tfds.write_info(tmp_path, info)
    for name in ("dataset_info.json", "features.json", "label.labels.txt"):
        assert (tmp_path / name).read_bytes() == (cassava_dir / name).read_bytes(), name


def test_write_split_orders_records_as_tfds(cassava_dir, tmp_path, expected):
    records = {parse_example(r)["image/filename"][0].decode(): r
               for r in read_records(cassava_dir / "cassava-train.tfrecord-00000-of-00001")}
    shuffled = sorted(records)  # any input order: the key hash decides
    info = tfds.write_split(tmp_path, "cassava", "train", shuffled, records.__getitem__, total_bytes=1)
    assert info.shard_lengths == (20,)
    assert info.num_bytes == sum(len(r) for r in records.values())  # numBytes: serialized examples
    written = (tmp_path / "cassava-train.tfrecord-00000-of-00001").read_bytes()
    assert written == (cassava_dir / "cassava-train.tfrecord-00000-of-00001").read_bytes()


# ------------------------------------------------------------------------- split specs


@pytest.mark.parametrize("spec, n, want", [
    ("train[:50%]", 5, (0, 2)),      # 2.5 rounds to even
    ("train[:50%]", 7, (0, 4)),      # 3.5 rounds to even
    ("train[:10%]", 25, (0, 2)),     # 2.5 -> 2
    ("train[:30%]", 25, (0, 8)),     # 7.5 -> 8
    ("train[-25%:]", 10, (8, 10)),   # round(-2.5) = -2
    ("train[33.3%:]", 1000, (333, 1000)),
    ("train[-5:]", 20, (15, 20)),
    ("train[5:-5]", 20, (5, 15)),
    ("train[15:5]", 20, (15, 15)),   # empty, as in TFDS
    ("train[:0%]", 20, (0, 0)),
])
def test_split_ranges_follow_tfds_rounding(spec, n, want):
    assert tfds.split_ranges(spec, {"train": n}) == [("train", *want)]


def test_shard_slices_use_shard_lengths():
    info = tfds.SplitInfo("train", (5, 7, 3))
    assert tfds.split_ranges("train[1shard:]", {"train": info}) == [("train", 5, 15)]
    assert tfds.split_ranges("train[:-1shard]", {"train": info}) == [("train", 0, 12)]
    assert tfds.split_ranges("train[2shard]", {"train": info}) == [("train", 12, 15)]


@pytest.mark.parametrize("spec, message", [
    ("trian", "unknown split 'trian'; the dataset has 'train', 'test'"),
    ("train[:120%]", "within [-100%, 100%]"),
    ("train[30:]", "out of range for split 'train' of 20 examples"),
    ("train[1.5:]", "not a whole number"),
    ("train[a:b]", "cannot parse the slice"),
    ("train[:5%:]", "cannot parse the slice"),
    ("train[3]", "needs a colon"),
    ("train[:10%shard]", "cannot parse"),
    ("all[:10%]", "'all' cannot be sliced"),
    ("train+", "cannot parse ''"),
])
def test_bad_split_specs_are_explained(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        tfds.split_ranges(spec, {"train": 20, "test": 10})


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 100_000), k=st.one_of(st.integers(0, 100), st.integers(0, 100_000).map(lambda m: m / 1000)))
def test_percent_halves_partition_the_split(n, k):
    (_, a0, a1), = tfds.split_ranges(f"train[:{k}%]", {"train": n})
    (_, b0, b1), = tfds.split_ranges(f"train[{k}%:]", {"train": n})
    assert a0 == 0 and b1 == n and a1 == b0  # in order, disjoint, together exactly the split
    assert abs(a1 - k * n / 100) <= 0.5 + 1e-9  # the closest example boundary


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 1000), data=st.data())
def test_absolute_slices_match_python_slicing(n, data):
    a = data.draw(st.integers(-n, n))
    b = data.draw(st.integers(-n, n))
    (_, start, stop), = tfds.split_ranges(f"train[{a}:{b}]", {"train": n})
    assert list(range(n))[a:b] == list(range(start, stop))


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=8), data=st.data())
def test_sub_split_shard_lengths_cover_the_range(lengths, data):
    info = tfds.SplitDict({"train": tfds.SplitInfo("train", tuple(lengths))})
    n = sum(lengths)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    assert info[f"train[{a}:{b}]"].num_examples == b - a


# ----------------------------------------------------------------- shards we write and read


def _items(n, label_of=lambda i: i % 5):
    jpeg = _tiny_jpeg(100)
    return [(f"img-{i:03d}.jpg", jpeg, label_of(i)) for i in range(n)]


def test_several_shards_read_in_tfds_interleave_order(tmp_path):
    directory = _prepare(tmp_path, {"train": _items(40)}, num_shards=2)
    info = tfds.read_info(directory)
    assert info.splits["train"].shard_lengths == (20, 20)
    order = _tfds_order("train", [f"img-{i:03d}.jpg" for i in range(40)])
    shards = [order[:20], order[20:]]
    source = tfds.PreparedDataset(directory)
    names = [ex["image/filename"] for ex in source.as_dataset("train")]
    assert names == _tf_interleave(shards, 16, 16)  # TFDS' default ReadConfig: 16 shards, 16 records
    assert names[:16] == order[:16] and names[16:32] == order[20:36]
    one_by_one = source.as_dataset("train", read_config={"interleave_cycle_length": 1})
    assert [ex["image/filename"] for ex in one_by_one] == order
    small = source.as_dataset("train[3:37]", read_config={"interleave_cycle_length": 2, "interleave_block_length": 3})
    assert [ex["image/filename"] for ex in small] == _tf_interleave([order[3:20], order[20:37]], 2, 3)


def test_shards_outside_the_slice_are_never_opened(tmp_path):
    directory = _prepare(tmp_path, {"train": _items(30)}, num_shards=3)
    os.remove(os.path.join(directory, "toy-train.tfrecord-00002-of-00003"))
    source = tfds.PreparedDataset(directory)
    assert len(list(source.as_dataset("train[:20]"))) == 20
    with pytest.raises(FileNotFoundError, match="toy-train.tfrecord-00002-of-00003 is missing"):
        source.as_dataset("train")


def test_shuffle_files_is_seeded_by_torch_and_complete(tmp_path):
    directory = _prepare(tmp_path, {"train": _items(24)}, num_shards=8)
    source = tfds.PreparedDataset(directory)
    config = {"interleave_cycle_length": 1}

    def names(ds):
        return [ex["image/filename"] for ex in ds]

    torch.manual_seed(3)
    first = source.as_dataset("train", shuffle_files=True, read_config=config)
    torch.manual_seed(3)
    second = source.as_dataset("train", shuffle_files=True, read_config=config)
    pass_1 = names(first)
    assert pass_1 == names(second)
    assert sorted(pass_1) == sorted(names(source.as_dataset("train")))
    shards = [set(pass_1[i:i + 3]) for i in range(0, 24, 3)]  # whole shards stay together
    order = _tfds_order("train", [f"img-{i:03d}.jpg" for i in range(24)])
    assert sorted(map(sorted, shards)) == sorted(sorted(order[i:i + 3]) for i in range(0, 24, 3))
    fixed = source.as_dataset("train", shuffle_files=True, read_config={**config, "shuffle_seed": 7})
    assert names(fixed) == names(source.as_dataset("train", shuffle_files=True, read_config={**config, "shuffle_seed": 7}))


def test_non_image_bytes_name_the_record_and_shard(tmp_path):
    items = _items(6)
    items[3] = (items[3][0], b"definitely not a JPEG", 1)
    directory = _prepare(tmp_path, {"train": items})
    position = _tfds_order("train", [name for name, _, _ in items]).index(items[3][0])
    ds = tfds.PreparedDataset(directory).as_dataset("train")
    with pytest.raises(ValueError, match=f"record {position} of .*toy-train.tfrecord-00000-of-00001"):
        list(ds)


def test_label_out_of_range_names_the_record_and_shard(tmp_path):
    items = _items(6, label_of=lambda i: 7 if i == 2 else 0)
    directory = _prepare(tmp_path, {"train": items})
    position = _tfds_order("train", [name for name, _, _ in items]).index("img-002.jpg")
    ds = tfds.PreparedDataset(directory).as_dataset("train", as_supervised=True)
    with pytest.raises(ValueError, match=rf"record {position} of .*toy-train.tfrecord-00000-of-00001: "
                                         r"label \[7\] is outside \[0, 5\)"):
        list(ds)


@pytest.mark.parametrize("feature, bad, message", [
    ("label", 2.7, r"the label feature holds a float_list of 1 \[2.70.*\], not an int64 class id"),
    ("label", b"3", r"the label feature holds a bytes_list of 1 starting b'3', not an int64 class id"),
    ("image", np.array([1, 2]), r"the image feature holds an int64_list of 2 \[1, 2\], not encoded image bytes"),
    ("image/filename", 7, r"the text feature holds an int64_list of 1 \[7\], not UTF-8 bytes"),
])
def test_a_feature_of_the_wrong_kind_names_the_record_and_shard(tmp_path, feature, bad, message):
    """A float label 2.7 or a bytes label b"3" would pass int() as 2 and 3: each feature is checked
    for the tf.train.Example list kind TFDS writes it as, and the error names the record."""
    items = _items(4)

    def encode(key):
        fields = {"image": _tiny_jpeg(9), "image/filename": key.encode(), "label": 1}
        if key == "img-002.jpg":
            fields[feature] = bad
        return encode_example(fields)

    directory = _prepare(tmp_path, {"train": items}, encode=encode)
    position = _tfds_order("train", [name for name, _, _ in items]).index("img-002.jpg")
    with pytest.raises(ValueError, match=rf"record {position} of .*toy-train.tfrecord-00000-of-00001: {message}"):
        list(tfds.PreparedDataset(directory).as_dataset("train"))


def test_truncated_shard_is_reported(tmp_path):
    directory = _prepare(tmp_path, {"train": _items(10)})
    info_path = os.path.join(directory, "dataset_info.json")
    with open(info_path) as f:
        raw = json.load(f)
    raw["splits"][0]["shardLengths"] = ["12"]  # the file holds 10
    with open(info_path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="fewer records than the 12"):
        list(tfds.PreparedDataset(directory).as_dataset("train"))


def test_shard_count_follows_tfds_sizes():
    mib = 1 << 20
    assert tfds.shard_count(10 * mib, 100) == 1
    assert tfds.shard_count(800 * mib, 5656) == 8     # 64 MiB .. 1 GiB per shard
    assert tfds.shard_count(260 * mib, 1885) == 4
    assert tfds.shard_count(800 * mib, 3) == 2        # never more shards than examples
    assert tfds.shard_boundaries(10, 4) == [2, 5, 8, 10]  # round(2.5) = 2, round(7.5) = 8


def test_newest_version_is_found_and_half_written_ones_ignored(tmp_path):
    for version in ("1.0.0", "1.10.0", "1.2.0"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "dataset_info.json").write_text("{}")
    (tmp_path / "2.0.0").mkdir()  # no dataset_info.json: not complete
    (tmp_path / ".3.0.0.incomplete-abc").mkdir()
    assert tfds.find_version_dir(tmp_path) == str(tmp_path / "1.10.0")
    assert tfds.find_version_dir(tmp_path, "1.2.0") == str(tmp_path / "1.2.0")
    assert tfds.find_version_dir(tmp_path, "2.0.0") is None


def test_default_data_dir_follows_tfds(monkeypatch, tmp_path):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    assert tfds.default_data_dir() == str(tmp_path)
    monkeypatch.delenv("TFDS_DATA_DIR")
    assert tfds.default_data_dir() == os.path.join(os.path.expanduser("~"), "tensorflow_datasets")


def test_read_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown field"):
        tfds.ReadConfig.of({"shuffle_sead": 1})
    assert np.isscalar(tfds.ReadConfig.of(None).interleave_cycle_length)
