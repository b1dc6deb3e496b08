"""GGUF block types written exactly in a format the kernels have: Q4_K -> q4_1; Q5_0, IQ4_NL
and IQ4_XS -> q8_0.

Why: most GGUF files people download are K-quants (Q4_K_M, Q4_K_S), and llama.cpp quantizes
rows whose width is not a multiple of 256 to Q5_0 instead. picompile has no kernels for those
types, and quantizing their dequantized floats once more to the nearest format rounds every
weight a second time. These two need no second rounding:

    Q4_K  144 bytes per 256 weights: float16 d and dmin, 8 sub-blocks of 32 weights with 6-bit
          scale sc and minimum mn (12 packed bytes), 4-bit q (128 bytes): w = d*sc * q - dmin*mn.
          That is a q4_1 block per sub-block: scale d*sc and minimum -dmin*mn, the same nibbles;
          only the two products are rounded to float16 (2^-11 of a scale, against the 1/2
          quantization step a second rounding costs). Sub-block 2k holds the low nibbles of
          q[32k:32k+32], sub-block 2k+1 their high nibbles.
    Q5_0  22 bytes per 32 weights: float16 d, 32 high bits qh, 16 bytes of low nibbles:
          w = d * (q - 16) with 5-bit q. A q8_0 block with the same d holds q - 16 exactly
          (1.5x the bytes: speed for no loss).
    IQ4_NL  18 bytes per 32 weights: float16 d, 4-bit indices (q4_0's nibble order) into a fixed
          non-uniform grid of int8 levels KVALUES: w = d * KVALUES[i]. A q8_0 block with the
          same d and the levels as its int8 is exact. (A second 4-bit rounding onto q4_1's
          uniform grid cost SmolLM2 about 25% perplexity.)
    IQ4_XS  136 bytes per 256 weights: float16 d, 8 sub-blocks' 6-bit scales ls (low 4 bits in
          scales_l[4], high 2 bits in the uint16 scales_h), indices as IQ4_NL's, 16 bytes a
          sub-block: w = d * (ls - 32) * KVALUES[i]. q8_0 blocks with scale d * (ls - 32) in
          float16 and the levels as int8.

Products too small for float16's normal range round to its subnormals, as a q4_1 block made from
the floats would round its own scale; one too large for float16 at all (no q4_1 block holds it
either) leaves the tensor as it was: `transcode` returns None and the caller quantizes the floats.
The byte layouts are ggml's (ggml-common.h), as the `gguf` package reads them; tests compare
with its dequantization.
"""

from __future__ import annotations

import numpy as np

# GGUF type -> the picompile format its blocks are written in exactly
EXACT = {"Q4_K": "q4_1", "Q5_0": "q8_0", "IQ4_NL": "q8_0", "IQ4_XS": "q8_0"}
# IQ4_NL's and IQ4_XS's levels (ggml's kvalues_iq4nl)
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   np.int8)


def transcode(raw: np.ndarray, gguf_type: str) -> np.ndarray | None:
    """raw uint8 [rows, row_bytes] of GGUF blocks of `gguf_type` (a key of EXACT) -> uint8
    [rows, row bytes of EXACT[gguf_type]] in that format's GGUF layout (quant.py), or None
    where float16 cannot hold a scale (see the module doc)."""
    rows = raw.shape[0]
    if gguf_type == "Q4_K":
        out = _q4_k_to_q4_1(raw.reshape(-1, 144))
    elif gguf_type == "Q5_0":
        out = _q5_0_to_q8_0(raw.reshape(-1, 22))
    elif gguf_type == "IQ4_NL":
        out = _iq4_nl_to_q8_0(raw.reshape(-1, 18))
    elif gguf_type == "IQ4_XS":
        out = _iq4_xs_to_q8_0(raw.reshape(-1, 136))
    else:
        raise ValueError(f"no exact transcoding of {gguf_type}: only {', '.join(EXACT)}")
    return None if out is None else out.reshape(rows, -1)


def _f16_bits(values: np.ndarray) -> np.ndarray | None:
    """float32 values -> their float16 bytes [..., 2], or None if any overflows float16."""
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)
    if not np.isfinite(half).all():
        return None
    return half.view(np.uint8).reshape(*values.shape, 2)


def _q4_k_to_q4_1(blocks: np.ndarray) -> np.ndarray | None:
    """[n, 144] Q4_K superblocks -> [n, 8, 20] q4_1 blocks."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)     # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [n, 1]
    s = blocks[:, 4:16].astype(np.uint16)                             # [n, 12] packed 6-bit
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    scale = _f16_bits(d * sc.astype(np.float32))      # [n, 8, 2]
    minimum = _f16_bits(-dmin * mn.astype(np.float32))
    if scale is None or minimum is None:
        return None
    q = blocks[:, 16:144].reshape(n, 4, 32)           # [n, 64-weight group, byte]
    nib = np.stack([q & 15, q >> 4], axis=2).reshape(n, 8, 32)  # sub-block 2k: low, 2k+1: high
    qs = nib[:, :, :16] | (nib[:, :, 16:] << 4)       # q4_1: weight i low, weight 16 + i high
    return np.concatenate([scale, minimum, qs], axis=2)


def _q5_0_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """[n, 22] Q5_0 blocks -> [n, 34] q8_0 blocks (the same d; q - 16 as int8)."""
    qh = blocks[:, 2:6].copy().view("<u4")                             # [n, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, 32]: bit j
    low = np.concatenate([blocks[:, 6:22] & 15, blocks[:, 6:22] >> 4], axis=1)
    q = (low | (high << 4)).astype(np.int16) - 16
    return np.concatenate([blocks[:, 0:2], q.astype(np.int8).view(np.uint8)], axis=1)


def _levels(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of 4-bit indices (low nibbles weights 0..15) -> [..., 32] int8 levels as
    bytes."""
    return KVALUES[np.concatenate([qs & 15, qs >> 4], axis=-1)].view(np.uint8)


def _iq4_nl_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """[n, 18] IQ4_NL blocks -> [n, 34] q8_0 blocks (the same d)."""
    return np.concatenate([blocks[:, 0:2], _levels(blocks[:, 2:18])], axis=1)


def _iq4_xs_to_q8_0(blocks: np.ndarray) -> np.ndarray | None:
    """[n, 136] IQ4_XS superblocks -> [n, 8, 34] q8_0 blocks."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)          # [n, 1]
    high = blocks[:, 2:4].copy().view("<u2")                               # [n, 1]
    low = np.stack([blocks[:, 4:8] & 15, blocks[:, 4:8] >> 4], axis=2).reshape(n, 8)
    ls = low.astype(np.int32) | (((high >> (2 * np.arange(8))) & 3).astype(np.int32) << 4)
    scale = _f16_bits(d * (ls - 32).astype(np.float32))                   # [n, 8, 2]
    if scale is None:
        return None
    return np.concatenate([scale, _levels(blocks[:, 8:136].reshape(n, 8, 16))], axis=2)
