"""File-system helpers shared by the writers (checkpoints, backups, logs, TFRecord shards). Stdlib only.

FileWriteError is the one error of a file the library could not write: write_error() and
reporting_write_errors() word it, naming the file, who wrote it, the OS error, what was kept and the
fix, so a full disk or a read-only folder reads the same from every writer. write_atomically()
writes a small file (a CSV, a JSON list, a Keras archive) through a temporary one and a rename.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno as errno_codes
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

C = TypeVar("C")


def fsync_directory(directory: str) -> None:
    """Flushes a directory entry, so a rename into it survives a crash (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def config_of(cls: type[C], value: C | Mapping[str, Any] | None, arg: str) -> C:
    """`value` as a dataclass config `cls`: None gives the defaults, a dict sets the fields it names."""
    if value is None or isinstance(value, cls):
        return value or cls()
    if not isinstance(value, Mapping):
        raise TypeError(f"{arg} must be a {cls.__name__} or a dict of its fields; got {value!r}.")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{arg}: unknown field(s) {unknown}; {cls.__name__} has {fields}.")
    return cls(**value)


class FileWriteError(OSError):
    """A file the library could not write. An OSError with the errno and filename of the failure (so
    `except OSError` and `e.errno == errno.ENOSPC` still work); its message names the file, the writer
    (the callback or call), the OS error, what was kept, and the fix."""

    def __init__(self, message: str, errno: int | None = None, filename: str | None = None,
                 os_error: str | None = None):
        super().__init__(errno, message, filename)
        self.os_error = os_error or message  # the OS's own words, for a writer above that words it again

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self) -> tuple[Any, ...]:  # (OSError's would rebuild it from (errno, strerror) alone)
        return type(self), (self.strerror, self.errno, self.filename, self.os_error)


# What to do about the usual failures, by errno.
_FIXES = {
    errno_codes.ENOSPC: "Free space on that disk (or write to another), then run again",
    errno_codes.EDQUOT: "Free space within your disk quota (or write elsewhere), then run again",
    errno_codes.EROFS: "That file system is read-only: write to another folder",
    errno_codes.EACCES: "Make the folder writable for this user (or write elsewhere)",
    errno_codes.EPERM: "Make the folder writable for this user (or write elsewhere)",
}


def write_error(error: OSError, path: str | os.PathLike, writer: str, kept: str, fix: str | None = None
                ) -> FileWriteError:
    """The one error for `writer` failing to write `path` with `error` (itself a FileWriteError of a writer
    below, whose OS error is reused). `kept` says what is intact ("The previous backup ... is intact.");
    `fix` what to do (default: by the errno). Raise it `from None`: the message holds all of `error`."""
    if isinstance(error, FileWriteError):
        os_error = error.os_error
    elif error.errno is not None:
        os_error = f"[Errno {error.errno}] {error.strerror or os.strerror(error.errno)}"
    else:
        os_error = f"{type(error).__name__}: {error}"
    fix = fix if fix is not None else _FIXES.get(error.errno, "Check the path and the disk, then run again")
    path = os.fspath(path)
    message = f"{writer}: could not write {path!r} ({os_error}). {kept.strip()} {fix.rstrip('.')}."
    return FileWriteError(message, error.errno, path, os_error)


@contextlib.contextmanager
def reporting_write_errors(path: str | os.PathLike, writer: str, kept: str, fix: str | None = None) -> Iterator[None]:
    """Turns an OSError raised inside the block into write_error(...) for `path`, `writer` and `kept`."""
    try:
        yield
    except OSError as e:
        raise write_error(e, path, writer, kept, fix) from None


def write_atomically(path: str | os.PathLike, writer: str, write: Callable[[str], None], suffix: str = ".tmp",
                     kept: str | None = None, also: str = "") -> None:
    """Writes a file by `write(temporary path)` beside `path`, fsyncs it and renames it over `path`, so a
    failure or a crash leaves the previous file whole. A failed write removes the temporary file and raises
    write_error(...) naming `path`, `writer` and what was kept (`kept`, by default that the file there
    before is intact, then `also`). `suffix` ends the temporary name (a writer may insist on one, as Keras
    on ".keras")."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    existed = os.path.isfile(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}-{uuid.uuid4().hex[:12]}{suffix}")
    try:
        os.makedirs(directory, exist_ok=True)
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if kept is None:
            kept = "The file there before is intact." if existed else "Nothing was written there."
        if os.path.lexists(tmp):
            kept += f" The temporary file {tmp!r} could not be removed."
        raise write_error(e, path, writer, f"{kept} {also}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def append_whole(path: str | os.PathLike, data: bytes, writer: str, kept: str, fd: int | None = None) -> None:
    """Appends `data` to the file at `path` (through `fd` where the writer holds it open) whole or not at all:
    a write that fails (a full disk) is cut back to the file's previous end, so a reader never meets half a
    record, and raises write_error(...) naming `path`, `writer` and what was `kept`."""
    own = fd is None
    try:
        if own:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o666)
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise
    except OSError as e:
        raise write_error(e, path, writer, kept) from None
    finally:
        if own and fd is not None:
            os.close(fd)
