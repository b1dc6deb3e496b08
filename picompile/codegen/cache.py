"""On-disk build cache shared by the C and CUDA code generators.

    path = cached_build(source, suffix=".so", flags=[...], build=compile_fn, tag="gcc 12.2")

The key is a sha256 over the source, the flags and the tag (callers put the compiler's identity
in the tag). `<cache_dir>/<key><suffix>` is the artifact; when it exists it is returned without
building. Otherwise the source is written to a private temporary directory, `build(src, out)` is
called to produce `out`, and `out` is moved into place with `os.replace`, so a reader never sees a
half-written artifact. Builds of the same key are serialized across processes (and threads) by an
`fcntl.flock` on `<key>.lock`; the loser of the race waits, then finds the artifact and returns it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Iterator

try:  # POSIX only; without it builds still work, just without cross-process serialization.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

CACHE_ENV = "PICOMPILE_CACHE_DIR"
# Bump when the layout or meaning of cached artifacts changes.
_CACHE_VERSION = "1"


def cache_dir() -> pathlib.Path:
    """$PICOMPILE_CACHE_DIR, or ~/.cache/picompile; created if missing."""
    env = os.environ.get(CACHE_ENV, "")
    path = pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "picompile"
    path.mkdir(parents=True, exist_ok=True)
    return path


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
    the compiler's stderr in the message); nothing is cached then. `source_suffix` names the
    source file's extension (default: ".cu" for CUDA sources, else ".c")."""
    key = cache_key(source, flags, tag)
    root = cache_dir()
    final = root / f"{key}{suffix}"
    if final.exists():
        return final
    src_ext = source_suffix or _source_suffix(source, tag)
    with _locked(root / f"{key}.lock"):
        if final.exists():  # built by whoever held the lock before us
            return final
        # Private per process and thread: mkdtemp picks a fresh name.
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{key}.{os.getpid()}.", dir=root))
        try:
            src = tmp / f"{key}{src_ext}"
            src.write_text(source)
            out = tmp / f"{key}{suffix}"
            build(src, out)
            if not out.exists():
                raise RuntimeError(f"build of {src.name} reported success but wrote no {out.name}")
            # Keep the source next to the artifact, for reading and debugging the generated code.
            os.replace(src, root / f"{key}{src_ext}")
            os.replace(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
