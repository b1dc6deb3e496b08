"""The Plan: everything the passes decide, as plain dataclasses.

The plan is what `CompiledModel.save` writes (JSON for these fields, safetensors for tensors), so
every field here is JSON-friendly: str, int, float, bool, lists and dicts of those.

`Plan.from_json` checks every field of a loaded plan (type, range, allowed values, consistency
between fields) and raises PlanError naming the field, its value and what is allowed: a hand-edited
or damaged plan.json never loads with a value no compile makes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, fields

from picompile.activations import ACTIVATIONS, zero_below
from picompile.quant import FORMATS

class Choice(str, enum.Enum):
    """A closed set of names: compares equal to its value, and prints and saves (JSON) as it."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:  # as its value's: a member finds its value's entry in a dict
        return str.__hash__(self)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Kind(Choice):
    PLAIN = "plain"  # down(act(up x))
    GATED = "gated"  # down(act(gate x) * up x)
    DRELU = "drelu"  # down(relu(gate x) * relu(up x)) (TurboSparse)


# RELU, SILU, GELU, GELU_TANH, RELU2: the names of picompile/activations.py's table
Act = Choice("Act", [(name.upper(), name) for name in ACTIVATIONS])


class Mode(Choice):
    EXACT = "exact"  # skip what is exactly zero (ReLU), or under a calibrated threshold
    PREDICTED = "predicted"  # a trained predictor picks the neurons to compute


class PredictorPolicy(Choice):
    """Which trained predictors run: AUTO those that make a block's decode faster (measured on
    the CPU by the autotune stage; all of them in the hybrid runtime, where they run on the
    GPU), ALL every one, NONE none (kept trained: the blocks run exact)."""

    AUTO = "auto"
    ALL = "all"
    NONE = "none"


MODES = Mode.values()
PREDICTOR_POLICIES = PredictorPolicy.values()
KINDS = Kind.values()
DTYPES = ("float32", "float16", "bfloat16", "float64")
# compile(quantize=...): a block format, or "gguf": each tensor as the model's GGUF file has it
QUANT_FORMATS = (*FORMATS, "gguf")


class PlanError(ValueError):
    """A saved plan that cannot be used: corrupt, truncated, of another model or version, or
    holding a value no compile makes. The same class as picompile.saving.PlanError."""


@dataclass
class Decisions:
    """What the passes chose for a block: they change how it runs."""

    # Threshold on |down input| under which a neuron counts as inactive; 0.0 = exact.
    threshold: float = 0.0
    predictor_rank: int | None = None  # None: no predictor trained
    predictor_tau: float = 0.0  # the predictor's decision threshold on its logits
    hot_neurons: int = 0  # neurons 0 .. hot_neurons-1 (after the hot-first permutation) on the GPU


@dataclass
class Measurements:
    """What the passes measured on a block: shown by explain() and report(); the autotune
    stage decides predictors="auto" from the decode times. None / 0: not measured."""

    sparsity: float | None = None  # share of (token, neuron) pairs inactive on calibration data
    predictor_recall: float | None = None  # share of firing neurons predicted (held-out samples)
    predicted_density: float | None = None  # share of neurons predicted to fire
    true_density: float | None = None  # share that really fire
    predictor_bytes: int = 0
    # Weight bytes the CPU decode kernel reads per token without / with the predictor (the
    # predictor's own bytes included), and microseconds per decoded token.
    decode_bytes_exact: int = 0
    decode_bytes_predicted: int = 0
    decode_us_exact: float = 0.0
    decode_us_predicted: float = 0.0


@dataclass
class BlockPlan:
    """One FFN block: what `detect` found in the model (the fields here, fixed by the model's
    structure), what the passes decided (`decided`) and what they measured (`measured`)."""

    name: str  # "model.layers.3.mlp" or "model.decoder.layers.0:fc1" for inline blocks
    module: str  # the captured module (a key of CompiledModel.graphs) holding the block
    kind: Kind
    act: Act
    d_model: int
    d_ff: int
    bias: bool
    dtype: str  # weight dtype, "float32" | "float16" | "bfloat16"
    # Which linear layers (fx targets inside `module`) made the block, for explain().
    linears: dict[str, str] = field(default_factory=dict)
    fused_gate_half: int | None = None  # fused gate_up projection: which chunk is the gate
    decided: Decisions = field(default_factory=Decisions)
    measured: Measurements = field(default_factory=Measurements)

    def __post_init__(self):
        self.kind, self.act = Kind(self.kind), Act(self.act)

    @property
    def exact(self) -> bool:
        """ReLU-family blocks skip only neurons that are exactly zero: lossless."""
        return zero_below(self.act)


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
    # Decoder layers (module names) that run wholly on the CPU, attention and FFN: the last ones,
    # where the parts outside the FFN blocks of every layer do not fit the budget.
    host_layers: list[str] = field(default_factory=list)


@dataclass
class Plan:
    mode: Mode = Mode.EXACT
    target_sparsity: float | None = None
    predictors: PredictorPolicy = PredictorPolicy.AUTO
    blocks: list[BlockPlan] = field(default_factory=list)
    unmatched: list[Unmatched] = field(default_factory=list)
    placement: Placement = field(default_factory=Placement)
    calibration_tokens: int = 0
    fingerprint: str = ""  # of the model before compile rewrote it (see saving.fingerprint)
    quantize: str | None = None  # weight format the kernels read (picompile/quant.py), or float
    quant_calibration_tokens: int = 0  # tokens GPTQ's Hessians saw (0: rounded to nearest)
    # quantize="gguf": the file's type of each weight tensor it holds quantized, which load checks
    gguf_types: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.mode, self.predictors = Mode(self.mode), PredictorPolicy(self.predictors)

    @property
    def applied_sparsity(self) -> float | None:
        """target_sparsity where it applies (the non-ReLU blocks; ReLU ones run exact), else
        None: what explain() and the report show."""
        if self.target_sparsity and any(not b.exact for b in self.blocks):
            return self.target_sparsity
        return None

    def block(self, name: str) -> BlockPlan:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"no FFN block named {name!r}; blocks: {[b.name for b in self.blocks]}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        """The Plan in `data` (Plan.to_json's output), after checking every field: PlanError
        names the first field whose value no compile makes, and what is allowed."""
        _check_fields("plan", data, PLAN_FIELDS, required=PLAN_REQUIRED)
        blocks = []
        for i, b in enumerate(data["blocks"]):
            where = f"blocks[{i}]"
            _check_fields(where, b, BLOCK_FIELDS, required=BLOCK_REQUIRED)
            parts = {}
            # Every field: each has been written since plan format 2, and a decision left to
            # its default would change how the block runs (no threshold: dense) unsaid.
            for part, part_cls, spec in (("decided", Decisions, DECISION_FIELDS),
                                         ("measured", Measurements, MEASUREMENT_FIELDS)):
                _check_fields(f"{where}.{part}", b[part], spec, required=tuple(spec),
                              block=b["name"])
                parts[part] = part_cls(**b[part])
            block = BlockPlan(**{**b, **parts})
            if block.exact and block.decided.threshold != 0:  # calibrate leaves ReLU blocks exact
                _bad(f"{where}.decided.threshold", block.decided.threshold,
                     f"0 for a {block.act} block (it skips only exact zeros)", block.name)
            if block.decided.hot_neurons and data["placement"].get("budget_bytes") is None:
                _bad(f"{where}.decided.hot_neurons", block.decided.hot_neurons,
                     "0 in a plan without placement.budget_bytes (nothing placed)", block.name)
            if block.decided.hot_neurons > block.d_ff:
                _bad(f"{where}.decided.hot_neurons", block.decided.hot_neurons,
                     f"at most the block's d_ff ({block.d_ff})", block.name)
            blocks.append(block)
        names = [b.name for b in blocks]
        for i, name in enumerate(names):
            if name in names[:i]:
                _bad(f"blocks[{i}].name", name, "a name no other block has")
        unmatched = []
        for i, u in enumerate(data["unmatched"]):
            _check_fields(f"unmatched[{i}]", u, UNMATCHED_FIELDS, required=_required(Unmatched))
            unmatched.append(Unmatched(**u))
        _check_fields("placement", data["placement"], PLACEMENT_FIELDS, required=())
        placement = Placement(**data["placement"])
        if data.get("quant_calibration_tokens", 0) and data.get("quantize") not in FORMATS:
            _bad("quantize", data.get("quantize"), _choice(FORMATS)[1] +
                 " in a plan quantized by GPTQ (quant_calibration_tokens > 0)")
        if placement.budget_bytes is not None and placement.gpu_bytes > placement.budget_bytes:
            _bad("placement.gpu_bytes", placement.gpu_bytes,
                 f"at most placement.budget_bytes ({placement.budget_bytes})")
        return cls(
            mode=data["mode"],
            target_sparsity=data["target_sparsity"],
            predictors=data.get("predictors", "auto"),
            blocks=blocks,
            unmatched=unmatched,
            placement=placement,
            calibration_tokens=data["calibration_tokens"],
            fingerprint=data["fingerprint"],
            quantize=data.get("quantize"),  # plans from before quantize= are float
            quant_calibration_tokens=data.get("quant_calibration_tokens", 0),
            gguf_types=data.get("gguf_types", {}),  # not recorded before; not checked then
        )


# -- checking a loaded plan ------------------------------------------------------------------
# Each field's check: (test, what is allowed). Every dataclass field above has one (a test
# checks), so a new field must say here which values it takes.

_SHARE_SLACK = 1e-6  # shares computed in floating point may overshoot 1 by rounding


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(lo: int = 0, hi: int | None = None):
    allowed = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"
    return (lambda v: _is_int(v) and v >= lo and (hi is None or v <= hi)), allowed


def _num(lo: float | None = None, hi: float | None = None, *, below: bool = False):
    if lo is None:
        return _is_num, "a finite number"
    if hi is None:
        return (lambda v: _is_num(v) and v >= lo), f"a finite number >= {lo}"
    if below:
        return (lambda v: _is_num(v) and lo <= v < hi), f"a number in [{lo}, {hi})"
    return (lambda v: _is_num(v) and lo <= v <= hi + _SHARE_SLACK), f"a number in [{lo}, {hi}]"


def _choice(options: tuple):
    return (lambda v: isinstance(v, str) and v in options), "one of " + ", ".join(map(repr, options))


def _str(nonempty: bool = False):
    if nonempty:
        return (lambda v: isinstance(v, str) and v != ""), "a non-empty string"
    return (lambda v: isinstance(v, str)), "a string"


def _optional(check):
    test, allowed = check
    return (lambda v: v is None or test(v)), f"null or {allowed}"


def _list_of(check):
    test, allowed = check
    return (lambda v: isinstance(v, list) and all(test(x) for x in v)), f"a list, each item {allowed}"


def _dict_of(check):
    test, allowed = check
    return ((lambda v: isinstance(v, dict) and all(isinstance(k, str) and test(x) for k, x in v.items())),
            f"an object of strings to {allowed}")


_BOOL = (lambda v: isinstance(v, bool)), "true or false"
_OBJECT_LIST = (lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v)), "a list of objects"
_OBJECT = (lambda v: isinstance(v, dict)), "an object"
_SHARE = _optional(_num(0.0, 1.0))

PLAN_FIELDS = {
    "mode": _choice(MODES),
    "target_sparsity": _optional(_num(0.0, 1.0, below=True)),
    "predictors": _choice(PREDICTOR_POLICIES),
    "blocks": _OBJECT_LIST,
    "unmatched": _OBJECT_LIST,
    "placement": _OBJECT,
    "calibration_tokens": _int(0),
    "fingerprint": _str(),
    "quantize": _optional(_choice(QUANT_FORMATS)),
    "quant_calibration_tokens": _int(0),
    "gguf_types": _dict_of(_str(nonempty=True)),
}
PLAN_REQUIRED = ("mode", "target_sparsity", "blocks", "unmatched", "placement",
                 "calibration_tokens", "fingerprint")
BLOCK_FIELDS = {
    "name": _str(nonempty=True),
    "module": _str(),
    "kind": _choice(KINDS),
    "act": _choice(ACTIVATIONS),
    "d_model": _int(1),
    "d_ff": _int(1),
    "bias": _BOOL,
    "dtype": _choice(DTYPES),
    "linears": _dict_of(_str()),
    "fused_gate_half": _optional(_int(0, 1)),
    "decided": _OBJECT,
    "measured": _OBJECT,
}
DECISION_FIELDS = {
    "threshold": _num(0.0),
    "predictor_rank": _optional(_int(1)),
    "predictor_tau": _num(),
    "hot_neurons": _int(0),
}
MEASUREMENT_FIELDS = {
    "sparsity": _SHARE,
    "predictor_recall": _SHARE,
    "predicted_density": _SHARE,
    "true_density": _SHARE,
    "predictor_bytes": _int(0),
    "decode_bytes_exact": _int(0),
    "decode_bytes_predicted": _int(0),
    "decode_us_exact": _num(0.0),
    "decode_us_predicted": _num(0.0),
}
UNMATCHED_FIELDS = {"module": _str(), "reason": _str()}
PLACEMENT_FIELDS = {
    "budget_bytes": _optional(_int(0)),
    "gpu_bytes": _int(0),
    "fixed_bytes": _dict_of(_int(0)),
    "fixed_on_gpu": _BOOL,
    "expected_gpu_share": _num(0.0, 1.0),
    "notes": _list_of(_str()),
    "host_layers": _list_of(_str(nonempty=True)),
}


def _required(cls) -> tuple[str, ...]:
    from dataclasses import MISSING

    return tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)


BLOCK_REQUIRED = (*_required(BlockPlan), "decided", "measured")


def _show(value) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _bad(where: str, value, allowed: str, block: str | None = None) -> None:
    of = f" (block {block!r})" if block else ""
    raise PlanError(f"invalid plan: {where}{of} is {_show(value)}; allowed: {allowed}. The plan "
                    "was edited or damaged: compile the model again and save it")


def _check_fields(where: str, data, spec: dict, required, block: str | None = None) -> None:
    if not isinstance(data, dict):
        raise PlanError(f"invalid plan: {where} is {_show(data)}; allowed: a JSON object")
    if block is None and where.startswith("blocks[") and isinstance(data.get("name"), str):
        block = data["name"]
    for key in data:
        if key not in spec:
            raise PlanError(f"invalid plan: {where} has an unknown field {key!r} (value "
                            f"{_show(data[key])}); allowed fields: {', '.join(spec)}")
    for key in required:
        if key not in data:
            of = f" (block {block!r})" if block else ""
            raise PlanError(f"invalid plan: {where}{of} lacks the field {key!r}. The plan was "
                            "edited or damaged: compile the model again and save it")
    for key, (test, allowed) in spec.items():
        if key in data and not test(data[key]):
            _bad(f"{where}.{key}" if where != "plan" else key, data[key], allowed, block)
