"""qdecode.h, the block decoding the CUDA quantized kernels run, built on the host (gcc as C, g++
as C++) and checked bit for bit against picompile.quant: the CPU evidence that the GPU decodes
blocks (scales, nibbles, minimums, both row layouts) and rounds activations right."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

from picompile import quant
from picompile.codegen import build, c

# A tiny harness over the header: whole rows, q8_0 column runs, activation rounding, float16.
HARNESS = """\
#include <math.h>
#include "qdecode.h"
#ifdef __cplusplus
extern "C" {
#endif
/* q [rows, nb * block bytes] -> out [rows, nb * 32] */
void h_rows(int fmt, const unsigned char* q, long long rows, long long nb, int dot, float* out) {
    const long long rb = nb * PQD_BLOCK_BYTES(fmt);
    for (long long r = 0; r < rows; ++r)
        for (long long j = 0; j < nb; ++j) pqd_row_block(fmt, q + r * rb, nb, j, dot, out + (r * nb + j) * 32);
}
/* q8_0 q [rows, cols / 32 * 34] -> out [rows, cols] in runs of n columns (n divides 32) */
void h_runs(const unsigned char* q, long long rows, long long cols, int n, float* out) {
    for (long long r = 0; r < rows; ++r)
        for (long long k = 0; k < cols; k += n) pqd_q8_0_run(q + r * (cols / 32 * 34), k, n, out + r * cols + k);
}
/* x [n_blocks * 32] -> out [n_blocks * 32] */
void h_round(const float* x, long long n_blocks, float levels, float* out) {
    for (long long b = 0; b < n_blocks; ++b) pqd_round_block(x + 32 * b, levels, out + 32 * b);
}
void h_f16(const unsigned short* h, long long n, float* out) {
    for (long long i = 0; i < n; ++i) out[i] = pqd_f16(h[i]);
}
#ifdef __cplusplus
}
#endif
"""

FMT_CODE = {"q8_0": 0, "q4_0": 1, "q4_1": 2}


def _cxx() -> list[str] | None:
    cxx = os.environ.get("CXX", "").split() or ["g++"]
    exe = shutil.which(cxx[0])
    return None if exe is None else [exe, *cxx[1:]]


def _lib(lang: str) -> ctypes.CDLL:
    if lang == "c":
        try:
            argv = c.compiler()
        except build.CompilerNotFound as e:
            pytest.skip(str(e))
    else:
        argv = _cxx()
        if argv is None:
            pytest.skip("no C++ compiler (g++ or $CXX)")
    # The C kernels' own flags (FMA enabled where the CPU has it: fused or not, a weight is the same).
    flags = [f for f in c.build_flags() if f != "-fopenmp"] + ["-x", lang]
    path = build.compile_cached(build.splice_headers(HARNESS), argv, flags, suffix=".so",
                                tag=f"qdecode-harness-{lang}", libs=("-lm",))
    return ctypes.CDLL(str(path))


@pytest.fixture(scope="module", params=["c", "c++"])
def lib(request):
    return _lib(request.param)


def _p(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_same_floats(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit (signed zeros included), NaN where the reference has NaN."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bad = (_bits(got) != _bits(want)) & ~nan
    assert not bad.any(), f"{int(bad.sum())} differ, first at {bad.nonzero()[0].tolist()}: " \
                          f"{got[bad][0].item()!r} vs {want[bad][0].item()!r}"


def random_blocks(fmt: str, rows: int, nb: int, seed: int) -> torch.Tensor:
    """uint8 [rows, nb * block bytes] of arbitrary bytes: every nibble and int8 value, scales and
    minimums of every kind (normal, subnormal, +-0, odd mantissas; inf / nan in about 1 / 32)."""
    g = torch.Generator().manual_seed(seed)
    bb = quant.format_of(fmt).block_bytes
    q = torch.randint(0, 256, (rows, nb, bb), dtype=torch.uint8, generator=g)
    heads = 4 if fmt == "q4_1" else 2
    h = q[:, :, :heads].reshape(-1, 2)
    # Some subnormal (exponent 0) and some +-0 scales on purpose.
    special = torch.randint(0, 8, (h.shape[0],), generator=g)
    h[special == 0, 1] &= 0x80  # subnormal or zero
    h[(special == 1), 0] = 0
    h[(special == 1), 1] &= 0x80  # +-0
    q[:, :, :heads] = h.reshape(rows, nb, heads)
    return q.reshape(rows, nb * bb)


def _rows(lib, q: torch.Tensor, fmt: str, nb: int, dot: bool) -> torch.Tensor:
    out = torch.empty(q.shape[0], nb * 32, dtype=torch.float32)
    lib.h_rows(FMT_CODE[fmt], _p(q), ctypes.c_longlong(q.shape[0]), ctypes.c_longlong(nb),
               int(dot), _p(out))
    return out


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("nb", [1, 3, 8, 9, 17, 24])  # below, at and past superblocks of 8
def test_rows_decode_as_quant_dequantize(lib, fmt, nb):
    q = random_blocks(fmt, 64, nb, seed=nb)
    want = quant.dequantize(q, fmt, nb * 32)
    assert_same_floats(_rows(lib, q, fmt, nb, dot=False), want)
    # The dot layout of the CPU's gate / up rows decodes to the same.
    assert_same_floats(_rows(lib, quant.interleave_blocks(q, fmt), fmt, nb, dot=True), want)
    if nb >= 8:  # and reading a dot-layout row as GGUF's is wrong (the test can fail)
        wrong = _rows(lib, quant.interleave_blocks(q, fmt), fmt, nb, dot=False)
        assert not torch.equal(torch.nan_to_num(wrong), torch.nan_to_num(want))


def test_random_blocks_cover_every_value():
    """The random blocks above hold every nibble in both halves, every int8, subnormal and zero
    scales, and odd mantissas (so a dropped or misplaced bit shows)."""
    q = random_blocks("q4_1", 64, 24, seed=24).reshape(-1, 20)
    qs = q[:, 4:]
    assert set((qs & 15).unique().tolist()) == set(range(16))
    assert set((qs >> 4).unique().tolist()) == set(range(16))
    scales = q[:, :2].contiguous().view(torch.int16).flatten()
    assert ((scales & 0x7C00) == 0).any() and ((scales & 0x7FFF) == 0).any()
    assert ((scales & 1) == 1).any() and ((scales & 0x7C00) != 0).any()
    q8 = random_blocks("q8_0", 64, 24, seed=24).reshape(-1, 34)[:, 2:]
    assert q8.unique().numel() == 256


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_quantized_weights_decode_as_quant_dequantize(lib, fmt):
    """Blocks made by quant.quantize (GGUF's quantizer) from weights of mixed scales."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 9 * 32, generator=g) * torch.logspace(-6, 2, 40).unsqueeze(1)
    q = quant.quantize(w, fmt)
    want = quant.dequantize(q, fmt, w.shape[1])
    assert_same_floats(_rows(lib, quant.interleave_blocks(q, fmt), fmt, 9, dot=True), want)
    assert (want - w).abs().max() <= w.abs().max() / 4  # real weights, not noise


@pytest.mark.parametrize("n", [1, 4, 8, 32])
def test_q8_0_column_runs(lib, n):
    """The down projection's reads: runs of n columns of q8_0 rows, as quant.dequantize."""
    q = random_blocks("q8_0", 16, 5, seed=n)
    out = torch.empty(16, 160, dtype=torch.float32)
    lib.h_runs(_p(q), ctypes.c_longlong(16), ctypes.c_longlong(160), n, _p(out))
    assert_same_floats(out, quant.dequantize(q, "q8_0", 160))


def test_f16_every_value(lib):
    h = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    out = torch.empty(1 << 16, dtype=torch.float32)
    lib.h_f16(_p(h), ctypes.c_longlong(1 << 16), _p(out))
    assert_same_floats(out, h.view(torch.float16).to(torch.float32))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_round_activations(lib, fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)
    x[5] = 0.0  # an all-zero block
    x[6] = -0.0
    x[7, :] = 0.0
    x[7, 0] = 1e-40  # a subnormal amax
    # Exact ties: amax = L (127 or 32767) makes d = 1, so k + 0.5 rounds half to even.
    L = 2 ** (quant.format_of(fmt).activation_bits - 1) - 1
    x[8] = torch.tensor([float(L)] + [k + 0.5 for k in range(-15, 16)])
    x[9] = -x[8]
    want = quant.round_activations(x.reshape(2, -1), fmt).reshape(64, 32)
    out = torch.empty_like(x)
    lib.h_round(_p(x), ctypes.c_longlong(64), ctypes.c_float(L), _p(out))
    assert_same_floats(out, want)
    assert torch.equal(out[8, 1:5], torch.tensor([-14.0, -14.0, -12.0, -12.0]))  # half to even
    assert not torch.equal(out, x)  # it rounds


def test_harness_source_is_self_contained():
    src = build.splice_headers(HARNESS)
    assert "pqd_row_block" in src and '#include "qdecode.h"' not in src
