"""Writing a file atomically: a temporary file in the same folder, then one rename.

The temporary file is ``.<name>.<16 hex digits>.lamina-tmp`` beside the target. It is written,
flushed and `fsync`ed, then `os.replace`d onto the target (atomic on POSIX and Windows when
both lie on one file system, which the shared folder guarantees), and the folder is `fsync`ed
so that the rename itself survives a power cut. Until the rename the target keeps its old
contents, whole; if the writer dies first, the temporary file stays behind.

Such strays are removed by the next save into the same folder, whatever its target (so the
strays of step-numbered checkpoints do not stay for good). A writer holds an exclusive `flock`
on its temporary file while it writes, and the kernel drops the lock when the process dies,
however it dies: a stray whose lock can be taken belongs to a dead writer; one whose lock is
held belongs to a save still running (in another thread or process) and is left alone. Where
`fcntl` is missing (Windows) strays are left; they never shadow a target.

`reserve` allocates the file's blocks before anything is written (`posix_fallocate`), so that
a full disk or a file-size limit is an `OSError` at once, never a `SIGBUS` while a memory map
of the file is written; where the file system cannot reserve, the caller writes with
`pwrite_all`, whose failures are `OSError`s too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from collections.abc import Iterator
from typing import IO

try:
    import fcntl
except ImportError:  # Windows: no flock; strays are left in place
    fcntl = None  # type: ignore[assignment]

_SUFFIX = ".lamina-tmp"


_STRAY = re.compile(r"\..+\.[0-9a-f]{16}" + re.escape(_SUFFIX))


def remove_strays(path: str) -> list[str]:
    """Removes the temporary files that dead writers left in the folder of `path`.

    Every save's strays count, whatever file it was writing: a stray of ``step_100`` is
    removed by the save of ``step_200``.

    Args:
        path: A file in the folder to clean (the target of the save that cleans).

    Returns:
        The paths removed.
    """
    if fcntl is None:
        return []
    folder = os.path.dirname(os.path.abspath(path))
    pattern, removed = _STRAY, []
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    for entry in entries:
        if not pattern.fullmatch(entry):
            continue
        stray = os.path.join(folder, entry)
        try:
            fd = os.open(stray, os.O_RDWR)
        except OSError:
            continue  # removed meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live writer holds it
            continue
        try:
            os.unlink(stray)
            removed.append(stray)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing releases the lock
    return removed


def _create_locked(folder: str, name: str) -> tuple[str, int]:
    """Creates and locks a fresh temporary file; retries if a cleaner removed it meanwhile."""
    while True:
        temp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}{_SUFFIX}")
        # 0o666 and the user's umask: the final file gets the permissions open() would give
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        if fcntl is None:
            return temp, fd
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(temp)):
                return temp, fd
        except FileNotFoundError:
            pass
        os.close(fd)  # a cleaner took it between creation and lock: start again


def check_target(path: object, where: str, *, writable: bool = True) -> str:
    """`path` as a string, once it is known that `atomic_file` can write it (else `OSError`).

    What a writer checks before it computes anything, so that a path that cannot be written
    fails at once: `FileNotFoundError` (no such folder), `IsADirectoryError` (the path is a
    folder), `PermissionError` (the folder is not writable, unless `writable` is False); each
    message starts with `where` and names the path.

    Args:
        path: The target file (a ``str`` or ``os.PathLike``).
        where: The caller's name, for messages (``"lm.save"``).
        writable: Also check that the folder is writable (a caller that reports a failed
            write itself, as `lm.save`'s `CheckpointError`, passes False).

    Returns:
        The path as a string.

    Example:
        >>> import tempfile
        >>> from lamina.io._atomic import check_target
        >>> folder = tempfile.mkdtemp()
        >>> check_target(folder, "lm.save")
        Traceback (most recent call last):
        IsADirectoryError: lm.save: ... is a folder; give a file name inside it
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a file path (str), got {type(path).__name__}.")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"{where}: path must be a file path (str), got bytes {path!r}.")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{where}: {path} is a folder; give a file name inside it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"{where}: the folder {folder} does not exist (create it first); nothing was "
            f"written to {path}"
        )
    if writable and not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{where}: the folder {folder} is not writable; nothing was written")
    return path


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[IO[bytes]]:
    """Opens a temporary file that replaces `path` when the block ends without an exception.

    On an exception the temporary file is removed and `path` is untouched.

    Args:
        path: The target; its folder must exist.

    Yields:
        The temporary file, open for binary reading and writing, empty.
    """
    folder, name = os.path.split(os.path.abspath(path))
    remove_strays(path)
    temp, fd = _create_locked(folder, name)
    try:
        with os.fdopen(fd, "r+b") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
            if fcntl is not None:
                os.replace(temp, path)  # still under our lock: no cleaner can take it
        if fcntl is None:
            os.replace(temp, path)  # Windows renames only closed files
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _sync_folder(folder)


# What posix_fallocate answers where the file system cannot reserve space (the function itself
# is missing on macOS and Windows).
_CANNOT_RESERVE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", 0)}


def reserve(fd: int, size: int) -> bool:
    """Allocates `size` bytes of disk for the file `fd`, so that writes into them cannot fail.

    Args:
        fd: The file, open for writing.
        size: Its final size in bytes.

    Returns:
        True if the space is reserved (a memory map of the file can be written safely); False
        if the file system cannot reserve space: write with `pwrite_all` then.

    Raises:
        OSError: If the space is not there: ``ENOSPC`` (disk full), ``EDQUOT`` (quota),
            ``EFBIG`` (a file-size limit).
    """
    if size == 0:
        return True
    if not hasattr(os, "posix_fallocate"):
        return False
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno in _CANNOT_RESERVE:
            return False
        raise
    return True


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Writes all of `data` at `offset` (a short write is continued; its error surfaces)."""
    view = memoryview(data).cast("B")
    while view:
        if hasattr(os, "pwrite"):
            written = os.pwrite(fd, view, offset)
        else:  # Windows
            os.lseek(fd, offset, os.SEEK_SET)
            written = os.write(fd, view)
        if written == 0:  # never for a regular file; would otherwise loop forever
            raise OSError(errno.EIO, "the file accepted no bytes")
        view, offset = view[written:], offset + written


def pread(fd: int, size: int, offset: int) -> bytes:
    """Up to `size` bytes at `offset` (fewer only at the end of the file)."""
    if hasattr(os, "pread"):
        return os.pread(fd, size, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # Windows
    return os.read(fd, size)


def _sync_folder(folder: str) -> None:
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename is still atomic
    finally:
        os.close(fd)
