"""Issue 12: a damaged cached kernel is rebuilt instead of crashing the loader (SIGBUS) or silently
falling back, and every fallback to the reference path says why, in one warning per process."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from picompile.codegen import c, cache, cuda
from picompile.plan import BlockPlan
from picompile.runtime.sparse_ffn import SparseFFN

REPO = pathlib.Path(__file__).resolve().parents[1]
V = c.Variant("float32", gated=True, drelu=False, bias=False, act="relu")


def make_ffn(seed: int = 0, d: int = 16, n_ff: int = 32) -> SparseFFN:
    gen = torch.Generator().manual_seed(seed)

    def w():
        return torch.randint(-8, 9, (n_ff, d), generator=gen).float() / 8

    bp = BlockPlan(name="ffn", module="m", kind="gated", act="relu", d_model=d, d_ff=n_ff,
                   bias=False, dtype="float32")
    return SparseFFN(bp, w(), w(), w_gate=w())


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A fresh cache directory; no library loaded, no fallback warned about or recorded yet."""
    root = tmp_path / "cache"
    monkeypatch.setenv(cache.CACHE_ENV, str(root))
    monkeypatch.delenv("PICOMPILE_REFERENCE", raising=False)
    monkeypatch.setattr(c, "_libs", {})
    monkeypatch.setattr(c, "_warned", False)
    monkeypatch.setattr(c, "_failures", {}, raising=False)
    return root


def record(artifact: pathlib.Path) -> pathlib.Path:
    """The checksum record written next to a cached artifact."""
    return artifact.with_name(artifact.name + ".sum")


def damage(path: pathlib.Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "zero_length":
        os.truncate(path, 0)
    elif how == "flipped_byte":  # same size, different content
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "no_record":  # e.g. killed between the two renames, or an older picompile
        record(path).unlink()
    else:
        raise AssertionError(how)


# ---------------------------------------------------------------------------------------------
# The cache itself (any artifact: no compiler needed)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["truncated", "zero_length", "flipped_byte", "no_record"])
def test_damaged_artifact_is_rebuilt(fresh, how):
    builds = []

    def build(src, out):
        builds.append(src.name)
        out.write_bytes(b"artifact " * 1000)

    first = cache.cached_build("int x;", suffix=".so", flags=["-O2"], build=build)
    assert cache.cached_build("int x;", suffix=".so", flags=["-O2"], build=build) == first
    assert len(builds) == 1  # an intact artifact is a hit
    # Files picompile did not write are never touched, whatever their names.
    foreign = {fresh / "notes.txt": b"mine", fresh / "libfoo.so": b"", fresh / "x.so.sum": b"{"}
    for p, data in foreign.items():
        p.write_bytes(data)

    damage(first, how)
    again = cache.cached_build("int x;", suffix=".so", flags=["-O2"], build=build)
    assert again == first and len(builds) == 2
    assert again.read_bytes() == b"artifact " * 1000 and cache.verify(again) is None
    assert json.loads(record(again).read_text()) == {
        "size": 9000, "sha256": hashlib.sha256(b"artifact " * 1000).hexdigest()}
    assert all(p.read_bytes() == data for p, data in foreign.items())
    assert not [p for p in fresh.iterdir() if p.is_dir()]  # no temp dirs left
    assert cache.cached_build("int x;", suffix=".so", flags=["-O2"], build=build) == first
    assert len(builds) == 2


def test_a_cache_path_that_is_a_file_names_the_variable_and_the_fix(fresh):
    fresh.parent.mkdir(parents=True, exist_ok=True)
    fresh.write_text("a user's file")
    with pytest.raises(cache.CacheUnusable, match=r"cache .*PICOMPILE_CACHE_DIR.* point "):
        cache.cached_build("int x;", suffix=".o", flags=[], build=lambda src, out: None)
    assert fresh.read_text() == "a user's file"
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ffn = make_ffn()
        assert c.kernel_for(ffn) is None  # the reference path, saying why
    assert "PICOMPILE_CACHE_DIR" in c.why_no_kernel(ffn)


def test_empty_build_output_is_not_cached(fresh):
    with pytest.raises(RuntimeError, match="empty"):
        cache.cached_build("src", suffix=".so", flags=[], build=lambda s, o: o.write_bytes(b""))
    assert not list(fresh.glob("*.so")) and not list(fresh.glob("*.sum"))


def test_cuda_cubins_are_verified_too(fresh, tmp_path, monkeypatch):
    """compile_source_with_nvcc goes through cached_build: a truncated cubin is rebuilt."""
    log = tmp_path / "nvcc.log"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = --version ] && {{ echo "fake nvcc"; exit 0; }}
        while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
        echo run >> {log}
        printf 'fake cubin %01000d' 7 > "$out"
        """))
    nvcc.chmod(0o755)
    monkeypatch.setenv(cuda.NVCC_ENV, str(nvcc))
    src = 'extern "C" __global__ void k(int* p) { *p = 1; }\n'
    path = cuda.compile_source_with_nvcc(src, "sm_80")
    good = path.read_bytes()
    damage(path, "truncated")
    assert cuda.compile_source_with_nvcc(src, "sm_80") == path
    assert path.read_bytes() == good and len(log.read_text().split()) == 2


# ---------------------------------------------------------------------------------------------
# C kernels: a damaged cached library is rebuilt and works
# ---------------------------------------------------------------------------------------------

_LOAD_AND_CHECK = textwrap.dedent(
    """
    import torch
    from tests.test_kernel_cache import make_ffn
    from picompile.codegen import c
    ffn = make_ffn()
    kernel = c.kernel_for(ffn)
    assert kernel is not None, getattr(c, "why_no_kernel", lambda f: "no C kernel")(ffn)
    x = torch.randint(-8, 9, (3, 16), generator=torch.Generator().manual_seed(1)).float() / 8
    out, _ = kernel(x, 0.0)
    torch.testing.assert_close(out, ffn.forward_native(x)[0])
    print("OK")
    """
)


@pytest.fixture(scope="module")
def good_library(tmp_path_factory):
    """One real build of V (with its record and source), copied into each test's cache."""
    root = tmp_path_factory.mktemp("good_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv(cache.CACHE_ENV, str(root))
    try:
        path = c.build(V)
    finally:
        mp.undo()
    return path


@pytest.mark.parametrize("how", ["truncated", "zero_length"])
def test_damaged_library_is_rebuilt_and_works(fresh, good_library, how):
    fresh.mkdir(parents=True, exist_ok=True)
    for p in good_library.parent.glob(good_library.name.split(".")[0] + ".*"):
        shutil.copy(p, fresh / p.name)
    lib = fresh / good_library.name
    assert c.build(V) == lib  # a hit
    damage(lib, how)
    # Loading a truncated shared library can kill the process (SIGBUS): a fresh process does it.
    env = dict(os.environ, PYTHONPATH=str(REPO), **{cache.CACHE_ENV: str(fresh)})
    env.pop("PICOMPILE_REFERENCE", None)
    r = subprocess.run([sys.executable, "-c", _LOAD_AND_CHECK], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "OK", (r.returncode, r.stderr[-3000:])
    assert lib.read_bytes() == good_library.read_bytes() and cache.verify(lib) is None


# ---------------------------------------------------------------------------------------------
# Fallbacks: labelled by their cause, one warning per process
# ---------------------------------------------------------------------------------------------


def _runtime_warnings(w) -> list[warnings.WarningMessage]:
    return [x for x in w if issubclass(x.category, RuntimeWarning)]


def test_missing_compiler_label_and_one_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    ffn = make_ffn()
    with warnings.catch_warnings(record=True) as w, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        assert c.kernel_for(ffn) is None
        assert c.kernel_for(make_ffn(1)) is None
        assert c.try_load(c._PREDICTOR_VARIANT) is None  # the predictor kernel: no second warning
    ws = _runtime_warnings(w)
    assert len(ws) == 1, [str(x.message) for x in ws]
    msg = str(ws[0].message)
    assert "\n" not in msg and "no C compiler found" in msg and "/nonexistent/cc" in msg
    assert "gcc" in msg and "$CC" in msg and "PICOMPILE_REFERENCE" in msg
    assert ws[0].filename == __file__  # points at the caller's line, not picompile's internals
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # not printed twice
    assert c.why_no_kernel(ffn) == "reference (no C compiler found: set $CC)"
    assert not list(fresh.glob("*.so"))


def test_failing_compiler_label_names_the_error(fresh, tmp_path, monkeypatch):
    cc = tmp_path / "badcc"
    cc.write_text(textwrap.dedent("""\
        #!/bin/sh
        echo "kernel.c: In function 'ffn':" >&2
        echo "kernel.c:12:3: error: simulated failure" >&2
        echo "compilation terminated." >&2
        exit 1
        """))
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    ffn = make_ffn()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert c.kernel_for(ffn) is None
        assert c.kernel_for(ffn) is None
    ws = _runtime_warnings(w)
    assert len(ws) == 1 and "simulated failure" in str(ws[0].message)
    assert "\n" not in str(ws[0].message) and "PICOMPILE_REFERENCE" in str(ws[0].message)
    label = "reference (C build failed: kernel.c:12:3: error: simulated failure)"
    assert c.why_no_kernel(ffn) == label
    assert not list(fresh.glob("*.so")) and not list(fresh.glob("*.sum"))


def test_reference_forced_label(fresh, monkeypatch):
    monkeypatch.setenv("PICOMPILE_REFERENCE", "1")
    ffn = make_ffn()
    assert c.kernel_for(ffn) is None
    assert c.why_no_kernel(ffn) == "reference (PICOMPILE_REFERENCE set)"
