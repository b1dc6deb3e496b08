"""The Plan: everything the passes decide, as plain dataclasses.

The plan is what `CompiledModel.save` writes (JSON for these fields, safetensors for tensors), so
every field here is JSON-friendly: str, int, float, bool, lists and dicts of those.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")
MODES = ("exact", "predicted")
# Which trained predictors run: "auto" those that make a block's decode faster (measured on the
# CPU at compile time; all of them in the hybrid runtime, where they run on the GPU), "all" every
# one, "none" none (kept trained: the blocks run exact).
PREDICTOR_POLICIES = ("auto", "all", "none")


@dataclass
class BlockPlan:
    """One FFN block found by `detect`, and what the later passes decided for it."""

    name: str  # "model.layers.3.mlp" or "model.decoder.layers.0:fc1" for inline blocks
    module: str  # the captured module (a key of CompiledModel.graphs) holding the block
    kind: str  # "plain" down(act(up x)) | "gated" down(act(gate x) * up x) | "drelu"
    act: str  # one of ACTIVATIONS
    d_model: int
    d_ff: int
    bias: bool
    dtype: str  # weight dtype, "float32" | "float16" | "bfloat16"
    # Which linear layers (fx targets inside `module`) made the block, for explain().
    linears: dict[str, str] = field(default_factory=dict)
    fused_gate_half: int | None = None  # fused gate_up projection: which chunk is the gate
    # Threshold on |down input| under which a neuron counts as inactive; 0.0 = exact.
    threshold: float = 0.0
    # Fraction of (token, neuron) pairs inactive, measured on calibration data (None: not measured).
    measured_sparsity: float | None = None
    # Filled by predictor / placement passes (issue 3).
    predictor_rank: int | None = None
    predictor_recall: float | None = None
    predicted_density: float | None = None
    true_density: float | None = None
    predictor_bytes: int = 0
    predictor_tau: float = 0.0
    # Weight bytes the CPU decode kernel reads per token without / with the predictor (the
    # predictor's own bytes included), and the measured microseconds per decoded token: a
    # predictor runs on the CPU where it is faster (Plan.predictors="auto").
    decode_bytes_exact: int = 0
    decode_bytes_predicted: int = 0
    decode_us_exact: float = 0.0
    decode_us_predicted: float = 0.0
    hot_neurons: int = 0  # neurons 0 .. hot_neurons-1 (after the hot-first permutation) on the GPU

    @property
    def exact(self) -> bool:
        """ReLU-family blocks skip only neurons that are exactly zero: lossless."""
        return self.act == "relu"


@dataclass
class Unmatched:
    """A place that looked like an FFN but was left dense, with the reason."""

    module: str
    reason: str


@dataclass
class Placement:
    budget_bytes: int | None = None  # None: no gpu_budget given, nothing placed
    gpu_bytes: int = 0  # everything the plan puts on the GPU; never more than budget_bytes
    fixed_bytes: dict[str, int] = field(default_factory=dict)  # non-FFN parts, by item
    fixed_on_gpu: bool = False  # False: even the non-FFN parts did not fit; all on the CPU
    expected_gpu_share: float = 0.0  # expected share of firing neurons served by the GPU
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    mode: str = "exact"
    target_sparsity: float | None = None
    predictors: str = "auto"  # one of PREDICTOR_POLICIES
    blocks: list[BlockPlan] = field(default_factory=list)
    unmatched: list[Unmatched] = field(default_factory=list)
    placement: Placement = field(default_factory=Placement)
    calibration_tokens: int = 0
    fingerprint: str = ""  # of the model before compile rewrote it (see saving.fingerprint)

    def block(self, name: str) -> BlockPlan:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"no FFN block named {name!r}; blocks: {[b.name for b in self.blocks]}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        return cls(
            mode=data["mode"],
            target_sparsity=data["target_sparsity"],
            predictors=data.get("predictors", "auto"),
            blocks=[BlockPlan(**b) for b in data["blocks"]],
            unmatched=[Unmatched(**u) for u in data["unmatched"]],
            placement=Placement(**data["placement"]),
            calibration_tokens=data["calibration_tokens"],
            fingerprint=data["fingerprint"],
        )
