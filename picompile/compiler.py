"""The compiler: runs the passes in order and wraps the result.

    capture -> detect -> rewrite -> calibrate (thresholds) -> profile -> predictors -> place
    -> select kernels + lower the other linears -> time predictors (CPU) -> distribute (GPU)

Calibration and profiling run layer by layer on the GPU when the model is on the CPU and a GPU
is there (passes/calibrate.py). A compile that fails before placement puts the model back as
it was.

`load` re-runs capture, detect and rewrite on a fresh model and applies a saved plan instead of
calibrating, profiling and training again.
"""

from __future__ import annotations

import pathlib
import re
import warnings

import torch
import torch.fx as fx
from torch import nn

from picompile import gguf_weights, saving
from picompile.budget import parse_budget
from picompile.capture import capture, replace_module
from picompile.passes import calibrate as calibrate_pass
from picompile.passes import lower as lower_pass
from picompile.passes import predictors as predictors_pass
from picompile.passes import profile as profile_pass
from picompile.passes import quantize as quantize_pass
from picompile.passes import rewrite as rewrite_pass
from picompile.passes.detect import detect
from picompile.plan import MODES, PREDICTOR_POLICIES, QUANT_FORMATS, BlockPlan, Plan, Unmatched
from picompile.progress import note
from picompile.runtime.dense_linear import DenseLinear, QuantLinear
from picompile.runtime.sparse_ffn import SparseFFN


class CompiledModel(nn.Module):
    """The model with its FFN blocks rewritten. Called and `.generate(...)`d like the model it
    wraps; every other attribute (config, device, ...) is the wrapped model's."""

    def __init__(self, model: nn.Module, plan: Plan, graphs: dict[str, fx.GraphModule],
                 paths: dict[str, str]):
        super().__init__()
        self.model = model
        self.plan = plan
        # The rewritten graphs by module name. They are submodules of `model` already, so keep
        # them out of nn.Module's registry (no double counting in state_dict / parameters).
        object.__setattr__(self, "graphs", graphs)
        self.paths = paths  # block name -> execution path picked ("C", "reference (...)")
        self.linear_paths: dict[str, str] = {}  # other linears -> path (passes/lower.py)
        # under plan.quantize: what stayed float, and why; which layers got another format
        self.quant_notes: list[str] = []
        # block -> [n_ff] share of calibration tokens each neuron fired on (original neuron
        # order), from compile's profile (mode="predicted" or a gpu_budget); kept for report();
        # not saved with a plan
        self.firing: dict[str, torch.Tensor] = {}
        # the whole-step decoder (runtime/decoder.py) for the kernels bound now: see decoder()
        self._decoder_key = self._decoder = None
        self.decoder_reason = "not built yet"
        # whole-model capture (capture_whole.py): the exported decode / prefill steps, or None
        self.step_graphs = None

    def forward(self, *args, **kwargs):
        return self.model(*self._to_input_device(args), **self._to_input_device(kwargs))

    def generate(self, *args, **kwargs):
        """Hugging Face's generate arguments; picompile's own loop (static KV cache, prefill then
        decode) runs them where it supports every one, else HF's generate, with a note."""
        from picompile.runtime import generate as fast

        if not hasattr(self.model, "generate"):
            raise TypeError(f"{type(self.model).__name__} has no generate(); call the model instead")
        args, kwargs = self._to_input_device(args), self._to_input_device(kwargs)
        reason = fast.supported(self.model, kwargs, args)
        if reason is None:
            decoder = self.decoder()
            steps = self.step_graphs  # whole-model capture: only where no C decoder runs
            if decoder is not None or steps is None or not steps.current(self.model):
                steps = None
            return fast.generate_hf(self.model, *args, decoder=decoder, steps=steps, **kwargs)
        note(f"generate: Hugging Face's generate runs this call (picompile's loop does not "
             f"handle {reason})")
        return self.model.generate(*args, **kwargs)

    def decoder(self):
        """The decode step in one C call (runtime/decoder.py) for the kernels bound now, or None
        (`decoder_reason` says why). Built and verified again when a kernel, threshold or
        predictor switch changes (a dtype change, use_predictors, distribute)."""
        from picompile.runtime import decoder as whole_step

        key = whole_step.Decoder.key(self.model)
        if key != self._decoder_key:
            self._decoder, self.decoder_reason = whole_step.build(self.model)
            self._decoder_key = key
        return self._decoder

    def __getstate__(self):
        state = dict(super().__getstate__())
        state["_decoder"] = state["_decoder_key"] = None  # raw pointers: rebuilt when used
        state["step_graphs"] = None  # graphs of this process's modules: capture again
        return state

    def _to_input_device(self, values):
        """Tensors go where the model's first weights are (the GPU after distribute())."""
        device = next(iter(self.model.parameters())).device
        if device.type == "cpu":
            return values
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        if isinstance(values, dict):
            return {k: move(v) for k, v in values.items()}
        return tuple(move(v) for v in values)

    def distribute(self, device: str | torch.device = "cuda") -> None:
        """Run hybrid as planned: non-FFN parts and each block's hot neurons on `device`,
        cold neurons on the CPU. compile() calls this when a gpu_budget is given and a GPU is
        there; device="cpu" lets the CPU stand in for the GPU (tests, debugging)."""
        from picompile.runtime.hybrid import distribute

        ffns = self.ffns()
        distribute(self.model, ffns, device, move_non_ffn=self.plan.placement.fixed_on_gpu)
        for module in self.model.modules():  # their weights may have moved: pick again
            if isinstance(module, DenseLinear):
                module.select_kernel()
        for name, ffn in ffns.items():
            if ffn.predictor is not None:
                ffn.predictor.kernel = None  # the C kernel's weights were the CPU copies
            self.paths[name] = (f"hybrid: {ffn.block.hot_neurons} hot on {device}, "
                                f"{ffn.n_ff - ffn.block.hot_neurons} cold on the CPU")
        self.use_predictors(self.plan.predictors)

    def use_predictors(self, policy: str) -> None:
        """Which trained predictors run (the rest of the blocks run exact): "all", "none", or
        "auto": those whose block decodes faster with it on the CPU (BlockPlan.decode_us_*,
        measured by compile), and every one in the hybrid runtime, where a predictor runs on the
        GPU, costs the CPU nothing and spares it the gate rows of the cold neurons not predicted."""
        _check_predictor_policy(policy)
        self.plan.predictors = policy
        for ffn in self.ffns().values():
            if ffn.predictor is not None:
                b = ffn.block
                ffn.predictor.enabled = policy == "all" or policy == "auto" and (
                    ffn.hybrid is not None or b.decode_us_predicted < b.decode_us_exact)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)

    _OWN = frozenset({"model", "plan", "graphs", "paths", "linear_paths", "quant_notes", "training",
                      "decoder_reason", "firing", "step_graphs"})

    def capture_steps(self, max_len: int = 256):
        """Export the decode and prefill steps of the whole model (capture_whole.py) over a
        static KV cache of max_len positions; generate then runs them where they measured
        faster than the eager modules and no C decoder runs. Returns cm.step_graphs."""
        from picompile import capture_whole

        self.step_graphs = capture_whole.capture(self, max_len)
        return self.step_graphs

    def __setattr__(self, name: str, value) -> None:
        """Attributes are the wrapped model's (cm.generation_config = ... must reach the model
        generate() reads it from), except the wrapper's own."""
        if name in CompiledModel._OWN or name.startswith("_") or "model" not in self._modules:
            super().__setattr__(name, value)
        else:
            setattr(self.model, name, value)

    def save_pretrained(self, *args, **kwargs):
        raise TypeError(
            "picompile: save_pretrained would write the rewritten FFN layout (rows permuted, "
            "down transposed), which from_pretrained cannot load. Save the original model "
            "(model.save_pretrained before compile) and the plan with cm.save(dir); "
            "picompile.load(model, dir) rebuilds the compiled model without profiling")

    push_to_hub = save_pretrained

    def save(self, directory) -> None:
        """Write the plan (JSON) and predictors / neuron orders (safetensors), atomically."""
        tensors = {}
        for name, ffn in self.ffns().items():
            if ffn.order is not None:
                tensors[f"{name}.order"] = ffn.order
            if ffn.predictor is not None:
                for k in ("p1", "pb1", "p2", "pb2"):
                    tensors[f"{name}.predictor.{k}"] = getattr(ffn.predictor, k)
        saving.save(self.plan.to_json(), tensors, self.plan.fingerprint, directory)

    def ffns(self) -> dict[str, SparseFFN]:
        """Block name -> its SparseFFN module."""
        return {ffn.block.name: ffn for ffn in self.model.modules() if isinstance(ffn, SparseFFN)}

    def reset_stats(self) -> None:
        for ffn in self.ffns().values():
            ffn.reset_stats()

    def sparsity(self) -> float | None:
        """Share of (token, neuron) pairs skipped since the last reset_stats(), over all blocks."""
        active = total = 0
        for ffn in self.ffns().values():
            active, total = active + ffn.active_count(), total + ffn.total_pairs
        return None if total == 0 else 1.0 - active / total

    def report(self, path, *, prompt_ids: torch.Tensor | None = None, decode_tokens: int = 32):
        """Write one self-contained HTML file of plots and tables to `path`: see
        picompile/report.py (needs matplotlib: pip install 'picompile[report]')."""
        from picompile.report import report

        return report(self, path, prompt_ids=prompt_ids, decode_tokens=decode_tokens)


def _check_args(model, mode, sparsity, gpu_budget, predictors) -> int | None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"picompile.compile needs a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(map(repr, MODES))}")
    _check_predictor_policy(predictors)
    if sparsity is not None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
            raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
    return parse_budget(gpu_budget)


WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _check_dtype(dtype) -> torch.dtype | None:
    if dtype is None:
        return None
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    return WEIGHT_DTYPES[name]


PREDICTOR_TIMING_SAMPLES = 32  # block inputs from the profile on which compile times each block


def timing_samples(x: torch.Tensor, n: int = PREDICTOR_TIMING_SAMPLES) -> torch.Tensor:
    """n of the profile's block inputs x [N, d], at random (seeded). Not every (N/n)-th: the
    profile holds calibration rows in order, so a stride that divides the row length picks one
    position of every row, and position 0 is not like the rest (measured: it made a block of a
    d=1024 ReLU model time 1.5x slower than on decode's tokens)."""
    pick = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:n]
    return x[pick.sort().values]


def _check_predictor_policy(policy) -> None:
    if policy not in PREDICTOR_POLICIES:
        raise ValueError(f"unknown predictors={policy!r}; choose one of "
                         f"{', '.join(map(repr, PREDICTOR_POLICIES))}")


def _calibration_ids(calibration, tokenizer, n_tokens: int):
    """Token ids [batch, seq] to calibrate on: the user's, or the built-in corpus when only a
    tokenizer is given (its calibration split, topped up from its train split when more tokens
    are asked for; never its held-out split); None when neither is given."""
    if calibration is not None:
        return calibrate_pass.calibration_ids(calibration, tokenizer)
    if tokenizer is None:
        return None
    from picompile import corpus

    seq = 256
    rows = max(1, n_tokens // seq)
    calib_rows = min(rows, corpus.available_tokens(tokenizer, "calibration") // seq)
    parts = [corpus.token_batches(tokenizer, "calibration", calib_rows * seq, seq)]
    if rows > calib_rows:
        train_rows = min(rows - calib_rows, corpus.available_tokens(tokenizer, "train") // seq)
        parts.append(corpus.token_batches(tokenizer, "train", train_rows * seq, seq))
    return torch.cat(parts)


def compile(
    model: nn.Module,
    *,
    gpu_budget: int | str | None = None,
    mode: str = "exact",
    sparsity: float | None = None,
    calibration=None,
    tokenizer=None,
    quiet: bool = False,
    target_recall: float = 0.99,
    max_context: int = 2048,
    calibration_tokens: int = 32768,
    predictors: str = "auto",
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
    gguf=None,
) -> CompiledModel:
    """Compile `model` (rewritten in place) into activation-sparse FFN blocks.

    mode="exact": ReLU blocks compute only the neurons that fire, losslessly. SiLU/GELU blocks
    stay dense unless `sparsity` is given; then a per-block threshold on |down input|,
    calibrated on `calibration` (token ids, or strings with `tokenizer`), skips that share.

    mode="predicted": per block a trained low-rank predictor picks the neurons to compute
    (gate, up and down alike), catching `target_recall` of those that fire on calibration data.
    With only `tokenizer`, calibration uses `calibration_tokens` of the built-in corpus.
    predictors="auto" runs a block's predictor only where the block then decodes faster on the
    CPU, as timed here (small blocks may not gain: explain() shows bytes read and times); in
    the hybrid runtime they all run, on the GPU. predictors="all" runs every one.

    gpu_budget ("24GB", "24GiB", bytes): place the hottest neurons on the GPU within it, after
    the non-FFN weights, predictors and a KV cache for `max_context` tokens.

    dtype (torch.float32 / float16 / bfloat16 or its name): convert the model's weights first
    (in place); the kernels read that dtype and accumulate in float32. Default: the model's own.
    A plan saved from it loads onto a model converted the same way (model.to(dtype)).

    quantize ("q8_0", "q4_0", "q4_1": GGUF's block formats, see picompile/quant.py): the FFN
    blocks and the other linear layers are stored and read quantized (blocks of 32 weights with a
    float16 scale), after calibration, profiling and placement have measured the float model.
    Embeddings, norms and biases stay float. CPU only for now. Default: float weights.
    gguf (the GGUF file the model was loaded from): its Q8_0 / Q4_0 / Q4_1 tensors are used as
    they are, each in its own format (quantize="gguf", the default when gguf is given; see
    picompile/gguf_weights.py); a quantize format instead re-quantizes the float weights.
    """
    budget = _check_args(model, mode, sparsity, gpu_budget, predictors)
    dtype = _check_dtype(dtype)
    if gguf is not None and quantize is None:
        quantize = "gguf"
    _check_quantize(quantize, budget, gguf)
    _check_not_compiled(model, "compile")
    # Every check that can fail comes before the model is rewritten in place.
    ids = _calibration_ids(calibration, tokenizer, calibration_tokens)
    _check_ids_in_vocab(model, ids)
    needs_profile = mode == "predicted" or budget is not None
    if ids is None and (sparsity or needs_profile):
        what = f"sparsity={sparsity}" if sparsity else (
            "mode='predicted'" if mode == "predicted" else "gpu_budget (placement)")
        raise ValueError(
            f"{what} needs calibration data: pass calibration= (a LongTensor of token ids "
            "[batch, seq], or strings with tokenizer=), or just tokenizer= to calibrate on the "
            "built-in English corpus"
        )
    model.eval()
    if dtype is not None:
        model.to(dtype)
    plan = Plan(mode=mode, target_sparsity=sparsity, predictors=predictors,
                fingerprint=saving.fingerprint(model), quantize=quantize)
    plan.placement.budget_bytes = budget
    original = model
    model, graphs, ffns = _rewrite(model, plan)
    try:
        cm = _plan_and_lower(model, plan, graphs, ffns, ids, mode, sparsity, budget, max_context,
                             target_recall, predictors, quiet, gguf)
    except BaseException:
        # Nothing has permuted or moved a weight before placement: put the original modules
        # back, so that a retry (with other arguments) starts from the model as it was.
        if not any(f.order is not None or f.hybrid is not None for f in ffns.values()):
            _restore(original, graphs)
        raise
    finally:
        for gm in graphs.values():  # the originals hold weights the rewrite copied (down)
            gm.meta.pop("picompile_original", None)
    cm.decoder()  # built and verified now, not in the first generate()
    if not sparsity and any(not b.exact for b in plan.blocks):
        note(f"{sum(not b.exact for b in plan.blocks)} of {len(plan.blocks)} blocks are not ReLU "
             "and stay dense: pass sparsity= (e.g. 0.5) to skip their smallest activations", quiet)
    return cm


def _plan_and_lower(model, plan, graphs, ffns, ids, mode, sparsity, budget, max_context,
                    target_recall, predictors, quiet, gguf=None) -> CompiledModel:
    """calibrate -> profile -> predictors -> place -> select kernels -> autotune -> distribute."""
    needs_profile = mode == "predicted" or budget is not None

    # calibrate: thresholds for SiLU/GELU blocks, measured sparsity for all
    needs_threshold = bool(sparsity) and any(not b.exact for b in plan.blocks)
    device = calibrate_pass.calibration_device(model)  # "cuda": layer by layer for a CPU model
    if ids is not None:
        plan.calibration_tokens = int(ids.numel())
        if needs_threshold or not needs_profile:
            calibrate_pass.calibrate(model, ffns, ids, sparsity, quiet=quiet, device=device)

    # profile + predictors: which neurons fire, and small MLPs that guess it per token
    profiles = profile_pass.profile(model, ffns, ids, quiet=quiet, device=device) if needs_profile else {}
    for name, prof in profiles.items():
        ffns[name].block.measured_sparsity = 1.0 - prof.density
    if mode == "predicted":
        trained = predictors_pass.train_all(profiles, ffns, quiet=quiet,
                                             target_recall=target_recall)
        for name, (predictor, stats) in trained.items():
            block = ffns[name].block
            block.predictor_rank, block.predictor_recall = stats.rank, stats.recall
            block.predicted_density, block.true_density = stats.predicted_density, stats.true_density
            block.predictor_bytes = stats.nbytes
            block.predictor_tau = predictor.tau
            block.decode_bytes_exact, block.decode_bytes_predicted = predictors_pass.decode_bytes(
                ffns[name], stats)
            _attach_predictor(graphs, ffns[name], predictor)

    # place: hot neurons on the GPU within the budget, neurons permuted hot-first
    if budget is not None:
        _place(model, ffns, plan.placement, profiles, budget, max_context)
    cm = _finish(model, plan, graphs, ffns, gguf)
    cm.firing = {name: prof.freq for name, prof in profiles.items()}
    hybrid = budget is not None and torch.cuda.is_available() and plan.placement.fixed_on_gpu
    if mode == "predicted" and not hybrid:  # time each block with and without its predictor
        # (on the CPU: in the hybrid runtime every predictor runs, on the GPU)
        xs = [timing_samples(p.x) for p in profiles.values()]
        timed = predictors_pass.time_decode([ffns[name] for name in profiles], xs, quiet=quiet)
        for name, (exact_us, predicted_us) in zip(profiles, timed):
            ffns[name].block.decode_us_exact, ffns[name].block.decode_us_predicted = exact_us, predicted_us
        cm.use_predictors(predictors)
    if hybrid:
        profiles.clear()  # their samples may sit on the GPU, outside the budget
        torch.cuda.empty_cache()
        cm.distribute("cuda")
    used = sum(f.predictor.enabled for f in ffns.values() if f.predictor is not None)
    if mode == "predicted" and used < len(ffns):
        note(f"predictors run in {used} of {len(ffns)} blocks; the others decode faster exact "
             "on this CPU (explain() shows the timings; predictors='all' runs every one)", quiet)
    return cm


def _check_quantize(quantize, budget, gguf) -> None:
    if quantize is None:
        return
    if quantize not in QUANT_FORMATS:
        raise ValueError(f"quantize must be one of {', '.join(QUANT_FORMATS)} (GGUF's block "
                         f"formats, or the GGUF file's own) or None for float weights, got "
                         f"{quantize!r}")
    if quantize == "gguf" and (gguf is None or not pathlib.Path(gguf).is_file()):
        raise ValueError(f"quantize='gguf' keeps the tensors of the GGUF file the model was "
                         f"loaded from: pass gguf=<that file> (got {gguf!r})")
    if budget is not None:
        raise ValueError("quantize= runs on the CPU only so far: the GPU kernels read float "
                         "weights. Drop gpu_budget, or quantize=")


def _check_not_compiled(model, what: str) -> None:
    if isinstance(model, CompiledModel) or any(isinstance(m, SparseFFN) for m in model.modules()):
        raise ValueError(
            f"picompile.{what}: this model is already compiled by picompile (its FFN blocks are "
            "rewritten in place). Start from a fresh model: load it again, or keep "
            "copy.deepcopy(model) before the first compile")


def _check_ids_in_vocab(model, ids) -> None:
    """Calibration ids must index the model's embedding (a bad id fails deep in profiling)."""
    if ids is None or not hasattr(model, "get_input_embeddings"):
        return
    emb = model.get_input_embeddings()
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is None:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"calibration token ids must be in [0, {vocab}) for this model's "
                         f"vocabulary; got ids from {lo} to {hi}. Tokenize with the model's own "
                         "tokenizer (or pass tokenizer=)")


def _restore(model, graphs: dict[str, fx.GraphModule]) -> None:
    """Undo _rewrite: each captured submodule's original module goes back in its place."""
    for name, gm in graphs.items():
        if name:
            replace_module(model, name, gm.meta["picompile_original"])


def _rewrite(model: nn.Module, plan: Plan):
    """capture + detect + rewrite. Returns (model, graphs by module name, SparseFFNs by block)."""
    detections = {}

    def holds_block(name: str, gm: fx.GraphModule) -> bool:
        detections[name] = found = detect(gm)
        return bool(found.matches)

    captured, eager = capture(model, holds_block)
    plan.unmatched += [Unmatched(u.name, u.reason) for u in eager]
    plan.unmatched += [Unmatched(name, why) for name, found in detections.items() for why in found.rejected]

    graphs: dict[str, fx.GraphModule] = {}
    ffns: dict[str, SparseFFN] = {}
    for cap in captured:
        found = detections[cap.name]
        for i, match in enumerate(found.matches):
            attr = "sparse_ffn" if len(found.matches) == 1 else f"sparse_ffn_{i}"
            block_name = f"{cap.name}.{attr}" if cap.name else attr
            block = rewrite_pass.block_plan(cap.gm, match, cap.name, block_name)
            ffns[block_name] = rewrite_pass.rewrite(cap.gm, match, block, attr)
            plan.blocks.append(block)
        rewrite_pass.finish(cap.gm)
        graphs[cap.name] = cap.gm
        cap.gm.meta["picompile_original"] = model.get_submodule(cap.name)  # for _restore
        model = replace_module(model, cap.name, cap.gm)
    if not ffns:
        reasons = "; ".join(f"{u.module}: {u.reason}" for u in plan.unmatched[:5]) or (
            "no linear -> activation -> linear pattern anywhere in the traced graphs")
        raise ValueError(
            f"picompile found no FFN block in {type(model).__name__} ({reasons}). Supported: "
            "down(act(up x)), down(act(gate x) * up x), dReLU, fused gate_up; act in relu, silu, gelu"
        )
    return model, graphs, ffns


def _attach_predictor(graphs, ffn: SparseFFN, predictor) -> None:
    ffn.predictor = predictor.to(ffn.w_up.device)  # trained predictors come back on the CPU
    predictors_pass.insert_predictor_node(graphs[ffn.block.module], name_in_graph(ffn.block))


def _finish(model, plan, graphs, ffns, gguf=None) -> CompiledModel:
    """quantize (plan.quantize) -> pick each block's kernels, once, after every change to the
    weights -> lower the other linears -> which predictors run (plan.predictors)."""
    file_blocks, quant_notes = None, []
    if plan.quantize == "gguf":
        file_blocks, quant_notes = gguf_weights.read(gguf, model.config)
    if plan.quantize:
        quant_notes += quantize_pass.quantize_ffns(ffns, plan.quantize, file_blocks)
    paths = {name: ffn.select_kernel() for name, ffn in ffns.items()}
    for ffn in ffns.values():
        if ffn.predictor is not None:
            ffn.predictor.select_kernel()
    # lower: every other weight-bearing linear (attention projections, LM head) to the dense
    # kernel; after capture and detect, which find FFN blocks by their nn.Linear members
    linear_paths = lower_pass.lower_linears(model)
    if plan.quantize:
        quantized, notes = quantize_pass.quantize_linears(model, plan.quantize, file_blocks)
        linear_paths.update(quantized)
        quant_notes += notes
    cm = CompiledModel(model, plan, graphs, paths)
    cm.linear_paths = linear_paths
    cm.quant_notes = quant_notes
    cm.use_predictors(plan.predictors)
    cm.reset_stats()  # what calibration ran through the blocks is not the user's run
    return cm


def load(model: nn.Module, directory, gguf=None) -> CompiledModel:
    """Rebuild a compiled model from `cm.save(directory)` without profiling: `model` must be
    the model the plan was made from (checked by fingerprint); `gguf`: its GGUF file, for a plan
    compiled with quantize="gguf"."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"picompile.load needs the torch.nn.Module the plan was made for, got "
                        f"{type(model).__name__}")
    _check_not_compiled(model, "load")
    model.eval()
    plan_json, tensors = saving.read(directory, saving.fingerprint(model))
    try:
        saved = Plan.from_json(plan_json)
    except (KeyError, TypeError) as e:
        raise saving.PlanError(f"plan.json in {directory} does not describe a plan ({e!r}); "
                               "compile the model again and save it") from e
    plan = Plan(mode=saved.mode, target_sparsity=saved.target_sparsity,
                fingerprint=saved.fingerprint, placement=saved.placement,
                calibration_tokens=saved.calibration_tokens, predictors=saved.predictors,
                quantize=saved.quantize)
    if plan.quantize == "gguf" and gguf is None:
        raise ValueError(f"the plan in {directory} keeps the GGUF file's quantized tensors: pass "
                         "gguf=<the file the model was loaded from>")
    model, graphs, ffns = _rewrite(model, plan)
    for gm in graphs.values():
        gm.meta.pop("picompile_original", None)
    saving.check_blocks(plan.blocks, saved.blocks)
    plan.blocks = saved.blocks
    for block in saved.blocks:
        ffn = ffns[block.name]
        ffn.block = block
        ffn.threshold = block.threshold
        try:
            if f"{block.name}.order" in tensors:
                apply_order(ffn, tensors[f"{block.name}.order"])
            if block.predictor_rank is not None:
                p = {k: tensors[f"{block.name}.predictor.{k}"] for k in ("p1", "pb1", "p2", "pb2")}
                _attach_predictor(graphs, ffn, predictors_pass.Predictor(**p, tau=block.predictor_tau))
        except (KeyError, RuntimeError, IndexError) as e:
            raise saving.PlanError(f"the saved tensors for {block.name} are incomplete or do not "
                                   f"fit the model: {e}") from e
    cm = _finish(model, plan, graphs, ffns, gguf)
    cm.decoder()
    return cm


def _place(model, ffns, placement, profiles, budget: int, max_context: int) -> None:
    """Run the placement pass and record its decision in plan.placement and the blocks."""
    from picompile.passes import place as place_pass

    fixed = place_pass.account(model, ffns, max_context=max_context, budget_bytes=budget)
    demands = [place_pass.BlockDemand(name, f.n_ff, place_pass.neuron_bytes(f), profiles[name].freq)
               for name, f in ffns.items()]
    result = place_pass.place(budget_bytes=budget, fixed_bytes=fixed, blocks=demands)
    for name, ffn in ffns.items():
        apply_order(ffn, result.order[name])
        ffn.block.hot_neurons = result.hot[name]
    placement.gpu_bytes = result.gpu_bytes
    placement.fixed_bytes = dict(fixed)
    placement.fixed_on_gpu = result.fixed_on_gpu
    placement.expected_gpu_share = result.expected_gpu_share
    placement.notes = list(result.notes)
    if not torch.cuda.is_available():
        placement.notes.append("no CUDA GPU here: the plan is made, execution stays on the CPU")
        warnings.warn("picompile: no CUDA GPU found; the placement is planned (see explain()) "
                      "but everything runs on the CPU", stacklevel=3)


def apply_order(ffn: SparseFFN, order: torch.Tensor) -> None:
    """Permute the block's neurons (hot first) and remember the order, for save()."""
    from picompile.passes import place as place_pass

    place_pass.apply_order(ffn, order)
    ffn.order = order.long()


def name_in_graph(block: BlockPlan) -> str:
    """The SparseFFN's attribute name inside its captured graph module."""
    return block.name[len(block.module) + 1:] if block.module else block.name


def _weights_line(cm: CompiledModel) -> str:
    """Bytes of the weights by role and format: "FFN q4_0 12,345 B (30 blocks); ...", an FFN
    format "q4_1 (down q8_0)" where the down rows have their own. A tensor shared by several
    modules (tied weights) counts once."""
    from picompile.runtime.sparse_ffn import dtype_name

    groups: dict[tuple[str, str], list[int]] = {}  # (role, format) -> [modules, bytes]
    seen: set[int] = set()

    def add(role, fmt, tensors):
        tensors = [t for t in tensors if t is not None and id(t) not in seen]
        seen.update(id(t) for t in tensors)
        g = groups.setdefault((role, fmt), [0, 0])
        g[0] += 1
        g[1] += sum(t.numel() * t.element_size() for t in tensors)

    for m in cm.model.modules():
        if isinstance(m, SparseFFN):
            fmt = getattr(m, "qformat", None) or dtype_name(m.w_up.dtype)
            if m.down_format != fmt:
                fmt = f"{fmt} (down {m.down_format})"
            add("FFN", fmt, [m.w_gate, m.w_up, m.w_down_t])
        elif isinstance(m, QuantLinear):
            add("linear", m.qformat, [m.qweight])
        elif isinstance(m, DenseLinear):
            add("linear", dtype_name(m.weight.dtype), [m.weight])
    rest: dict[str, int] = {}  # everything else (embeddings, norms, biases, eager layers)
    for t in list(cm.model.parameters()) + list(cm.model.buffers()):
        if id(t) not in seen and t.is_floating_point():
            seen.add(id(t))
            rest[dtype_name(t.dtype)] = rest.get(dtype_name(t.dtype), 0) + t.numel() * t.element_size()
    parts = [f"{role} {fmt} {b:,} B ({n} {'blocks' if role == 'FFN' else 'layers'})"
             for (role, fmt), (n, b) in groups.items()]
    parts += [f"other {fmt} {b:,} B" for fmt, b in rest.items()]
    return "; ".join(parts)


def explain(cm: CompiledModel) -> str:
    """A readable report: per block what was found and decided; what was left dense, and why."""
    if not isinstance(cm, CompiledModel):
        raise TypeError(f"explain() takes a CompiledModel, got {type(cm).__name__}")
    plan, ffns = cm.plan, cm.ffns()
    predicted = plan.mode == "predicted"
    placed = plan.placement.budget_bytes is not None

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    head = f"picompile: {len(plan.blocks)} FFN blocks, mode={plan.mode}"
    if plan.target_sparsity and any(not b.exact for b in plan.blocks):
        head += f", target sparsity {plan.target_sparsity:.0%}"
    if plan.calibration_tokens:
        head += f", calibrated on {plan.calibration_tokens} tokens"
    cols = f"  {'block':<34} {'kind':<8} {'act':<9} {'d x n_ff':<11} {'skips':<14} {'calib.':>6} {'run':>6}"
    if predicted:
        cols += (f" {'rank':>5} {'recall':>7} {'pred/true density':>17} {'pred.bytes':>10}"
                 f" {'B/token exact->pred':>21} {'us exact->pred':>14} {'used':>4}")
    if placed:
        cols += f" {'hot':>6}"
    lines = [head, cols + "  path"]
    for b in plan.blocks:
        how = "exact zeros" if b.threshold == 0 else f"|h|<={b.threshold:.3g}"
        if not b.exact and b.threshold == 0:
            how = "none (dense)"
        ffn = ffns.get(b.name)
        row = (f"  {b.name:<34} {b.kind + ('+bias' if b.bias else ''):<8} {b.act:<9} "
               f"{f'{b.d_model}x{b.d_ff}':<11} {how:<14} {pct(b.measured_sparsity):>6} "
               f"{pct(ffn.sparsity if ffn is not None else None):>6}")
        if predicted:
            dens = f"{pct(b.predicted_density)} / {pct(b.true_density)}"
            row += f" {b.predictor_rank or '-':>5} {pct(b.predictor_recall):>7} {dens:>17} {b.predictor_bytes:>10}"
            used = "yes" if ffn is not None and ffn.predictor is not None and ffn.predictor.enabled else "no"
            row += (f" {f'{b.decode_bytes_exact:,}->{b.decode_bytes_predicted:,}':>21}"
                    f" {f'{b.decode_us_exact:.0f}->{b.decode_us_predicted:.0f}':>14} {used:>4}")
        if placed:
            row += f" {b.hot_neurons:>6}"
        lines.append(row + f"  {cm.paths.get(b.name, '-')}")
    lines.append("  calib.: sparsity measured on calibration data; run: since the last reset_stats()")
    if cm.linear_paths:
        by_path: dict[str, int] = {}
        for path in cm.linear_paths.values():
            by_path[path] = by_path.get(path, 0) + 1
        lines.append("other linears (attention, LM head): " +
                     "; ".join(f"{n} {path}" for path, n in by_path.items()))
    lines.append("weights: " + _weights_line(cm))
    lines += [f"  quantization: {n}" for n in cm.quant_notes]
    lines.append("decode step: " + ("picompile decoder (kernels/decoder.c, one C call per token)"
                                    if cm._decoder is not None else
                                    f"per module in PyTorch (whole-step decoder: {cm.decoder_reason})"))
    lines.append("whole-model graph: " + ("not captured (cm.capture_steps() exports it)"
                                          if cm.step_graphs is None else cm.step_graphs.line(cm.model)))
    if predicted:
        lines.append(f"  B/token: weight bytes read per decoded token; us: measured microseconds "
                     f"per decoded token; used: the block runs its predictor "
                     f"(predictors={plan.predictors!r})")
    if placed:
        p = plan.placement
        lines.append(f"placement: budget {p.budget_bytes:,} B, on the GPU {p.gpu_bytes:,} B, "
                     f"expected share of firing neurons on the GPU {p.expected_gpu_share:.1%}")
        lines += [f"  {item}: {n:,} B" for item, n in p.fixed_bytes.items()]
        if not p.fixed_on_gpu:
            lines.append("  the non-FFN parts do not fit the budget: they run on the CPU too")
        lines += [f"  note: {n}" for n in p.notes]
    if plan.unmatched:
        lines.append("left dense or eager:")
        groups: dict[tuple[str, str], int] = {}  # (module name with layer numbers as *, reason)
        for u in plan.unmatched:
            key = (re.sub(r"\.\d+(?=\.|$)", ".*", u.module) or "<model>", u.reason)
            groups[key] = groups.get(key, 0) + 1
        lines += [f"  {name}{f' (x{n})' if n > 1 else ''}: {reason}"
                  for (name, reason), n in groups.items()]
    return "\n".join(lines)
