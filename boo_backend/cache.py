"""Compile cache, in memory and on disk. A leaf: imports nothing else from boo_backend.

Each entry is a file `<key>.<kind>` holding a small header and the payload:

    b"BOO1" | sha256(payload) (32 bytes) | payload

A file whose header or checksum does not match is reported, deleted and rebuilt, never
loaded. Files are written to a temporary name in the same directory and renamed into place,
so a concurrent reader sees either no file or a whole one.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

log = logging.getLogger("boo_backend")

_MAGIC = b"BOO1"
_HEADER = len(_MAGIC) + 32

# Process-wide counters; tests read them through boo_backend.stats().
STATS: collections.Counter = collections.Counter()


@contextlib.contextmanager
def timed(stage: str):
    """Add the seconds the block takes to STATS[f"{stage}_s"] (boo_backend.stats())."""
    start = time.perf_counter()
    try:
        yield
    finally:
        STATS[f"{stage}_s"] += time.perf_counter() - start
# Process-wide memory cache shared by every CompileCache.
_MEMORY: dict[str, bytes] = {}


def _source_digest() -> str:
    """boo's own code and kernel templates: a cached lowering is only as good as the code
    that made it, and the package version does not move with every change."""
    import importlib.resources

    h = hashlib.sha256()
    roots = [importlib.resources.files("boo_backend"), importlib.resources.files("boo_backend.kernels")]
    for root in roots:
        for entry in sorted(root.iterdir(), key=lambda e: e.name):
            if entry.name.endswith((".py", ".mlir")):
                h.update(entry.name.encode())
                h.update(entry.read_bytes())
        composites = root / "composites"
        if composites.is_dir():
            for entry in sorted(composites.iterdir(), key=lambda e: e.name):
                if entry.name.endswith(".py"):
                    h.update(entry.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def cpu_model() -> str:
    """The host CPU's model name, as lscpu prints it ("AMD EPYC ..."; lscpu reads it from
    /proc/cpuinfo too). Timings and the decisions made from them (extern.py, the runtime
    driver) are only valid on it; the benchmarks record it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def tool_versions() -> str:
    """Versions that change what a compile produces."""
    parts = []
    for dist in ("boo-backend", "torch", "torch-mlir", "iree-base-compiler", "iree-base-runtime"):
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist}=?")
    parts.append(f"boo-source={_source_digest()}")
    return ";".join(parts)


@functools.cache
def host_id() -> str:
    """The host CPU: what a CPU module is compiled for, and what timings were taken on."""
    parts = [f"machine={platform.machine()}", f"cpu={cpu_model()}"]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
        parts.append("cpu-flags=" + hashlib.sha256(flags.encode()).hexdigest()[:16])
    except OSError:
        pass
    return ";".join(parts)


@functools.cache
def private_directory(directory: Path) -> bool:
    """Whether `directory` is safe to keep executable code in: made here private to the user
    (0700), or already there, owned by the user and writable by nobody else. Anything else is
    refused once per process with a warning: another user could plant a module we would run."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError as e:
        log.warning("boo cache: cannot create %s (%s); the compile cache is off", directory, e)
        return False
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        log.warning(
            "boo cache: %s belongs to another user (uid %d); the compile cache is off for this "
            "process. Set BOO_CACHE_DIR to a directory of your own", directory, st.st_uid,
        )
        return False
    if st.st_mode & 0o022:
        log.warning(
            "boo cache: %s is writable by other users (mode %o); the compile cache is off for "
            "this process. Run chmod 700 on it or set BOO_CACHE_DIR to a private directory",
            directory, st.st_mode & 0o777,
        )
        return False
    if st.st_mode & 0o077:
        try:  # ours, made by an older boo as 0755: keep what we write private from now on
            directory.chmod(0o700)
        except OSError:
            pass
    return True


class CompileCache:
    """Keyed blobs. `enabled=False` turns off both the memory and the disk layer; the disk
    layer is also off when the directory is not private (see private_directory)."""

    def __init__(self, directory: Path, enabled: bool = True):
        self.directory = Path(directory).expanduser().absolute()
        self.enabled = enabled
        self.disk = enabled and private_directory(self.directory)
        self.stats = STATS

    @staticmethod
    def key(kind: str, *parts: str, host: bool = True) -> str:
        """The entry's name: a hash of the tools' versions and `parts`, and of the host CPU
        unless `host` is False (a GPU module does not depend on the CPU that compiled it, so
        a cache filled by cross-compiling serves the machine with the GPU)."""
        h = hashlib.sha256(tool_versions().encode())
        if host:
            h.update(b"\0host\0" + host_id().encode())
        for part in parts:
            h.update(b"\0")
            h.update(str(part).encode())
        return f"{h.hexdigest()}.{kind}"

    def _path(self, key: str) -> Path:
        return self.directory / key

    def get(self, key: str) -> bytes | None:
        if not self.enabled:
            return None
        blob = _MEMORY.get(key)
        if blob is not None:
            self.stats["cache_hits_memory"] += 1
            return blob
        if not self.disk:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("boo cache: cannot read %s (%s); rebuilding", path, e)
            return None
        payload = data[_HEADER:]
        if (
            len(data) < _HEADER
            or data[: len(_MAGIC)] != _MAGIC
            or hashlib.sha256(payload).digest() != data[len(_MAGIC) : _HEADER]
        ):
            log.warning("boo cache: %s is truncated or corrupted; deleting and rebuilding", path)
            self.stats["cache_corrupt"] += 1
            try:
                path.unlink()
            except OSError:
                pass
            return None
        self.stats["cache_hits_disk"] += 1
        _MEMORY[key] = payload
        return payload

    def put(self, key: str, payload: bytes) -> None:
        if not self.enabled:
            return
        _MEMORY[key] = payload
        if not self.disk:
            return
        try:
            write_atomic(self._path(key), _MAGIC + hashlib.sha256(payload).digest() + payload, sync=True)
        except OSError as e:
            log.warning("boo cache: cannot write to %s (%s); continuing without it", self.directory, e)

    def get_json(self, key: str):
        blob = self.get(key)
        return None if blob is None else json.loads(blob)

    def put_json(self, key: str, value) -> None:
        self.put(key, json.dumps(value, sort_keys=True).encode())


def write_atomic(path: Path, data: bytes | str, sync: bool = False) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place: a reader
    (or a crash) never sees half a file."""
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix="-" + path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def clear_memory() -> None:
    """Forget the in-memory layer (tests use this to simulate a new process)."""
    _MEMORY.clear()
