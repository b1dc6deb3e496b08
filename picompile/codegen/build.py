"""Compiling kernel sources, shared by the C and CUDA generators.

Kernel sources are package data (picompile/kernels/*.c, *.h, *.cuh): `package_source` reads one
with the kernels headers it includes spliced in, so a generated source is one self-contained text
and the build cache's key (a hash of that text) covers every file it uses. `compile_cached` runs
one compiler (the C compiler or nvcc) on such a source through the build cache
(`picompile.codegen.cache`), with the compiler's identity in the key and its failures raised with
its stderr.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import pathlib
import platform
import re
import shlex
import subprocess

from picompile.codegen.cache import cached_build


class CompilerNotFound(RuntimeError):
    """No usable compiler. `label`: the cause, short (for "reference (<label>)")."""

    def __init__(self, message: str, label: str = "no C compiler found: set $CC"):
        super().__init__(message)
        self.label = label


class BuildFailed(RuntimeError):
    """A compiler ran and failed. str(): the command and the compiler's whole stderr;
    `summary`: its first error line."""

    def __init__(self, message: str, summary: str | None = None):
        super().__init__(message)
        self.summary = summary or one_line(message)


def one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def first_error(stderr: str, build_dir: pathlib.Path) -> str | None:
    """The line of a compiler's stderr that says what went wrong (temporary paths removed):
    the first one naming an error, else the first that is not context ("In function 'f':",
    "collect2: ..."), else the first."""
    text = stderr.replace(str(build_dir) + os.sep, "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    context = [ln for ln in lines if ln.endswith(":") or ln.startswith("collect2:")]
    rest = [ln for ln in lines if ln not in context]
    for ln in rest:
        if "error" in ln.lower():
            return one_line(ln)
    return one_line((rest or lines)[0]) if lines else None


def package_source(name: str) -> str:
    """The text of picompile/kernels/<name> (package data), with its `#include "<header>"` lines
    of kernels headers replaced by their text (splice_headers)."""
    return splice_headers(importlib.resources.files("picompile").joinpath("kernels", name).read_text())


def splice_headers(text: str) -> str:
    """`text` with each line `#include "<name>.h"` or `#include "<name>.cuh"` replaced by
    picompile/kernels/<name>: a generated source is one self-contained file (NVRTC gets it as one
    string), so the build cache's key, a hash of it, covers the headers it uses."""
    return re.sub(r'^#include "(\w+\.(?:h|cuh))"$', lambda m: package_source(m.group(1)), text,
                  flags=re.MULTILINE)


@functools.lru_cache(maxsize=8)
def compiler_identity(argv: tuple[str, ...], label: str = "C compiler does not run: set $CC") -> str:
    """argv, the first and last lines of `argv --version` (gcc and clang name their version
    first, nvcc last) and the machine: the part of a cache key that makes another compiler build
    afresh. Raises CompilerNotFound (with `label`) if it does not run."""
    try:
        r = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30)
        lines = [line for line in (r.stdout or r.stderr).splitlines() if line.strip()]
        version = " / ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else "?"
        return f"{' '.join(argv)} | {version} | {platform.machine()}"
    except (OSError, subprocess.SubprocessError) as e:
        raise CompilerNotFound(f"the compiler {' '.join(argv)} does not run ({e})",
                               label=label) from e


def run_compiler(argv: list[str], flags: list[str], src: pathlib.Path, out: pathlib.Path, *,
                 libs: tuple[str, ...] = (), what: str = "C compiler",
                 timeout: float | None = 300, error: type[BuildFailed] = BuildFailed) -> None:
    """`argv flags -o out src libs`; a failure raises `error` (BuildFailed or a subclass) with the
    command and the compiler's whole output as the message, its first error line as the summary."""
    cmd = [*argv, *flags, "-o", str(out), str(src), *libs]
    exe = os.path.basename(argv[0])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise error(f"{what} timed out ({shlex.join(cmd)})",
                    summary=f"{exe} timed out after {timeout:g} s") from e
    except OSError as e:
        raise error(f"{what} does not run ({shlex.join(cmd)}): {e}",
                    summary=one_line(f"{exe}: {e}")) from e
    if r.returncode != 0:
        output = "\n".join(s.strip() for s in (r.stderr, r.stdout) if s and s.strip())
        summary = first_error(r.stderr or "", src.parent) or first_error(r.stdout or "", src.parent)
        raise error(f"{what} failed with exit status {r.returncode} ({shlex.join(cmd)}):\n"
                    f"--- {exe} stderr ---\n{output}",
                    summary=summary or f"{exe} exited with status {r.returncode}")


def compile_cached(source: str, argv: list[str], flags: list[str], *, suffix: str, tag: str,
                   libs: tuple[str, ...] = (), what: str = "C compiler",
                   timeout: float | None = 300, error: type[BuildFailed] = BuildFailed,
                   identity_label: str = "C compiler does not run: set $CC") -> pathlib.Path:
    """`source` compiled by `argv flags` (run_compiler) to a `suffix` artifact through the build
    cache, keyed by the source, the flags, `tag` and the compiler's identity; the artifact's path
    (verified against its checksum record)."""
    tag = f"{tag} {compiler_identity(tuple(argv), identity_label)}"

    def build(src: pathlib.Path, out: pathlib.Path) -> None:
        run_compiler(argv, flags, src, out, libs=libs, what=what, timeout=timeout, error=error)

    return cached_build(source, suffix=suffix, flags=flags, build=build, tag=tag)
