"""On-disk build cache shared by the C and CUDA code generators.

    path = cached_build(source, suffix=".so", flags=[...], build=compile_fn, tag="gcc 12.2")

The key is a sha256 over the source, the flags and the tag (callers put the compiler's identity
in the tag). `<cache_dir>/<key><suffix>` is the artifact and `<key><suffix>.sum` its checksum
record (JSON: size and sha256 of the artifact, written when it was built). An artifact is returned
without building only when it matches its record: a truncated or zero-length artifact (disk full,
a killed build, a crash mid-copy), or one without a record, is rebuilt and replaced, so it never
reaches the loader (where a truncated shared library crashes the process with SIGBUS).

Building: the source is written to a private temporary directory, `build(src, out)` is called to
produce `out`, `out` is fsync'ed, checksummed and moved into place with `os.replace`, then the
record is written the same way (temporary name, fsync, `os.replace`). A reader never sees a
half-written file, and an artifact whose record is missing (a crash between the two renames) is
just rebuilt. Builds of the same key are serialized across processes (and threads) by an
`fcntl.flock` on `<key>.lock`; the loser of the race waits, then finds the artifact verified and
returns it.

Only files of this naming scheme (`<40 hex digits><suffix>`, `.sum`, `.lock`, the source, and
the `.<key>.*` temporary directories) are ever written, replaced or removed in the cache
directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
import threading
from typing import Callable, Iterator

try:  # POSIX only; without it builds still work, just without cross-process serialization.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

CACHE_ENV = "PICOMPILE_CACHE_DIR"
# Bump when the layout or meaning of cached artifacts changes. (The checksum records were added
# without a bump: an artifact without one is rebuilt in place, so old entries are not orphaned.)
_CACHE_VERSION = "1"
SUM_SUFFIX = ".sum"  # <key><suffix>.sum: the artifact's checksum record

# path -> (dev, inode, size, mtime_ns, sha256) of an artifact this process has hashed and found
# matching its record: unchanged files are not hashed again.
_verified: dict[str, tuple] = {}
_verified_lock = threading.Lock()


def cache_dir() -> pathlib.Path:
    """$PICOMPILE_CACHE_DIR, or ~/.cache/picompile; created if missing (CacheUnusable if it
    cannot be)."""
    env = os.environ.get(CACHE_ENV, "")
    path = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "picompile"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheUnusable(path, e) from None
    return path


class CacheUnusable(OSError):
    """The kernel cache directory cannot be made or written: says which, and the fix."""

    def __init__(self, path: pathlib.Path, error: OSError):
        super().__init__(f"the kernel cache {path} (${CACHE_ENV}, default ~/.cache/picompile) "
                         f"is not a directory picompile can write ({error.strerror or error}): "
                         f"point ${CACHE_ENV} at a writable directory")


def cache_key(source: str, flags: list[str], tag: str = "") -> str:
    h = hashlib.sha256()
    h.update(json.dumps([_CACHE_VERSION, list(flags), tag]).encode())
    h.update(b"\0")
    h.update(source.encode())
    return h.hexdigest()[:40]


def _source_suffix(source: str, tag: str) -> str:
    """The extension the compiler needs to recognise the language of `source`."""
    if "__global__" in source or "cuda" in tag.lower():
        return ".cu"
    return ".c"


def sum_path(artifact: pathlib.Path) -> pathlib.Path:
    """The checksum record of a cached artifact."""
    return artifact.with_name(artifact.name + SUM_SUFFIX)


def _sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: pathlib.Path) -> None:
    """Make renames in `path` durable (best effort: not every platform opens directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def verify(artifact: pathlib.Path) -> str | None:
    """None when `artifact` exists and matches its checksum record; otherwise why not (one line)."""
    try:
        st = os.stat(artifact)
    except FileNotFoundError:
        return "missing"
    try:
        rec = json.loads(sum_path(artifact).read_text())
        size, digest = int(rec["size"]), str(rec["sha256"])
    except FileNotFoundError:
        return "no checksum record"
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable checksum record"
    if st.st_size != size:
        return f"size {st.st_size} bytes, {size} when built"
    sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, digest)
    with _verified_lock:
        if _verified.get(str(artifact)) == sig:
            return None
    if _sha256_file(artifact) != digest:
        return "checksum mismatch"
    with _verified_lock:
        _verified[str(artifact)] = sig
    return None


@contextlib.contextmanager
def _locked(lock_path: pathlib.Path) -> Iterator[None]:
    """Exclusive per-key lock. flock locks belong to the open file description, so two threads of
    one process that each open the file exclude each other just like two processes do."""
    if fcntl is None:
        yield
        return
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock: temp names are still private, replace atomic
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def cached_build(
    source: str,
    *,
    suffix: str,
    flags: list[str],
    build: Callable[[pathlib.Path, pathlib.Path], None],
    tag: str = "",
    source_suffix: str | None = None,
) -> pathlib.Path:
    """Return the cached artifact for (source, flags, tag), building it first if needed.

    `build(src_path, out_path)` must write the artifact to `out_path` and raise on failure (with
    the compiler's stderr in the message); nothing is cached then (an empty `out_path` counts as
    a failure). `source_suffix` names the source file's extension (default: ".cu" for CUDA
    sources, else ".c"). The returned artifact matched its checksum record when returned."""
    key = cache_key(source, flags, tag)
    root = cache_dir()
    final = root / f"{key}{suffix}"
    if verify(final) is None:
        return final
    src_ext = source_suffix or _source_suffix(source, tag)
    if not os.access(root, os.W_OK):  # a full read-only cache serves what verify() accepted
        raise CacheUnusable(root, PermissionError(13, "read-only"))
    with _locked(root / f"{key}.lock"):
        why = verify(final)
        if why is None:  # built by whoever held the lock before us
            return final
        if why != "missing":
            # Replacing is safe for processes that have the old file mapped: os.replace gives
            # the new artifact a new inode, the old one lives on until they unmap it.
            (log.debug if why == "no checksum record" else log.warning)(
                "picompile: cached build %s is damaged (%s); rebuilding it", final, why)
        # Private per process and thread: mkdtemp picks a fresh name.
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}.{os.getpid()}.", dir=root))
        try:
            src = tmp / f"{key}{src_ext}"
            src.write_text(source)
            out = tmp / f"{key}{suffix}"
            build(src, out)
            if not out.exists():
                raise RuntimeError(f"build of {src.name} reported success but wrote no {out.name}")
            with open(out, "rb") as f:
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise RuntimeError(f"build of {src.name} reported success but wrote an empty "
                                   f"{out.name}")
            record = json.dumps({"size": size, "sha256": _sha256_file(out)})
            rec_tmp = tmp / f"{key}{suffix}{SUM_SUFFIX}"
            with open(rec_tmp, "w") as f:
                f.write(record)
                f.flush()
                os.fsync(f.fileno())
            # Keep the source next to the artifact, for reading and debugging the generated code.
            os.replace(src, root / f"{key}{src_ext}")
            # The artifact first, then its record: a crash in between leaves an artifact without
            # a record, which the next run rebuilds.
            os.replace(out, final)
            os.replace(rec_tmp, sum_path(final))
            _fsync_dir(root)
            st = os.stat(final)
            with _verified_lock:  # just hashed: the next lookup need not hash it again
                _verified[str(final)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                         json.loads(record)["sha256"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
