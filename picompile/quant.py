"""Block-quantized weights: GGUF's Q8_0, Q4_0 and Q4_1, kept in GGUF's own block layout.

A quantized matrix W [rows, cols] is stored as uint8 [rows, cols / 32 * block_bytes]: each row
is its blocks of 32 consecutive weights along `cols` (the input dimension), one after another, so
one neuron's row stays contiguous (what the sparse kernels need) and a GGUF tensor's bytes load
unchanged. Per block (little-endian, exactly ggml's `block_q8_0` / `block_q4_0` / `block_q4_1`):

    q8_0  34 bytes  d: float16, q: int8[32]              w[i] = d * q[i]
    q4_0  18 bytes  d: float16, qs: uint8[16]            w[i] = d * (nibble[i] - 8)
    q4_1  20 bytes  d: float16, m: float16, qs: uint8[16]  w[i] = d * nibble[i] + m
    nibble[i] = qs[i] & 15 for i < 16, qs[i - 16] >> 4 for i >= 16

Quantizing uses the `gguf` package's own reference (`gguf.quants`, the numpy port of ggml's
quantize_row_*_ref, maintained with llama.cpp), so picompile's blocks are bit for bit the ones
llama.cpp makes. Dequantizing here is plain PyTorch: the reference every quantized kernel is
tested against.

The kernels take their input rounded to integers per block of 32 (`round_activations`;
picompile/kernels/qblocks.h) and dot integers: a block dotted with float32 x is compute-bound on
a CPU, with integer x it is a few integer multiply-adds per 32 weights. The 4-bit formats' x is
rounded to 8 bits, as llama.cpp's is; q8_0's to 16 bits (ACTIVATION_BITS), where 8 bits, what
llama.cpp uses for Q8_0, cost SmolLM2 +0.44% perplexity at q8_0 (BENCHMARKS.md, session 15) and
16 bits dot as fast (int16 pairs: one multiply-add per two weights, no sign trick). The
reference applies the same rounding, so kernel and reference differ only in summation order.
(FFN down rows are added into the output, not dotted: their input is never rounded.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block, along the input dimension


@dataclass(frozen=True)
class Format:
    name: str
    block_bytes: int  # bytes of one block of BLOCK weights
    head_bytes: int  # of them the float16 scale (and minimum) in front; the rest the weights
    piece_bytes: int  # weight bytes of a block per piece of the dot layout (interleave_blocks)
    activation_bits: int  # x rounded to this many bits per block (round_activations)
    gguf_type: str  # gguf.GGMLQuantizationType member name

    @property
    def activation_levels(self) -> int:
        """L of round_activations: x is rounded to integers in [-L, L] per block (127, 32767)."""
        return 2 ** (self.activation_bits - 1) - 1


FORMATS = {
    "q8_0": Format("q8_0", 34, 2, 2, 16, "Q8_0"),
    "q4_0": Format("q4_0", 18, 2, 4, 8, "Q4_0"),
    "q4_1": Format("q4_1", 20, 4, 4, 8, "Q4_1"),
}


def format_of(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown quantization {name!r}: choose one of {', '.join(FORMATS)}") from None


def why_not_quantizable(shape) -> str | None:
    """Why a weight of `shape` [rows, cols] cannot be block-quantized, or None."""
    if len(shape) != 2:
        return f"not a matrix (shape {tuple(shape)})"
    if shape[1] % BLOCK:
        return f"its input dimension {shape[1]} is not a multiple of {BLOCK}"
    return None


def row_bytes(cols: int, fmt: str) -> int:
    """Bytes of one quantized row of `cols` weights."""
    return cols // BLOCK * format_of(fmt).block_bytes


def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w [rows, cols] (any float dtype) -> uint8 [rows, row_bytes(cols, fmt)] in GGUF's layout."""
    import gguf

    why = why_not_quantizable(w.shape)
    if why is not None:
        raise ValueError(f"cannot quantize to {fmt}: {why}")
    f = format_of(fmt)
    data = w.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType[f.gguf_type])
    return torch.from_numpy(np.ascontiguousarray(packed)).view(torch.uint8).reshape(w.shape[0], -1)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block [..., block_bytes] -> float32 [..., 1]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [..., 16] -> the 32 4-bit values [..., 32] as float32 (low nibbles first)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.float32)


def dequantize(q: torch.Tensor, fmt: str, cols: int) -> torch.Tensor:
    """uint8 [rows, row_bytes(cols, fmt)] -> float32 [rows, cols]. The reference."""
    f = format_of(fmt)
    rows = q.shape[0]
    if q.dtype != torch.uint8 or q.shape[-1] != row_bytes(cols, fmt):
        raise ValueError(f"a {fmt} matrix of {cols} columns is uint8 [rows, {row_bytes(cols, fmt)}], "
                         f"got {q.dtype} {tuple(q.shape)}")
    blocks = q.reshape(rows, cols // BLOCK, f.block_bytes)
    d = _f16(blocks, 0)
    if fmt == "q8_0":
        w = d * blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    elif fmt == "q4_0":
        w = d * (_nibbles(blocks[..., 2:]) - 8.0)
    else:  # q4_1
        w = d * _nibbles(blocks[..., 4:]) + _f16(blocks, 2)
    return w.reshape(rows, cols)


def round_activations(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """x [..., K] as a kernel for weights in `fmt` reads it: for the quantized formats, rounded
    to the format's activation_bits (b) per block of 32 along K and back to float32 (bit for
    bit what qblocks.h's pq_quantize makes: L = 2^(b-1) - 1, d = max|x| / L,
    q = round-half-even(x * (1 / d)), x' = d * q); for float formats (and None) x unchanged. K
    must be a multiple of 32 for the quantized formats. Under autograd the rounding passes
    gradients through unchanged (straight-through), as the float weights' gradients would be."""
    if fmt not in FORMATS:
        return x
    K = x.shape[-1]
    if K % BLOCK:
        raise ValueError(f"{fmt} kernels take inputs of a multiple of {BLOCK} features, got {K}")
    xb = x.to(torch.float32).reshape(*x.shape[:-1], K // BLOCK, BLOCK)
    d = xb.abs().amax(dim=-1, keepdim=True) / float(FORMATS[fmt].activation_levels)  # [..., K/32, 1]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros((), dtype=torch.float32))
    r = (torch.round(xb * inv) * d).reshape(x.shape)
    if x.requires_grad and torch.is_grad_enabled():
        return x + (r - x).detach()
    return r


def linear_dequantized(xr: torch.Tensor, q: torch.Tensor, fmt: str, bias: torch.Tensor | None,
                       out: torch.Tensor, tile_bytes: int = 32 << 20) -> torch.Tensor:
    """xr [T, cols] float32 (already round_activations'd) @ dequantize(q).T + bias -> out
    [T, rows] float32, for q uint8 [rows, row_bytes] in the dot layout (QuantLinear.qweight), on
    any device: row tiles of at most `tile_bytes` of float32 weights dequantized one at a time,
    each multiplied by BLAS. For many tokens, where a kernel that decodes blocks per group of
    tokens would read the weight once per group; the memory it takes is one tile."""
    cols = xr.shape[1]
    step = max(1, tile_bytes // (4 * cols))
    for r0 in range(0, q.shape[0], step):
        w = dequantize(deinterleave_blocks(q[r0 : r0 + step], fmt), fmt, cols)  # [rows, cols]
        y = xr @ w.t()  # [T, tile rows]
        out[:, r0 : r0 + step] = y if bias is None else y + bias[r0 : r0 + step]
    return out


# -- the dot layout of rows dotted with x -------------------------------------------------------

SUPERBLOCK = 8  # blocks interleaved per run (PQ_SB in picompile/kernels/qblocks.h)


def _superblocks(q: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int, int]:
    """(the superblocks of q's rows [rows, n_sb, 8, block_bytes], header bytes per block, bytes
    per row in superblocks) for a matrix q uint8 [rows, row_bytes]."""
    f = format_of(fmt)
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % f.block_bytes:
        raise ValueError(f"a {fmt} matrix is uint8 [rows, blocks * {f.block_bytes}], got "
                         f"{q.dtype} {tuple(q.shape)}")
    nb = q.shape[1] // f.block_bytes
    n_sb = nb // SUPERBLOCK
    span = n_sb * SUPERBLOCK * f.block_bytes
    return q[:, :span].reshape(q.shape[0], n_sb, SUPERBLOCK, f.block_bytes), f.head_bytes, span


def interleave_blocks(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF's row layout -> the dot layout the kernels dot with x (qblocks.h): a new uint8
    [rows, row_bytes] tensor. In each row every run of 8 blocks (a superblock; the row's last
    blocks % 8 stay as they are) holds the 8 blocks' float16 scales, their minimums (q4_1), then
    their weight bytes (qs: 16 of a 4-bit block, 32 of a q8_0 one) in pieces of piece_bytes (4,
    q8_0: 2), piece v of blocks 0..7 after one another. Only the order of bytes within a row changes. (FFN down rows,
    added rather than dotted, keep GGUF's layout.)"""
    sb, head, span = _superblocks(q, fmt)  # [R, S, b, byte]
    R, S = sb.shape[:2]
    c = format_of(fmt).piece_bytes
    P = (sb.shape[-1] - head) // c  # pieces per block
    heads = sb[..., :head].reshape(R, S, SUPERBLOCK, head // 2, 2).transpose(2, 3)  # [R, S, f16, b, 2]
    qs = sb[..., head:].reshape(R, S, SUPERBLOCK, P, c).transpose(2, 3)  # [R, S, v, b, c]
    out = q.clone()
    out[:, :span] = torch.cat([heads.reshape(R, S, SUPERBLOCK * head), qs.reshape(R, S, SUPERBLOCK * c * P)],
                              dim=-1).reshape(R, span)
    return out


def deinterleave_blocks(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """The dot layout -> GGUF's row layout (interleave_blocks undone): a new tensor."""
    sb, head, span = _superblocks(q, fmt)  # [R, S, 8, bb]: a superblock's bytes, dot layout
    R, S = sb.shape[:2]
    c = format_of(fmt).piece_bytes
    P = (sb.shape[-1] - head) // c
    flat = sb.reshape(R, S, SUPERBLOCK * (head + c * P))
    heads = flat[..., :SUPERBLOCK * head].reshape(R, S, head // 2, SUPERBLOCK, 2).transpose(2, 3)
    qs = flat[..., SUPERBLOCK * head:].reshape(R, S, P, SUPERBLOCK, c).transpose(2, 3)  # [R, S, b, v, c]
    blocks = torch.cat([heads.reshape(R, S, SUPERBLOCK, head), qs.reshape(R, S, SUPERBLOCK, c * P)], dim=-1)
    out = q.clone()
    out[:, :span] = blocks.reshape(R, span)
    return out
