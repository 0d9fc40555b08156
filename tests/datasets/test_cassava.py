"""datasets/cassava.py: download (from a local HTTP server with Range support), prepare, load.

Each test serves a small zip with the real archive's layout, built here with Pillow, from a
ThreadingHTTPServer on 127.0.0.1 that is shut down and joined before the test ends."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image as PILImage

import mirrored as mr
from mirrored.data.tfrecord import parse_example, read_records
from mirrored.datasets import cassava

LABELS = ["cbb", "cbsd", "cgm", "cmd", "healthy"]
PER_CLASS = {"train": 2, "test": 1, "validation": 1}


def _jpeg(seed: int) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (8, 6), (seed * 11 % 256, 90, 200 - seed)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _archive(extra: dict[str, bytes] | None = None) -> tuple[bytes, dict[str, bytes]]:
    """The zip's bytes, and {file name: JPEG bytes} of its images."""
    images, buffer = {}, io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("cassavaleafdata/", b"")
        for split, n in PER_CLASS.items():
            for c, label in enumerate(LABELS):
                for i in range(n):
                    name = f"{split}-{label}-{i}.jpg"
                    images[name] = _jpeg(len(images))
                    zf.writestr(f"cassavaleafdata/{split}/{label}/{name}", images[name])
        zf.writestr("cassavaleafdata/train/cbb/.DS_Store", b"junk")  # ignored, as TFDS' *.jpg glob does
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return buffer.getvalue(), images


class _Served:
    """What the server sends, and the Range header of every request it got."""

    def __init__(self, data: bytes, cut_first_after: int | None = None, ignore_range: bool = False):
        self.data, self.cut_first_after, self.ignore_range = data, cut_first_after, ignore_range
        self.ranges: list[str | None] = []


def _handler(served: _Served) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            requested = self.headers.get("Range")
            served.ranges.append(requested)
            data, start = served.data, 0
            if requested and not served.ignore_range:
                start = int(requested.removeprefix("bytes=").split("-")[0])
                if start >= len(data):
                    self.send_response(416)
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            body = data[start:]
            if served.cut_first_after is not None and len(served.ranges) == 1:
                body = body[:served.cut_first_after]  # then the connection closes: a dropped download
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the request threads
    block_on_close = True


@contextlib.contextmanager
def _serving(served: _Served):
    server = _Server(("127.0.0.1", 0), _handler(served))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="test-http")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cassavaleafdata.zip"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _config(url: str, data: bytes, **overrides) -> dict:
    return {"url": url, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "progress": False, "retry_wait_s": 0.0, "timeout_s": 10.0, **overrides}


def test_download_prepare_load(tmp_path, fixtures_dir):
    data, images = _archive()
    served = _Served(data)
    with _serving(served) as url:
        splits, info = mr.datasets.load("cassava", data_dir=tmp_path, download=True, with_info=True,
                                        download_config=_config(url, data))
        again = mr.datasets.load("cassava", split="test", data_dir=tmp_path, download=True,
                                 download_config=_config(url, data))
    assert served.ranges == [None]  # downloaded once; the second load found the prepared data
    assert {s: len(ds) for s, ds in splits.items()} == {"train": 10, "test": 5, "validation": 5}
    assert info.features["label"].names == LABELS and info.splits["train"].num_examples == 10
    for split, ds in splits.items():
        examples = list(ds)
        names = [ex["image/filename"] for ex in examples]
        assert sorted(names) == sorted(n for n in images if n.startswith(split + "-"))
        for ex in examples:
            assert LABELS[int(ex["label"])] == ex["image/filename"].split("-")[1]
            assert ex["image"].shape == (6, 8, 3) and ex["image"].dtype == torch.uint8
    assert len(again) == 5

    version_dir = tmp_path / "cassava" / "0.1.0"
    assert sorted(os.listdir(tmp_path / "cassava")) == [".prepare.lock", "0.1.0"]  # no temporary left
    records = list(read_records(version_dir / "cassava-train.tfrecord-00000-of-00001"))
    for record in records:  # the JPEG bytes as in the archive, not re-encoded
        parsed = parse_example(record)
        assert parsed["image"][0] == images[parsed["image/filename"][0].decode()]
    theirs = fixtures_dir / "tfds" / "cassava" / "0.1.0"
    for name in ("features.json", "label.labels.txt"):
        assert (version_dir / name).read_bytes() == (theirs / name).read_bytes(), name
    ours, tfds_info = (json.loads((d / "dataset_info.json").read_text()) for d in (version_dir, theirs))
    assert set(ours) - {"downloadSize"} == set(tfds_info)
    assert [set(s) for s in ours["splits"]] == [set(s) for s in tfds_info["splits"]]
    assert [s["name"] for s in ours["splits"]] == ["train", "test", "validation"]
    assert ours["supervisedKeys"] == tfds_info["supervisedKeys"]
    assert ours["splits"][0]["numBytes"] == str(sum(len(r) for r in records))


def test_dropped_connection_is_resumed_with_a_range_request(tmp_path):
    data, _ = _archive()
    served = _Served(data, cut_first_after=1000)
    with _serving(served) as url:
        ds = mr.datasets.load("cassava", split="validation", data_dir=tmp_path, download=True,
                              download_config=_config(url, data, retries=1))
    assert served.ranges == [None, "bytes=1000-"]
    assert len(list(ds)) == 5
    assert (tmp_path / "downloads" / "cassavaleafdata.zip").read_bytes() == data


def test_a_failed_download_resumes_in_the_next_call(tmp_path):
    data, _ = _archive()
    served = _Served(data, cut_first_after=700)
    part = tmp_path / "downloads" / "cassavaleafdata.zip.part"
    with _serving(served) as url:
        with pytest.raises(ConnectionError, match="the next call resumes from there"):
            mr.datasets.load("cassava", data_dir=tmp_path, download=True, download_config=_config(url, data, retries=0))
        assert part.stat().st_size == 700
        assert not (tmp_path / "cassava" / "0.1.0").exists()
        splits = mr.datasets.load("cassava", data_dir=tmp_path, download=True, download_config=_config(url, data))
    assert served.ranges == [None, "bytes=700-"]
    assert len(splits["train"]) == 10 and not part.exists()


def test_server_ignoring_range_restarts_cleanly(tmp_path):
    data, _ = _archive()
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / "cassavaleafdata.zip.part").write_bytes(b"x" * 500)  # not a prefix of the file
    served = _Served(data, ignore_range=True)
    with _serving(served) as url:
        ds = mr.datasets.load("cassava", split="test", data_dir=tmp_path, download=True,
                              download_config=_config(url, data))
    assert served.ranges == ["bytes=500-"]  # asked to resume, got the whole file, started over
    assert len(list(ds)) == 5


def test_wrong_checksum_is_refused_and_deleted(tmp_path):
    data, _ = _archive()
    with _serving(_Served(data)) as url:
        with pytest.raises(ValueError, match=f"expected {'0' * 64} but got {hashlib.sha256(data).hexdigest()}"):
            mr.datasets.load("cassava", data_dir=tmp_path, download=True,
                             download_config=_config(url, data, sha256="0" * 64))
    assert os.listdir(tmp_path / "downloads") == []
    assert not (tmp_path / "cassava" / "0.1.0").exists()


def test_interrupted_prepare_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    data, _ = _archive()
    served = _Served(data)

    def fail(*args, **kwargs):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C while the info files were written

    with _serving(served) as url:
        monkeypatch.setattr(cassava, "write_info", fail)
        with pytest.raises(KeyboardInterrupt):
            mr.datasets.load("cassava", data_dir=tmp_path, download=True, download_config=_config(url, data))
        assert os.listdir(tmp_path / "cassava") == [".prepare.lock"]
        with pytest.raises(FileNotFoundError):
            mr.datasets.load("cassava", data_dir=tmp_path)
        monkeypatch.undo()
        ds = mr.datasets.load("cassava", split="train", data_dir=tmp_path, download=True,
                              download_config=_config(url, data))
    assert len(ds) == 10 and served.ranges == [None]  # the verified archive was reused


def test_unsafe_member_paths_are_refused(tmp_path):
    data, _ = _archive({"cassavaleafdata/../../evil.jpg": b"x"})
    archive = tmp_path / "cassavaleafdata.zip"
    archive.write_bytes(data)
    with pytest.raises(ValueError, match="unsafe path"):
        cassava.prepare(str(archive), str(tmp_path / "cassava"))
    assert os.listdir(tmp_path / "cassava") == []


def test_missing_data_says_where_and_how(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        mr.datasets.load("cassava", data_dir=tmp_path)
    message = str(raised.value)
    assert os.path.join(str(tmp_path), "cassava", "<version>", "dataset_info.json") in message
    assert "download=True" in message and "tfds build cassava" in message and "data_dir=" in message


def test_versions_are_chosen_by_name(fixtures_dir):
    data_dir = fixtures_dir / "tfds"
    ds, info = mr.datasets.load("cassava:0.1.0", split="test", data_dir=data_dir, with_info=True)
    assert info.version == "0.1.0" and len(ds) == 10
    with pytest.raises(FileNotFoundError, match="Prepared versions there: 0.1.0"):
        mr.datasets.load("cassava:0.2.0", data_dir=data_dir)


def test_leftover_version_dir_without_info_is_refused_before_downloading(tmp_path):
    """Regression (review): a `cassava/0.1.0/` without dataset_info.json made every call download
    and prepare everything, then fail with `OSError: [Errno 39] Directory not empty`."""
    data, _ = _archive()
    leftover = tmp_path / "cassava" / "0.1.0"
    leftover.mkdir(parents=True)
    (leftover / "cassava-train.tfrecord-00000-of-00001").write_bytes(b"old")
    served = _Served(data)
    with _serving(served) as url:
        with pytest.raises(FileExistsError) as raised:
            mr.datasets.load("cassava", data_dir=tmp_path, download=True, download_config=_config(url, data))
        message = str(raised.value)
        assert str(leftover) in message and "no dataset_info.json" in message and "rm -r" in message
        assert served.ranges == []  # refused before any request
        assert os.listdir(leftover) == ["cassava-train.tfrecord-00000-of-00001"]  # the user's files stay
        with pytest.raises(FileExistsError, match="no dataset_info.json"):
            cassava.prepare(str(tmp_path / "archive.zip"), str(tmp_path / "cassava"))

        (leftover / "cassava-train.tfrecord-00000-of-00001").unlink()  # an empty one is no loss: replaced
        ds = mr.datasets.load("cassava", split="test", data_dir=tmp_path, download=True,
                              download_config=_config(url, data))
    assert len(ds) == 5 and (leftover / "dataset_info.json").is_file() and served.ranges == [None]


@pytest.mark.parametrize("field, value, words", [
    ("retries", -1, "whole number >= 0"),
    ("retries", 1.5, "whole number >= 0"),
    ("size_bytes", 0, "whole number > 0"),
    ("size_bytes", True, "whole number > 0"),
    ("timeout_s", 0, "seconds > 0"),
    ("timeout_s", "60", "seconds > 0"),
    ("retry_wait_s", -1.0, "seconds >= 0"),
    ("sha256", "abc", "64 hex digits"),
    ("sha256", "g" * 64, "64 hex digits"),
    ("url", "ftp://example.org/cassavaleafdata.zip", "http:// or https://"),
    ("url", "cassavaleafdata.zip", "http:// or https://"),
])
def test_download_config_validates_its_fields(field, value, words, tmp_path):
    """Regression (review): retries=-1 made no request and failed with FileNotFoundError on the
    .part file; each bad field is now a ValueError naming it."""
    with pytest.raises(ValueError, match=rf"DownloadConfig\({field}={value!r}\): .*{words}"):
        cassava.DownloadConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"DownloadConfig\({field}={value!r}\)"):
        mr.datasets.load("cassava", data_dir=tmp_path, download=True, download_config={field: value})
    assert not (tmp_path / "downloads").exists()


def test_download_config_accepts_valid_values():
    config = cassava.DownloadConfig(url="http://127.0.0.1:1/x.zip", size_bytes=1, sha256="A" * 64, retries=0,
                                    retry_wait_s=0, timeout_s=0.5)
    assert config.retries == 0 and cassava.DownloadConfig().size_bytes == 1_354_096_203
