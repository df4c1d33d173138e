"""Writing the files vramswap creates at paths a user names (dump_snapshot, the benchmark's
results and plots) so that another local user cannot redirect them: the rule of
src/stats/stats_file.h, which writes VRAMSWAP_STATS_FILE, in Python.

- A regular file, or nothing yet, is replaced atomically: the data goes to a temporary file
  beside it whose name is random, created exclusively (O_EXCL, which also refuses a
  symbolic link at that name), then renamed over the path.
- A symbolic link at the path is followed to what it names when this user or root owns it
  (the link stays a link); another user's link is an error. Python resolves nothing here
  the kernel would check: the kernel's fs.protected_symlinks refuses another user's link in
  a shared directory such as /tmp only when the kernel itself follows it.
- Anything else the path names (a FIFO, a character device) is written in place, never
  replaced; a directory is an error.
"""
import os
import secrets
import stat
from pathlib import Path


class UnsafePathError(OSError):
    """The path is a symbolic link that another user owns, or a chain of 40 links."""


def _follow_own_links(path):
    path = Path(path)
    for _ in range(40):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return path
        if not stat.S_ISLNK(st.st_mode):
            return path
        if st.st_uid not in (os.geteuid(), 0):
            raise UnsafePathError(
                f"{path}: a symbolic link owned by another user (uid {st.st_uid}); not followed, "
                "so that nobody else chooses what this file overwrites")
        path = path.parent / os.readlink(path)
    raise UnsafePathError(f"{path}: too many levels of symbolic links")


def write_file(path, data):
    """Writes `data` (bytes or str, str as UTF-8) to `path` by the rule above. Returns the
    path written. Raises OSError (UnsafePathError for another user's link)."""
    if isinstance(data, str):
        data = data.encode()
    target = _follow_own_links(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{target}: is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        fd = os.open(target, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        temporary = target.with_name(f"{target.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(temporary, flags, 0o644)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{target}: no free temporary name beside it")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return Path(path)
