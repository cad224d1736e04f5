"""A private, in-memory `/tmp` for each hook call.

An instance has no filesystem at all (no preopened directory): this module gives hooks the one
directory they commonly expect, kept in the instance's own memory. So it starts empty in every
instance (the snapshot holds an empty one), it counts against the hook's memory limit (a hook that
writes too much gets `MemoryError`, like any other allocation), and it is gone with the instance.
Nothing written here can reach another hook, another trigger point, or the host.

What works under `/tmp`: `open()` in every mode (text and binary, `r`, `w`, `a`, `x`, `+`), and
`os.listdir`, `os.stat` (so `os.path.exists`, `isfile`, `isdir`, `getsize`), `os.mkdir`,
`os.makedirs`, `os.remove`/`os.unlink`, `os.rmdir`, `os.rename`/`os.replace`. Any other path fails
as before: there is no other file.
"""

import builtins
import errno
import io
import os
import stat

ROOT = "/tmp"

_files = {}  # absolute path -> bytes
_dirs = {ROOT}
_open = builtins.open
_os = {name: getattr(os, name) for name in (
    "listdir", "stat", "lstat", "mkdir", "remove", "unlink", "rmdir", "rename", "replace",
)}


def _path(file):
    """The normalised absolute path under /tmp that `file` names, or None when it is elsewhere."""
    if isinstance(file, int):
        return None
    try:
        file = os.fspath(file)
    except TypeError:
        return None
    if isinstance(file, bytes):
        file = file.decode("utf-8", "surrogateescape")
    path = os.path.normpath(file if file.startswith("/") else "/" + file)
    if path == ROOT or path.startswith(ROOT + "/"):
        return path
    return None


def _error(code, path):
    return OSError(code, os.strerror(code), path)


def _parent_exists(path):
    if os.path.dirname(path) not in _dirs:
        raise _error(errno.ENOENT, path)


class _File(io.BytesIO):
    """A file's bytes while it is open; written back on flush and close."""

    def __init__(self, path, data, writable):
        super().__init__(data)
        self.name = path
        self._path = path
        self._writable = writable

    def writable(self):
        return self._writable and not self.closed

    def write(self, b):
        if not self._writable:
            raise io.UnsupportedOperation("not writable")
        return super().write(b)

    def flush(self):
        super().flush()
        if self._writable and not self.closed:
            _files[self._path] = self.getvalue()

    def close(self):
        if not self.closed:
            self.flush()
        super().close()


class _Appending(_File):
    def write(self, b):
        self.seek(0, io.SEEK_END)
        return super().write(b)


def sandbox_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True, opener=None):
    path = _path(file)
    if path is None:
        return _open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    kinds = set(mode) - {"b", "t", "+"}
    if len(kinds) != 1 or not kinds <= set("rwax") or ("b" in mode and "t" in mode):
        raise ValueError(f"invalid mode: {mode!r}")
    kind = kinds.pop()
    if path in _dirs:
        raise _error(errno.EISDIR, path)
    exists = path in _files
    if kind == "r" and not exists:
        raise _error(errno.ENOENT, path)
    if kind == "x" and exists:
        raise _error(errno.EEXIST, path)
    _parent_exists(path)
    data = b"" if kind in "wx" else _files.get(path, b"")
    writable = kind != "r" or "+" in mode
    if kind in "wx" or (kind == "a" and not exists):
        _files[path] = b""
    raw = (_Appending if kind == "a" else _File)(path, data, writable)
    if kind == "a":
        raw.seek(0, io.SEEK_END)
    if "b" in mode:
        return raw
    text = io.TextIOWrapper(raw, encoding=encoding or "utf-8", errors=errors, newline=newline, write_through=True)
    text.mode = mode
    return text


def listdir(path="."):
    p = _path(path)
    if p is None:
        return _os["listdir"](path)
    if p not in _dirs:
        raise _error(errno.ENOTDIR if p in _files else errno.ENOENT, p)
    prefix = p + "/"
    names = {q[len(prefix):].split("/")[0] for q in list(_files) + list(_dirs) if q.startswith(prefix)}
    return sorted(names)


def _stat(path, *args, **kwargs):
    p = _path(path)
    if p is None:
        return _os["stat"](path, *args, **kwargs)
    if p in _dirs:
        return os.stat_result((stat.S_IFDIR | 0o700, 0, 0, 2, 0, 0, 0, 0, 0, 0))
    if p in _files:
        return os.stat_result((stat.S_IFREG | 0o600, 0, 0, 1, 0, 0, len(_files[p]), 0, 0, 0))
    raise _error(errno.ENOENT, p)


def mkdir(path, mode=0o777, *args, **kwargs):
    p = _path(path)
    if p is None:
        return _os["mkdir"](path, mode, *args, **kwargs)
    if p in _dirs or p in _files:
        raise _error(errno.EEXIST, p)
    _parent_exists(p)
    _dirs.add(p)


def remove(path, *args, **kwargs):
    p = _path(path)
    if p is None:
        return _os["remove"](path, *args, **kwargs)
    if p in _dirs:
        raise _error(errno.EISDIR, p)
    if _files.pop(p, None) is None:
        raise _error(errno.ENOENT, p)


def rmdir(path, *args, **kwargs):
    p = _path(path)
    if p is None:
        return _os["rmdir"](path, *args, **kwargs)
    if p not in _dirs:
        raise _error(errno.ENOTDIR if p in _files else errno.ENOENT, p)
    if p == ROOT or listdir(p):
        raise _error(errno.EBUSY if p == ROOT else errno.ENOTEMPTY, p)
    _dirs.discard(p)


def replace(src, dst, *args, **kwargs):
    s, d = _path(src), _path(dst)
    if s is None and d is None:
        return _os["replace"](src, dst, *args, **kwargs)
    if s is None or d is None:
        raise _error(errno.EXDEV, s or d)
    if s not in _files:
        raise _error(errno.EISDIR if s in _dirs else errno.ENOENT, s)
    if d in _dirs:
        raise _error(errno.EISDIR, d)
    _parent_exists(d)
    _files[d] = _files.pop(s)


def install():
    """Puts /tmp in place: called once, while the snapshot is made."""
    builtins.open = io.open = sandbox_open
    os.listdir = listdir
    os.stat = os.lstat = _stat
    os.mkdir = mkdir
    os.remove = os.unlink = remove
    os.rmdir = rmdir
    os.rename = os.replace = replace
