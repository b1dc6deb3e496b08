"""The variant type shared by the C and CUDA generators: what about a block changes its kernel.

A `Variant` is what each generator bakes into the kernel source it builds (as #defines in front of
picompile/kernels/ffn.c, or in front of ffn_cuda_*.cuh), so it is also part of the build cache's
key. Each generator reads the fields its kernels compile in and checks the values they support:
the C kernels take every format (float and GGUF blocks) and the threshold at run time; the CUDA
kernels take the float formats and compile the threshold test in.
"""

from __future__ import annotations

from dataclasses import dataclass

from picompile import quant
from picompile.activations import ACTIVATIONS

ACTS = ACTIVATIONS  # "relu" | "silu" | "gelu" | "gelu_tanh"
DTYPES = ("float16", "bfloat16", "float32")  # float weight formats
QFORMATS = tuple(quant.FORMATS)  # GGUF block formats: "q8_0", "q4_0", "q4_1" (picompile/quant.py)

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# Short names, for the identifiers of CUDA kernels (`tag`).
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _dtype_name(dtype) -> str:
    """The name of a torch dtype: float16 for torch.float16."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Variant:
    """Everything about a block that changes the generated code."""

    dtype: str  # gate / up format (CUDA: every tensor's): one of DTYPES or QFORMATS
    gated: bool  # down(act(gate x) * up x); False: down(act(up x))
    drelu: bool  # gated with relu on the up branch too (TurboSparse dReLU); needs gated
    bias: bool  # the block has bias vectors (C: any of b_gate, b_up, b_down; CUDA: b_gate, b_up)
    act: str  # one of ACTS
    # CUDA: a |h| > threshold test is compiled in (else exact: h != 0). The C kernel takes the
    # threshold at run time, so its variants leave this False.
    threshold: bool = False
    down_dtype: str | None = None  # w_down_t's format (same choices); None: dtype's

    def __post_init__(self):
        if self.down_dtype is None:  # normalized: Variant(f, ...) == Variant(f, ..., down_dtype=f)
            object.__setattr__(self, "down_dtype", self.dtype)
        for what, fmt in (("weight dtype", self.dtype), ("down weight dtype", self.down_dtype)):
            if fmt not in DTYPES + QFORMATS:
                raise ValueError(f"unsupported {what} {fmt!r} (kernels take {DTYPES + QFORMATS})")
        if self.act not in ACTS:
            raise ValueError(f"unsupported activation {self.act!r} (kernels take {ACTS})")
        if self.drelu and not self.gated:
            raise ValueError("a dReLU block is gated: drelu=True needs gated=True")

    @classmethod
    def for_block(cls, block) -> Variant:
        """The variant of a `picompile.plan.BlockPlan` (float weights in block.dtype)."""
        return cls(dtype=block.dtype, gated=block.kind in ("gated", "drelu"),
                   drelu=block.kind == "drelu", bias=bool(block.bias), act=str(block.act),
                   threshold=float(block.decided.threshold) != 0.0)

    @classmethod
    def of(cls, ffn) -> Variant:
        """The C variant of a SparseFFN module. Float blocks are read in w_up's dtype throughout
        (the kernel converts the others); quantized ones: gate / up in `qformat`, down in
        `down_qformat`, or w_down_t's own float dtype where that is None."""
        qformat = getattr(ffn, "qformat", None)
        dtype = qformat or _dtype_name(ffn.w_up.dtype)
        down = dtype
        if qformat is not None:
            down = getattr(ffn, "down_qformat", None) or _dtype_name(ffn.w_down_t.dtype)
        return cls(
            dtype=dtype,
            gated=ffn.w_gate is not None,
            drelu=bool(ffn.drelu),
            bias=any(getattr(ffn, b) is not None for b in ("b_gate", "b_up", "b_down")),
            act=ffn.act,
            down_dtype=down,
        )

    @property
    def kind(self) -> str:
        """plain, gated or drelu, as BlockPlan.kind names the block's form."""
        return "drelu" if self.drelu else "gated" if self.gated else "plain"

    @property
    def quantized(self) -> bool:
        """The gate and up rows are GGUF blocks (uint8), not float elements."""
        return self.dtype in QFORMATS

    def row_bytes(self, d: int, fmt: str | None = None) -> int:
        """Bytes of one weight row of d weights in `fmt` (None: the gate / up format, a neuron's
        row of w_gate or w_up; `down_dtype` for one of w_down_t)."""
        fmt = fmt or self.dtype
        if fmt in QFORMATS:
            return quant.row_bytes(d, fmt)
        return d * _ITEMSIZE[fmt]

    @property
    def name(self) -> str:
        """The C library's name, e.g. "gated_silu_float16_bias"."""
        down = f"_down_{self.down_dtype}" if self.down_dtype != self.dtype else ""
        return f"{self.kind}_{self.act}_{self.dtype}{down}{'_bias' if self.bias else ''}"

    @property
    def dtag(self) -> str:
        """The dtype's short name ("f16", "bf16", "f32"; a GGUF format's own), tag's first part."""
        return _SHORT.get(self.dtype, self.dtype)

    @property
    def tag(self) -> str:
        """A C identifier naming the CUDA variant, e.g. "f16_gated_silu_nobias_exact"."""
        return "_".join((self.dtag, self.kind, self.act, "bias" if self.bias else "nobias",
                         "thr" if self.threshold else "exact"))
