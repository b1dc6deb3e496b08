"""Whole-model capture: the compiled Hugging Face causal LM as one graph per step kind.

    steps = capture(cm, max_len=256)      # or cm.capture_steps(256)
    steps.programs["decode"]              # torch.export ExportedProgram: 1 token
    steps.programs["prefill"]             # T tokens, 2 <= T < max_len (a dynamic dimension)
    print(steps.programs["decode"].graph_module.code)
    steps.reasons                         # step kind -> why it was not captured
    steps.line(cm._orig_mod)              # what explain() prints

Each program computes `logits [1, vocab]` of the last position from `(input_ids [1, T],
cache_position [T])`, over a transformers StaticCache of max_len positions held as buffers (the
KV cache is the graph's state, written in place). The programs are exported non-strict
(`torch.export.export(..., strict=False)`) from the model as compile left it: every SparseFFN,
predictor and lowered linear is one `picompile::` op node (runtime/ops.py), the rest is aten ops.
transformers' own export recipe (integrations/executorch.py) sizes its cache from the config,
which is wrong for some models (Falcon's multi-query heads); here one eager step allocates the
cache with the shapes the model really produces, and then its tensors become buffers.

The programs stay as exported; what runs is a copy of each program's graph (`_Runner`, on the
model's parameters and the step's cache), rewritten by passes/step_graph.py.

Where a step cannot be exported, its reason (exception type and first line) is recorded instead
of raising; explain() prints it and generate keeps running the model eagerly.

Runtime: generate runs the captured steps for a single unpadded row within max_len only where
no C whole-step decoder runs (runtime/decoder.py, faster still) and capture measured the graph's
decode step faster than the eager one, with the same logits (`use`). Capture times both on the
same cache, step by step, alternating, so that a shared machine's drift hits both alike. The
graphs bake in dtypes and which predictors run: after a change there (`current()` is False)
generate runs the model eagerly until capture_steps() is called again. A sliding-window cache
is captured only where max_len fits in its window.
"""

from __future__ import annotations

import copy
import inspect
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.export.graph_signature import InputKind, OutputKind

from picompile.passes import step_graph
from picompile.runtime import generate as hf_loop
from picompile.runtime.decoder import VERIFY_RTOL, Decoder

TIMED_STEPS = 16  # decode steps per path timed at capture (after one untimed step each)
# The graph runs only where its decode step is this much faster than eager's: a smaller gain is
# within the timing noise of a shared machine, and the eager path is the one tested everywhere.
MIN_SPEEDUP = 1.05


def _reason(e: BaseException) -> str:
    """`Type: first line of the message` (a one-line reason for explain())."""
    lines = str(e).strip().splitlines()
    first = lines[0].strip() if lines else ""
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


_CACHE_TENSORS = ("keys", "values", "cumulative_length")  # a StaticLayer's state


class _Step(nn.Module):
    """The model and a StaticCache of max_len positions whose tensors are this module's buffers,
    so that torch.export treats the cache as state mutated in place, not as inputs.

    forward(input_ids [1, T] long, cache_position [T] long) -> logits [1, vocab] of the last
    position, the cache's positions cache_position written."""

    def __init__(self, model: nn.Module, max_len: int):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kw = hf_loop.cache_kwarg(model)
        self._logits_to_keep = "logits_to_keep" in params
        self._cache_position = "cache_position" in params  # transformers 4.x models want it
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        for i, layer in enumerate(self.cache.layers):
            if getattr(layer, "is_sliding", False):
                if layer.max_cache_len < max_len:
                    raise ValueError(f"cache layer {i} keeps a sliding window of "
                                     f"{layer.max_cache_len} positions, fewer than max_len="
                                     f"{max_len}; its wrap-around is not captured")
                # Within its window a sliding layer is a plain one, without the Python int
                # position it keeps besides (export would bake that int into the graph).
                self.cache.layers[i] = StaticLayer(max_len)
        # One eager step allocates every layer's tensors, shaped as the model's attention
        # really writes them.
        with torch.no_grad():
            self._run_model(torch.zeros(1, 1, dtype=torch.long, device=_device(model)),
                            torch.zeros(1, dtype=torch.long, device=_device(model)))
        for i, layer in enumerate(self.cache.layers):
            for name in _CACHE_TENSORS:
                t = getattr(layer, name, None)
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"cache layer {i} ({type(layer).__name__}) has no {name} "
                                    "tensor after a step")
                self.register_buffer(f"{name}_{i}", t, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        # The cache layers read and write this module's buffers as they are now: while
        # torch.export traces, those are its tracked stand-ins, so the writes become buffer
        # mutations of the program (the layers' own references would be lifted as constants).
        for i, layer in enumerate(self.cache.layers):
            for name in _CACHE_TENSORS:
                setattr(layer, name, self._buffers[f"{name}_{i}"])
            layer.cumulative_length.copy_(cache_position[0])  # StaticLayer writes there
        return self._run_model(input_ids, cache_position)

    def _run_model(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        kwargs = {self._cache_kw: self.cache, "use_cache": True,
                  "position_ids": cache_position.unsqueeze(0)}  # [1, T]
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if self._cache_position:
            kwargs["cache_position"] = cache_position
        return self.model(input_ids=input_ids, **kwargs).logits[:, -1]  # [1, vocab]


class _Runner:
    """Runs an exported program's graph with its state passed as flat arguments. What
    ExportedProgram.module() does, less what it repeats on every call: looking each parameter
    up by its attribute path, flattening the inputs as pytrees and checking them against the
    program's guards (generate passes shapes in the exported range: [1, 1], or [1, T] with
    2 <= T < max_len). The parameters and the cache are the model's and the step's own tensors.

    `gm` is a copy of the program's graph module, for passes to rewrite (passes/step_graph.py).
    """

    def __init__(self, program):
        self.gm = copy.deepcopy(program.graph_module)
        signature = program.graph_signature
        self.state = []  # [(argument index, tensor)]: the parameters, buffers and constants
        self.user = []  # argument indices of the user inputs
        by_name = {}
        for i, spec in enumerate(signature.input_specs):
            if spec.kind == InputKind.USER_INPUT:
                self.user.append(i)
                continue
            source = program.state_dict if spec.target in program.state_dict else program.constants
            by_name[spec.target] = source[spec.target]
            self.state.append((i, by_name[spec.target]))
        # output index -> the buffer it is written back to (in-place programs have none)
        self.mutated = {j: by_name[spec.target] for j, spec in enumerate(signature.output_specs)
                        if spec.kind == OutputKind.BUFFER_MUTATION}
        self.n_args = len(signature.input_specs)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        args = [None] * self.n_args
        for i, t in self.state:
            args[i] = t
        for i, t in zip(self.user, inputs):
            args[i] = t
        out = self.gm(*args)
        for j, buffer in self.mutated.items():
            buffer.copy_(out[j])
        return out[-1]  # the one user output, last


def _device(model: nn.Module) -> torch.device:
    return next(iter(model.parameters())).device


def picompile_ops(program) -> list[str]:
    """The picompile op names in an ExportedProgram's graph, in order (e.g. "picompile.linear")."""
    return [str(n.target.name()).replace("::", ".") for n in program.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "picompile"]


@dataclass
class StepGraphs:
    """What capture() produced: the exported steps, why a step was not, and the timing that
    decides whether generate runs them."""

    max_len: int
    programs: dict = field(default_factory=dict)  # "decode" / "prefill" -> ExportedProgram
    reasons: dict = field(default_factory=dict)  # step kind -> why it was not captured
    eager_us: float | None = None  # median decode step, HF modules run eagerly
    graph_us: float | None = None  # median decode step, the exported program
    use: bool = False  # generate runs the graphs (see decide())
    why: str = ""  # why `use` is what it is
    key: tuple = ()  # runtime.decoder.Decoder.key of the model when captured (see current())
    gqa_rewrites: dict = field(default_factory=dict)  # step kind -> SDPAs given enable_gqa
    _step: _Step | None = None
    _run: dict = field(default_factory=dict)  # step kind -> _Runner of its program

    def current(self, model: nn.Module) -> bool:
        """Whether the graphs still describe `model`: no kernel, dtype, threshold or predictor
        switch changed since capture (the graph bakes in dtypes and which predictors run)."""
        return self.key == Decoder.key(model)

    def fits(self, batch: int, total: int, padded: bool) -> bool:
        """Whether generate can run these graphs for this call."""
        return self.use and batch == 1 and not padded and total <= self.max_len

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [1, S] -> logits [1, vocab] of the last position; fills positions 0..S-1."""
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device)  # [S]
        return self._run["prefill" if s > 1 else "decode"](input_ids, pos)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """tokens [1] long at `position` -> logits [1, vocab]."""
        pos = torch.tensor([position], device=tokens.device)  # [1]
        return self._run["decode"](tokens.view(1, 1), pos)

    def timing(self) -> str:
        """"1.30x eager (800 vs 1040 us per step)": the graph's decode step against eager's."""
        return (f"{self.eager_us / self.graph_us:.2f}x eager ({self.graph_us:.0f} vs "
                f"{self.eager_us:.0f} us per step)")

    def line(self, model: nn.Module) -> str:
        """One line for explain()."""
        if self.programs and not self.current(model):
            return ("stale: a kernel, dtype, threshold or predictor switch changed since capture; "
                    "generate runs the modules eagerly (cm.capture_steps() captures again)")
        if "decode" not in self.programs:
            return f"not captured: {self.reasons.get('decode', 'not tried')}"
        kinds = " and ".join(k for k in ("decode", "prefill") if k in self.programs)
        n_ops = len(picompile_ops(self.programs["decode"]))
        text = f"{kinds} exported (max_len {self.max_len}, {n_ops} picompile ops per decode step"
        if self.gqa_rewrites.get("decode"):
            text += f", {self.gqa_rewrites['decode']} attentions without repeated KV heads"
        text += ")"
        if "prefill" in self.reasons:
            text += f"; prefill not captured: {self.reasons['prefill']}"
        return f"{text}; {self.why}"


def capture(cm, max_len: int = 256, time_steps: bool = True) -> StepGraphs:
    """Export the compiled model's decode and prefill steps (see the module docstring); time the
    decode step against the eager one. Never raises for a model that does not export: the
    reasons are in the result. Runs the model, so the blocks' sparsity statistics restart."""
    steps = StepGraphs(max_len=max_len)
    model = cm._orig_mod
    why = hf_loop.model_reason(model)
    if why is None and max_len < 4:
        why = f"max_len must be at least 4, got {max_len}"
    if why is not None:
        steps.reasons["decode"] = why
        steps.why = "generate runs the modules eagerly"
        return steps
    device = _device(model)
    try:
        steps._step = step = _Step(model, max_len)
    except Exception as e:  # noqa: BLE001 - any failure: the model runs eagerly, with the reason
        steps.reasons["decode"] = f"its StaticCache did not build: {_reason(e)}"
        steps.why = "generate runs the modules eagerly"
        return steps
    ids = torch.zeros(1, 4, dtype=torch.long, device=device)  # example inputs: shapes only
    pos = torch.arange(4, device=device)
    # generate's prompt leaves a position for at least one new token (and HF's sliding-window
    # layers take another path for a prompt of the whole cache)
    length = torch.export.Dim("T", min=2, max=max_len - 1)
    exports = {"decode": ((ids[:, :1], pos[:1]), None),
               "prefill": ((ids, pos), ({1: length}, {0: length}))}
    with torch.no_grad():
        for kind, (args, dynamic) in exports.items():
            try:
                ep = torch.export.export(step, args, dynamic_shapes=dynamic, strict=False)
            except Exception as e:  # noqa: BLE001 - a model that does not export: say why
                steps.reasons[kind] = _reason(e)
                continue
            steps.programs[kind] = ep
            steps._run[kind] = run = _Runner(ep)
            steps.gqa_rewrites[kind] = step_graph.gqa_attention(run.gm)
    steps.key = Decoder.key(model)
    if time_steps:
        try:
            decide(steps, step)
        except Exception as e:  # noqa: BLE001 - a graph that fails to run is not used
            steps.why = f"generate runs the modules eagerly: the decode graph failed: {_reason(e)}"
    else:
        steps.why = "not timed: generate runs the modules eagerly"
    if cm.decoder() is not None:  # picompile's C decode step takes precedence in generate
        steps.use = False
        steps.why = "generate runs the C whole-step decoder" + (
            f" (the graph: {steps.timing()})" if steps.graph_us else "")
    cm.reset_stats()
    return steps


@torch.no_grad()
def decide(steps: StepGraphs, step: _Step) -> None:
    """Time the eager and the exported decode step, alternating on the same cache, check that
    their logits agree, and set steps.use / steps.why / the times."""
    if "decode" not in steps.programs or "prefill" not in steps.programs:
        steps.why = "generate runs the modules eagerly"
        return
    device = _device(step.model)
    graph = steps._run["decode"]
    tokens = torch.randint(0, step.model.config.vocab_size, (TIMED_STEPS + 1,),
                           generator=torch.Generator().manual_seed(0)).to(device)
    eager_t, graph_t, worst = [], [], 0.0
    for i in range(TIMED_STEPS + 1):
        ids, pos = tokens[i].view(1, 1), torch.tensor([i], device=device)  # [1, 1], [1]
        t0 = time.perf_counter()
        want = step(ids, pos)  # [1, vocab]
        t1 = time.perf_counter()
        got = graph(ids, pos)  # the same position again: same cache contents
        t2 = time.perf_counter()
        if i:  # the first step of each warms up
            eager_t.append(t1 - t0)
            graph_t.append(t2 - t1)
        scale = want.float().abs().max().clamp_min(1e-6)
        worst = max(worst, float((got.float() - want.float()).abs().max() / scale))
    steps.eager_us = statistics.median(eager_t) * 1e6
    steps.graph_us = statistics.median(graph_t) * 1e6
    speedup = steps.eager_us / steps.graph_us
    times = steps.timing()
    rtol = VERIFY_RTOL.get(step.model.dtype, 0.15)
    if worst > rtol:
        steps.why = (f"generate runs the modules eagerly: the graph's logits differ from the "
                     f"eager step's by {worst:.2g} of the largest")
    elif speedup > MIN_SPEEDUP:
        steps.use = True
        steps.why = f"generate runs the decode graph: {times}"
    else:
        steps.why = f"generate runs the modules eagerly: the graph is {times}"
