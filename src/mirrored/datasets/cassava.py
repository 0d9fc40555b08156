"""`cassava`: download the Cassava leaf archive and prepare it as TFDS' `cassava` 0.1.0 does.

download_and_prepare(data_dir) fetches cassavaleafdata.zip (1,354,096,203 bytes) into
`<data_dir>/downloads/`, resuming from a `.part` file with HTTP Range requests, checks its size and
sha256, and writes `<data_dir>/cassava/0.1.0/`: dataset_info.json, features.json, label.labels.txt
and TFRecord shards, in TFDS' layout, record format and record order, so TFDS reads it and
`PreparedDataset` reads TFDS' own. The real archive gives train 5,656, test 1,885 and validation
1,889 images of 5 classes (cbb, cbsd, cgm, cmd, healthy). Uses urllib, zipfile and mirrored.data.

Decisions: images are read straight from the zip (never extracted), so no member name reaches the
file system and zip-slip cannot happen; names with absolute or '..' parts are refused anyway. A
download whose size or sha256 is wrong is deleted (resuming it could not fix it) and the error
gives both values. Preparing happens in a hidden temporary directory renamed into place at the end,
under a lock file, so an interrupted prepare never leaves a directory that looks complete and two
processes sharing a data_dir prepare once. A `0.1.0/` that exists without dataset_info.json (copied
in part) is refused before anything is downloaded, and never deleted: it may hold the user's files.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import posixpath
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from http.client import HTTPException
from typing import Any

from tqdm import tqdm

from mirrored._files import config_of
from mirrored.data.tfds import (ClassLabel, DatasetInfo, FeaturesDict, Image, SplitDict, Text, find_version_dir,
                                write_info, write_split)
from mirrored.data.tfrecord import encode_example

logger = logging.getLogger(__name__)

__all__ = ["LABELS", "NAME", "SPLITS", "VERSION", "DownloadConfig", "download", "download_and_prepare", "prepare"]

NAME, VERSION = "cassava", "0.1.0"
LABELS = ("cbb", "cbsd", "cgm", "cmd", "healthy")
SPLITS = ("train", "test", "validation")
_ARCHIVE_ROOT = "cassavaleafdata"  # cassavaleafdata/<split>/<class>/<name>.jpg inside the zip
_CHUNK_BYTES = 1 << 20
_HASH_CHUNK_BYTES = 8 << 20
_EXAMPLE_OVERHEAD_BYTES = 64  # Example framing around the JPEG bytes, to size shards before writing
_HOMEPAGE = "https://www.kaggle.com/c/cassava-disease/overview"
_DESCRIPTION = ("Cassava leaf images: healthy leaves and four diseases, Cassava Mosaic Disease (CMD), Cassava "
                "Bacterial Blight (CBB), Cassava Green Mite (CGM) and Cassava Brown Streak Disease (CBSD); "
                "9,430 labelled images split into train (5,656), test (1,885) and validation (1,889).")
_CITATION = """@misc{mwebaze2019icassava,
    title={iCassava 2019Fine-Grained Visual Categorization Challenge},
    author={Ernest Mwebaze and Timnit Gebru and Andrea Frome and Solomon Nsumba and Jeremy Tusubira},
    year={2019},
    eprint={1908.02900},
    archivePrefix={arXiv},
    primaryClass={cs.CV}
}"""


@dataclasses.dataclass(frozen=True)
class DownloadConfig:
    """Where the archive comes from and how to fetch it; the defaults are the real archive's.

    Pass `load("cassava", download=True, download_config={...})` with any of these fields, e.g. a
    mirror's url (same size and sha256), or a local test server's url, size and sha256.
    """

    url: str = "https://storage.googleapis.com/emcassavadata/cassavaleafdata.zip"
    size_bytes: int = 1_354_096_203
    sha256: str = "8ae63d2ef7dee0899d252a748523e603f97e2ae7022f103f92fc42a9fce74d95"
    retries: int = 3  # after a dropped connection, resume from the .part file this many times
    retry_wait_s: float = 2.0  # doubled after each retry
    timeout_s: float = 60.0  # for the connection and for each read
    progress: bool = True  # a tqdm bar on stderr

    def __post_init__(self) -> None:
        # Checked here, not where used: retries=-1 would skip every request and fail on a missing
        # .part file, a bad sha256 only after the whole download.
        url = urllib.parse.urlsplit(self.url) if isinstance(self.url, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"DownloadConfig(url={self.url!r}): give an http:// or https:// url of the "
                             "archive (the official one, a mirror's, or a local server's).")
        if not _is_int(self.size_bytes) or self.size_bytes <= 0:
            raise ValueError(f"DownloadConfig(size_bytes={self.size_bytes!r}): give the archive's size in bytes, "
                             "a whole number > 0 (the real archive's is 1354096203).")
        if not isinstance(self.sha256, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", self.sha256):
            raise ValueError(f"DownloadConfig(sha256={self.sha256!r}): give the archive's sha256 as 64 hex "
                             "digits, as `sha256sum cassavaleafdata.zip` prints it.")
        if not _is_int(self.retries) or self.retries < 0:
            raise ValueError(f"DownloadConfig(retries={self.retries!r}): give how many times a dropped download "
                             "is resumed, a whole number >= 0 (0: fail at the first error).")
        if not _is_number(self.retry_wait_s) or self.retry_wait_s < 0:
            raise ValueError(f"DownloadConfig(retry_wait_s={self.retry_wait_s!r}): give seconds >= 0 to wait "
                             "before the first retry (doubled after each).")
        if not _is_number(self.timeout_s) or not self.timeout_s > 0:
            raise ValueError(f"DownloadConfig(timeout_s={self.timeout_s!r}): give seconds > 0 to wait for the "
                             "connection and for each read.")

    @classmethod
    def of(cls, value: DownloadConfig | Mapping[str, Any] | None) -> DownloadConfig:
        """`value` as a DownloadConfig: None gives the defaults, a dict sets the fields it names."""
        return config_of(cls, value, "download_config")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Progress(tqdm):
    monitor_interval = 0  # tqdm's monitor thread would outlive the download


# ------------------------------------------------------------------------------------ download


def download(config: DownloadConfig, path: str) -> None:
    """Fetches config.url to `path` (through `path`.part, resumed across retries and calls) and
    verifies its size and sha256; a file that fails verification is deleted."""
    part = path + ".part"
    for attempt in range(config.retries + 1):
        try:
            _fetch(config, part)
            break
        except urllib.error.HTTPError as e:
            raise ConnectionError(f"download {config.url}: the server answered HTTP {e.code} {e.reason}. Check "
                                  "the url (download_config={'url': ...}) or try again later.") from e
        except (OSError, HTTPException) as e:
            have = os.path.getsize(part) if os.path.exists(part) else 0
            if attempt == config.retries:
                raise ConnectionError(
                    f"download {config.url}: {e} (after {attempt + 1} attempt(s)). {part} keeps the {have:,} "
                    f"of {config.size_bytes:,} bytes received; the next call resumes from there.") from e
            wait_s = config.retry_wait_s * 2 ** attempt
            logger.warning("download %s: %s at byte %d; resuming in %.0f s", config.url, e, have, wait_s)
            time.sleep(wait_s)
    _verify(config, part)
    os.replace(part, path)


def _fetch(config: DownloadConfig, part: str) -> None:
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have > config.size_bytes:
        os.remove(part)  # longer than the archive: not a prefix of it
        have = 0
    if have == config.size_bytes:
        return  # complete: _verify checks it
    request = urllib.request.Request(config.url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=config.timeout_s)
    except urllib.error.HTTPError as e:
        if e.code != 416 or not have:
            raise
        e.close()
        os.remove(part)  # 416: the server has nothing after our bytes, so they are not its file's
        return _fetch(config, part)
    with response:
        start = _resume_offset(response, have)
        with open(part, "r+b" if start else "wb") as f, _Progress(
                total=config.size_bytes, initial=start, unit="B", unit_scale=True, unit_divisor=1024,
                desc=posixpath.basename(config.url), disable=not config.progress) as bar:
            f.seek(start)
            f.truncate()
            written = start
            while chunk := response.read(_CHUNK_BYTES):
                written += len(chunk)
                if written > config.size_bytes:
                    raise ValueError(f"download {config.url}: the server sent more than the expected "
                                     f"{config.size_bytes:,} bytes; check download_config's url and size_bytes.")
                f.write(chunk)
                bar.update(len(chunk))
    if written < config.size_bytes:
        # http.client returns b"" when a connection drops before Content-Length: not an error there.
        raise ConnectionError(f"the connection closed after {written:,} of {config.size_bytes:,} bytes")


def _resume_offset(response: Any, have: int) -> int:
    """Where the body of `response` starts in the file: `have` for a matching 206, else 0."""
    if not have:
        return 0
    if response.status == 206 and (response.headers.get("Content-Range") or "").startswith(f"bytes {have}-"):
        return have
    logger.info("the server ignored the Range request (HTTP %s); downloading from the start", response.status)
    return 0


def _verify(config: DownloadConfig, path: str) -> None:
    size = os.path.getsize(path)
    if size != config.size_bytes:
        os.remove(path)
        raise ValueError(f"download {config.url}: got {size:,} bytes but expected {config.size_bytes:,}; the file "
                         "was deleted. Check download_config's url and size_bytes, then retry.")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    if digest.hexdigest() != config.sha256.lower():
        os.remove(path)
        raise ValueError(f"download {config.url}: sha256 mismatch, expected {config.sha256} but got "
                         f"{digest.hexdigest()}; the file was deleted. The download was corrupted or the "
                         "archive changed: retry, or check download_config's url and sha256.")


# ------------------------------------------------------------------------------------- prepare


def _archive_members(archive: zipfile.ZipFile, archive_path: str) -> dict[str, list[tuple[str, zipfile.ZipInfo, int]]]:
    """{split: [(key = file name, member, label)]} from cassavaleafdata/<split>/<class>/<name>.jpg."""
    found: dict[str, list[tuple[str, zipfile.ZipInfo, int]]] = {split: [] for split in SPLITS}
    for member in archive.infolist():
        name = member.filename
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or ".." in parts or ":" in parts[0]:
            raise ValueError(f"{archive_path}: member {name!r} has an unsafe path (absolute or with '..'); "
                             "refusing the archive. Download it again from the official url.")
        if member.is_dir() or len(parts) != 4 or parts[0] != _ARCHIVE_ROOT or parts[1] not in SPLITS:
            continue
        if parts[3].startswith(".") or not parts[3].lower().endswith(".jpg"):
            continue  # TFDS' builder globs *.jpg
        if parts[2] not in LABELS:
            raise ValueError(f"{archive_path}: {name!r} is in class folder {parts[2]!r}, not one of "
                             f"{', '.join(LABELS)}; is this the Cassava leaf archive?")
        found[parts[1]].append((parts[3], member, LABELS.index(parts[2])))
    empty = [split for split, items in found.items() if not items]
    if empty:
        raise ValueError(f"{archive_path}: no images in {', '.join(f'{_ARCHIVE_ROOT}/{s}/<class>/*.jpg' for s in empty)}; "
                         "is this the Cassava leaf archive? Delete it and download again.")
    return found


def _info(splits: SplitDict, download_size: int) -> DatasetInfo:
    return DatasetInfo(
        name=NAME, version=VERSION, splits=splits, supervised_keys=("image", "label"),
        features=FeaturesDict({"image": Image((None, None, 3)), "image/filename": Text(),
                               "label": ClassLabel(names=list(LABELS))}),
        description=_DESCRIPTION, citation=_CITATION, homepage=_HOMEPAGE, download_size=download_size,
        module_name="tensorflow_datasets.image_classification.cassava")


def prepare(archive_path: str, dataset_dir: str) -> str:
    """Writes `<dataset_dir>/0.1.0/` from the archive, atomically; returns that directory."""
    final = os.path.join(dataset_dir, VERSION)
    _check_no_leftover(final)
    tmp = os.path.join(dataset_dir, f".{VERSION}.incomplete-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    try:
        with zipfile.ZipFile(archive_path) as archive:
            members = _archive_members(archive, archive_path)
            splits = SplitDict()
            for split in SPLITS:
                by_key = {key: (member, label) for key, member, label in members[split]}
                if len(by_key) != len(members[split]):
                    raise ValueError(f"{archive_path}: two images of split {split!r} share a file name; TFDS "
                                     "keys examples by file name, so the archive cannot be prepared as TFDS does.")

                def encode(key: str, by_key=by_key) -> bytes:
                    member, label = by_key[key]
                    return encode_example({"image": archive.read(member),  # the JPEG as stored: not re-encoded
                                           "image/filename": key.encode(), "label": label})

                total = sum(m.file_size + len(k) + _EXAMPLE_OVERHEAD_BYTES for k, m, _ in members[split])
                splits[split] = write_split(tmp, NAME, split, list(by_key), encode, total_bytes=total)
                logger.info("cassava: wrote %s (%d examples, %d shards)", split, splits[split].num_examples,
                            splits[split].num_shards)
        write_info(tmp, _info(splits, os.path.getsize(archive_path)))
        os.rename(tmp, final)  # the directory appears complete, or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _check_no_leftover(final: str) -> None:
    """Raises where `final` exists but is not a prepared dataset (no dataset_info.json: half-copied,
    or left by another tool): the prepared directory could not be renamed onto it. An empty one is
    removed, as nothing is lost; anything else may be the user's, so it is never deleted here."""
    if not os.path.lexists(final) or os.path.isfile(os.path.join(final, "dataset_info.json")):
        return
    if os.path.isdir(final) and not os.path.islink(final):
        entries = sorted(os.listdir(final))
        if not entries:
            os.rmdir(final)
            return
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        held = f"holds {shown} but no dataset_info.json"
    else:
        held = "is not a directory"
    raise FileExistsError(f"cassava: {final} {held}, so it is not a prepared dataset (a half-copied one, or "
                          "left by another tool), and the prepared dataset cannot be put there. Delete or move "
                          f"it (e.g. `rm -r {final}`), then download and prepare again; it was left untouched.")


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on the file `path` (POSIX flock; no lock where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: concurrent prepares are not guarded there
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def download_and_prepare(data_dir: str, download_config: DownloadConfig | Mapping[str, Any] | None = None) -> str:
    """Makes `<data_dir>/cassava/0.1.0/` exist (downloading and preparing it if needed); returns it."""
    config = DownloadConfig.of(download_config)
    dataset_dir = os.path.join(data_dir, NAME)
    os.makedirs(dataset_dir, exist_ok=True)
    with _locked(os.path.join(dataset_dir, ".prepare.lock")):
        done = find_version_dir(dataset_dir, VERSION)
        if done is not None:  # another process prepared it while we waited for the lock
            return done
        for name in os.listdir(dataset_dir):
            if name.startswith(f".{VERSION}.incomplete-"):  # left by an interrupted prepare; we hold the lock
                shutil.rmtree(os.path.join(dataset_dir, name), ignore_errors=True)
        _check_no_leftover(os.path.join(dataset_dir, VERSION))  # before the download, not after it
        downloads = os.path.join(data_dir, "downloads")
        os.makedirs(downloads, exist_ok=True)
        archive = os.path.join(downloads, posixpath.basename(config.url.split("?")[0]) or "cassavaleafdata.zip")
        if os.path.exists(archive):
            try:
                _verify(config, archive)  # a copy placed by hand, or one that went bad since
            except ValueError as e:
                logger.warning("%s; downloading it again", e)
        if not os.path.exists(archive):
            logger.info("cassava: downloading %s (%s bytes) to %s", config.url, f"{config.size_bytes:,}", archive)
            download(config, archive)
        logger.info("cassava: preparing %s into %s", archive, dataset_dir)
        return prepare(archive, dataset_dir)
