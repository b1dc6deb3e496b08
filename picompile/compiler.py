"""The compiler: compile() is the pass list; each stage is a short function below, each pass a
file of its own.

    capture -> detect -> rewrite                          _capture     (capture.py, passes/detect, passes/rewrite)
    -> calibrate -> profile -> predictors -> place        _decide      (passes/calibrate, profile, predictors, place)
    -> Hessians (quantize= a format, with calibration)    _hessians    (passes/hessians)
    -> quantize -> lower linears -> huge pages -> kernels _lower       (passes/quantize, passes/lower)
    -> autotune (time predictors on this CPU)             passes/autotune
    -> distribute (hybrid, when a GPU is there)           runtime/hybrid
    -> whole-step decoder, built and verified             runtime/decoder

Data flows one way: the passes fill the Plan (plan.py: what was found, decided, measured), the
lowering binds kernels from it, the runtime (CompiledModel, compiled_model.py) runs them.
Calibration and profiling run layer by layer on the GPU when the model is on the CPU and a GPU
is there, and layer by layer in float32 for a float16 / bfloat16 model on a CPU-only machine
(passes/calibrate.py). A compile that fails (or is interrupted) before placement puts the model
back as it was.

`load` re-runs capture, detect and rewrite on a fresh model and applies a saved plan instead of
calibrating, profiling and training again.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from picompile import gguf_weights, quant, saving
from picompile.activations import ACTIVATIONS
from picompile.capture import capture, replace_module
from picompile.compiled_model import CompiledModel
from picompile.options import (Options, calibration_ids, check_gguf, check_kv_cache,
                               check_not_compiled, check_options)
from picompile.passes import autotune as autotune_pass
from picompile.passes import calibrate as calibrate_pass
from picompile.passes import hessians as hessians_pass
from picompile.passes import linearize
from picompile.passes import lower as lower_pass
from picompile.passes import predictors as predictors_pass
from picompile.passes import profile as profile_pass
from picompile.passes import quantize as quantize_pass
from picompile.passes import rewrite as rewrite_pass
from picompile.passes.detect import activation_of, detect
from picompile.passes.profile import BlockProfile
from picompile.plan import BlockPlan, Mode, Plan, Unmatched
from picompile.progress import note, warn_user
from picompile.runtime import memory
from picompile.runtime.dense_linear import DenseLinear, QuantLinear
from picompile.runtime.predictor import Predictor
from picompile.runtime.sparse_ffn import SparseFFN


@dataclass
class Captured:
    """capture -> detect -> rewrite: the model with its FFN blocks as SparseFFN modules."""

    model: nn.Module  # the same model, its captured submodules swapped for their graphs
    graphs: dict[str, fx.GraphModule]  # by module name ("" for a model captured whole)
    ffns: dict[str, SparseFFN]  # by block name
    # GPT-2's Conv1D layers the model held, now nn.Linear (linearize.put_back undoes it)
    conv1d: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)

    def forget_originals(self) -> None:
        """Drop what undoing the capture needs (the modules it replaced, with their weights):
        from here on the compile does not undo itself."""
        for gm in self.graphs.values():
            gm.meta.pop("picompile_original", None)
        self.conv1d.clear()


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
    gptq: bool = True,
    gguf=None,
    kv_cache: torch.dtype | str | None = None,
) -> CompiledModel:
    """Compile `model` (rewritten in place) into activation-sparse FFN blocks.

    mode="exact": ReLU (and squared-ReLU) blocks compute only the neurons that fire, losslessly.
    SiLU/GELU blocks stay dense unless `sparsity` is given; then a per-block threshold on |down
    input|, calibrated on `calibration` (token ids, or strings with `tokenizer`), skips that
    share.

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
    Embeddings, norms and biases stay float. With gpu_budget, the FFN blocks' hot rows and the
    layers that go to the GPU whole (attention, LM head) run quantized there (placement counts
    their quantized bytes). Default: float weights. With calibration data
    (calibration= or tokenizer=) the blocks are rounded by GPTQ (picompile/gptq.py: each layer's
    rounding errors compensated along its inputs' Hessian over the calibration tokens; SmolLM2
    at q4_0: BENCHMARKS.md session 11); without, or with gptq=False (seconds where GPTQ takes
    minutes on a large model), to nearest.
    gguf (the GGUF file the model was loaded from): its Q8_0 / Q4_0 / Q4_1 tensors are used as
    they are, each in its own format (quantize="gguf", the default when gguf is given; see
    picompile/gguf_weights.py); a quantize format instead re-quantizes the float weights.

    kv_cache ("float16", "bfloat16", "float32" or the torch dtype): the dtype of the KV cache
    picompile's C decode step keeps (cm.kv_cache_dtype; set it later to change it). Default:
    the model's own dtype, as Hugging Face's cache holds it. float16 halves what attention reads
    per token at depth, as llama.cpp's default F16 cache does, for a float32 model (one loaded
    from a GGUF file is), at the cost of rounding keys and values to float16.
    """
    opts = check_options(model, mode=mode, sparsity=sparsity, gpu_budget=gpu_budget,
                         predictors=predictors, dtype=dtype, quantize=quantize, gptq=gptq,
                         gguf=gguf, target_recall=target_recall, max_context=max_context,
                         kv_cache=kv_cache, quiet=quiet)
    ids = calibration_ids(model, calibration, tokenizer, calibration_tokens, opts)
    model.eval()
    if opts.dtype is not None:
        model.to(opts.dtype)
    plan = Plan(mode=opts.mode, target_sparsity=opts.sparsity, predictors=opts.predictors,
                fingerprint=saving.fingerprint(model), quantize=opts.quantize)
    plan.placement.budget_bytes = opts.budget
    if opts.quantize == "gguf":
        plan.gguf_types = gguf_weights.tensor_types(opts.gguf)

    captured = _capture(model, plan)
    try:
        profiles = _decide(captured, plan, ids, opts)
        rounding = _hessians(captured, plan, ids, opts)
    except BaseException:
        # Nothing has permuted or moved a weight before placement: put the original modules
        # back, so that a retry (with other arguments) starts from the model as it was.
        if not any(f.order is not None or f.hybrid is not None for f in captured.ffns.values()):
            _restore(model, captured)
        raise
    finally:
        # The originals hold the float weights (the rewrite shares or copies them): gone before
        # lowering, which quantizes, so that the float and the quantized model are never both
        # held (a 7B float16 model is 13.5 GB).
        captured.forget_originals()
        _collect(model)  # modules and their graphs hold each other: freed by the collector only
    if plan.placement.budget_bytes is not None and not plan.placement.fixed_on_gpu:
        _onto_cpu(model)
    cm = _lower(captured, plan, opts.gguf, rounding)
    cm.kv_cache_dtype = opts.kv_cache
    del rounding  # GPTQ blocks no layer took (a weight under two names is quantized once)
    cm.firing = {name: prof.freq for name, prof in profiles.items()}
    hybrid = runs_hybrid(plan)
    if opts.mode == Mode.PREDICTED and not hybrid:  # in the hybrid runtime every predictor runs
        autotune_pass.autotune(cm.ffns(), {n: p.x for n, p in profiles.items()}, quiet=opts.quiet)
        cm.use_predictors(opts.predictors)
    profiles.clear()  # their samples may sit on the GPU, outside the budget
    if hybrid:
        torch.cuda.empty_cache()
        cm.distribute("cuda")
    cm.decoder()  # built and verified now, not in the first generate()
    _notes(cm, opts)
    _collect(model)  # the float weights the lowering replaced, held in cycles
    return cm


def _onto_cpu(model: nn.Module) -> None:
    """The plan puts nothing on the GPU (the parts outside the FFN blocks alone exceed the
    budget): a model given on a GPU moves to the CPU, where the plan runs it, so that it neither
    holds more GPU memory than the budget nor runs PyTorch's path on the GPU unplanned."""
    if all(p.device.type == "cpu" for p in model.parameters()):
        return
    model.to("cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _collect(model: nn.Module, min_bytes: int = 1 << 28) -> None:
    """gc.collect() where the weights freed are worth its time (about 0.2 s with transformers
    loaded, as long as compiling a test-sized model)."""
    if sum(p.nbytes for p in model.parameters()) >= min_bytes:
        gc.collect()


def _capture(model: nn.Module, plan: Plan) -> Captured:
    """linearize, then capture + detect + rewrite (_find_blocks); the model as it was where
    that fails."""
    conv1d = linearize.conv1d_to_linear(model)
    try:
        return Captured(*_find_blocks(model, plan), conv1d)
    except BaseException:
        linearize.put_back(conv1d)
        raise


def _find_blocks(model: nn.Module, plan: Plan):
    """capture + detect + rewrite -> (model, graphs, ffns) as Captured holds them; what is not
    matched goes to plan.unmatched with its reason."""
    detections = {}

    def holds_block(name: str, gm: fx.GraphModule) -> bool:
        detections[name] = found = detect(gm)
        return bool(found.matches)

    def holds_part(gm: fx.GraphModule) -> bool:
        """An activation: maybe a block's, with linears of a parent."""
        return any(activation_of(gm, node) is not None for node in gm.graph.nodes)

    captured, eager = capture(model, holds_block, holds_part)
    kept_eager = [Unmatched(u.name, u.reason) for u in eager]
    rejected = [Unmatched(name or type(model).__name__, why)
                for name, found in detections.items() for why in found.rejected]
    plan.unmatched += kept_eager + rejected

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
        shown = (rejected + kept_eager)[:5]  # detect's near-misses first: they say most
        reasons = "; ".join([*_unsupported_kinds(model), *(f"{u.module}: {u.reason}"
                                                          for u in shown)]) or (
            "no linear -> activation -> linear pattern anywhere in the traced graphs")
        raise ValueError(
            f"picompile found no FFN block in {type(model).__name__} ({reasons}). Supported: "
            "down(act(up x)), down(act(gate x) * up x), dReLU, fused gate_up; act in "
            f"{', '.join(ACTIVATIONS)}. Nothing here runs sparse: run the model with transformers "
            "as it is"
        )
    return model, graphs, ffns


def _unsupported_kinds(model: nn.Module) -> list[str]:
    """Kinds of FFN picompile does not compile that `model` has, said first when it finds no
    block: mixture-of-experts blocks."""
    out = []
    moe = next((f"{name}: {kind}" for name, m in model.named_modules()
                for kind in [type(m).__name__]  # not the model's own classes (GraniteMoeModel)
                if any(k in kind.lower() for k in ("moe", "experts"))
                and not kind.endswith(("Model", "ForCausalLM"))), None)
    if moe is not None:
        out.append(f"its FFNs are mixture-of-experts blocks ({moe}), which picompile does not "
                   "compile: only a dense model's FFN blocks (or an MoE's shared expert)")
    return out


def _restore(model, captured: Captured) -> None:
    """Undo _capture: each captured submodule's original module goes back in its place, and
    each Conv1D in its own."""
    for name, gm in captured.graphs.items():
        if name:
            replace_module(model, name, gm.meta["picompile_original"])
    linearize.put_back(captured.conv1d)


def _decide(captured: Captured, plan: Plan, ids, opts: Options) -> dict[str, BlockProfile]:
    """calibrate -> profile -> predictors -> place, recorded in the plan's blocks. Returns the
    profiles (per-neuron firing, block input samples) for autotune and report()."""
    model, ffns = captured.model, captured.ffns
    # layer by layer on the GPU for a CPU model, or in float32 for a float16 model on the CPU
    device, dtype = calibrate_pass.calibration_device(model)
    # calibrate: thresholds for SiLU/GELU blocks, measured sparsity for all. Without a target
    # sparsity only ReLU blocks have one to measure (a SiLU / GELU block at threshold 0 skips
    # nothing), so with none of those the pass would run every calibration token for nothing.
    needs_threshold = bool(opts.sparsity) and any(not b.exact for b in plan.blocks)
    measures = not opts.needs_profile and any(b.exact for b in plan.blocks)
    if ids is not None and (needs_threshold or measures or opts.needs_profile):
        plan.calibration_tokens = int(ids.numel())  # what explain() says the plan saw
    if ids is not None and (needs_threshold or measures):
        calibrate_pass.calibrate(model, ffns, ids, opts.sparsity, quiet=opts.quiet, device=device,
                                 dtype=dtype)
    if not opts.needs_profile:
        return {}
    # profile + predictors: which neurons fire, and small MLPs that guess it per token
    profiles = profile_pass.profile(model, ffns, ids, quiet=opts.quiet, device=device, dtype=dtype)
    for name, prof in profiles.items():
        ffns[name].block.measured.sparsity = 1.0 - prof.density
    if opts.mode == Mode.PREDICTED:
        trained = predictors_pass.train_all(profiles, ffns, quiet=opts.quiet,
                                             target_recall=opts.target_recall)
        for name, (predictor, stats) in trained.items():
            predictors_pass.record(ffns[name], predictor, stats)
            _attach_predictor(captured.graphs, ffns[name], predictor)
    # place: hot neurons on the GPU within the budget, neurons permuted hot-first
    if opts.budget is not None:
        formats = quantize_pass.planned_ffn_formats(ffns, opts.quantize, opts.gguf)
        linears = quantize_pass.planned_linear_bytes(model, ffns, opts.quantize, opts.gguf)
        _place(model, ffns, plan.placement, profiles, opts.budget, opts.max_context, formats,
               linears)
    return profiles


def runs_hybrid(plan: Plan) -> bool:
    """Whether the plan's blocks run split across a GPU here: a budget was given, the non-FFN
    parts fit it (placement), and a CUDA GPU is present."""
    p = plan.placement
    return p.budget_bytes is not None and p.fixed_on_gpu and torch.cuda.is_available()


def _hessians(captured: Captured, plan: Plan, ids, opts: Options):
    """For quantize= a block format with calibration ids: the Hessians of every quantized
    layer's inputs (passes/hessians.py), gathered from the float model, as the quantize pass's
    GPTQ rounding (plan.quant_calibration_tokens: how many tokens). Else None: round to nearest.
    Where calibration runs layer by layer, or where every layer's Hessians would not fit
    hessians.MAX_BYTES at once (a float32 model of a billion parameters and more, which
    calibrates whole), GPTQ runs layer by layer, on each layer's Hessians as they are
    complete, so only one layer's are held (a 7B model's all take ~22 GB). Layer by layer the
    LM head is not run: it rounds to nearest."""
    if opts.quantize not in quant.FORMATS or ids is None:
        return None
    if not opts.gptq:
        return quantize_pass.Rounding(skipped="compile(gptq=False) asked for it")
    model, ffns = captured.model, captured.ffns
    tokens = hessians_pass.calibration_rows(ids).numel()  # Hessians wider than that: not held
    device, dtype = calibrate_pass.calibration_device(model)
    layers = None if device is None else calibrate_pass.decoder_layers(model)
    if layers is None and hessians_pass.estimate_bytes(model, ffns, max_width=tokens) > \
            hessians_pass.MAX_BYTES:
        try:  # layer by layer where the model is, in its dtype
            layers = calibrate_pass.decoder_layers(model)
            device, dtype = next(model.parameters()).device, None
        except calibrate_pass.LayerwiseUnsupported:
            pass
    need = hessians_pass.estimate_bytes(model, ffns, layers, max_width=tokens)
    if need > hessians_pass.MAX_BYTES:
        held = "per layer " if layers is not None else ""
        return quantize_pass.Rounding(skipped=f"GPTQ's Hessians would take {need / 2**30:.1f} GiB "
                                              f"{held}(more than {hessians_pass.MAX_BYTES >> 30} GiB)")
    targets = quantize_pass.gptq_targets(model, ffns, opts.quantize)
    rounding = quantize_pass.Rounding(tokens=tokens)
    rounding.too_wide = quantize_pass.too_wide(targets, tokens)
    weights = len({id(w) for w, _, _ in targets.values()})
    if weights and sum(rounding.too_wide.values()) == weights:  # none for GPTQ: no Hessians
        widths = sorted(rounding.too_wide)
        return quantize_pass.Rounding(skipped=f"{tokens} calibration tokens are fewer than the "
                                              f"inputs of every weight (at least {widths[0]}); "
                                              f"pass at least {widths[-1]} for GPTQ on all")
    done = None if layers is None else (lambda hessians: rounding.gather(hessians, targets))
    rest, _ = hessians_pass.collect(model, ffns, ids, quiet=opts.quiet, device=device,
                                    dtype=dtype, done=done, max_width=tokens)
    rounding.gather(rest, targets, quiet=opts.quiet)  # whole model: all; layer by layer: none
    plan.quant_calibration_tokens = rounding.tokens
    return rounding


def _lower(captured: Captured, plan: Plan, gguf=None, rounding=None) -> CompiledModel:
    """quantize (plan.quantize; rounding: GPTQ or saved blocks, quantize_pass.Rounding) -> lower
    the other linears -> weights into huge pages -> pick each block's kernels, once, after every
    change to the weights -> which predictors run (plan.predictors)."""
    model, ffns = captured.model, captured.ffns
    file_blocks, quant_notes = None, []
    if plan.quantize == "gguf":
        file_blocks, quant_notes = gguf_weights.read(gguf, model.config)
    if plan.quantize:
        quant_notes += quantize_pass.quantize_ffns(ffns, plan.quantize, file_blocks, rounding)
        for ffn in ffns.values():  # predicted mode's bytes per token, at the quantized rows
            predictors_pass.refresh_decode_bytes(ffn)
    # lower: every other weight-bearing linear (attention projections, LM head) to the dense
    # kernel; after capture and detect, which find FFN blocks by their nn.Linear members
    linear_paths = lower_pass.lower_linears(model)
    if plan.quantize:
        quantized, notes = quantize_pass.quantize_linears(model, plan.quantize, file_blocks,
                                                          rounding)
        linear_paths.update(quantized)
        quant_notes += notes
    if plan.quantize in quant.FORMATS:
        quant_notes.append(quantize_pass.rounding_note(
            rounding, plan.quant_calibration_tokens, quantize_pass.quantized_matrices(model, ffns)))
    # the weights the kernels stream, in huge pages (runtime/memory.py); the linears' kernels,
    # bound when they were lowered, bind to the moved tensors again
    linears = [m for m in model.modules() if isinstance(m, (DenseLinear, QuantLinear))]
    if memory.weights_to_huge_pages([*ffns.values(), *linears]):
        for lin in linears:
            lin.select_kernel()
    paths = {name: ffn.select_kernel() for name, ffn in ffns.items()}
    for ffn in ffns.values():
        if ffn.predictor is not None:
            ffn.predictor.select_kernel()
    cm = CompiledModel(model, plan, captured.graphs, paths)
    cm.linear_paths = linear_paths
    cm.quant_notes = quant_notes
    cm.use_predictors(plan.predictors)
    cm.reset_stats()  # what calibration ran through the blocks is not the user's run
    return cm


def _notes(cm: CompiledModel, opts: Options) -> None:
    """One line each for what the user may not expect: blocks left dense, predictors off, a
    model on a GPU without a budget, a KV cache dtype the GPU decoder does not take, nothing
    quantized."""
    blocks, ffns = cm.plan.blocks, cm.ffns()
    if opts.sparsity is None and any(not b.exact for b in blocks):  # (0: dense on purpose)
        note(f"{sum(not b.exact for b in blocks)} of {len(blocks)} blocks are not ReLU "
             "and stay dense: pass sparsity= (e.g. 0.5) to skip their smallest activations", opts.quiet)
    device = next((p.device for p in cm._orig_mod.parameters() if p.device.type != "cpu"), None)
    if opts.budget is None and device is not None:
        note(f"the model is on {device} and no gpu_budget was given: its FFN blocks run "
             "PyTorch's reference path there, not picompile's kernels; pass gpu_budget= (up to "
             "the GPU's free memory) for the CUDA kernels and the device decoder", opts.quiet)
    if opts.kv_cache is not None and runs_hybrid(cm.plan):
        note(f"kv_cache={str(opts.kv_cache).removeprefix('torch.')} applies to the CPU decoder; "
             "the decoder split across the GPU keeps the model's dtype", opts.quiet)
    if opts.quantize and not quantize_pass.quantized_matrices(cm._orig_mod, ffns):
        note(f"quantize={opts.quantize!r} quantized no weight: every one stays float (explain() "
             "says why for each; widths must be multiples of 32)", opts.quiet)
    used = sum(f.predictor.enabled for f in ffns.values() if f.predictor is not None)
    if opts.mode == Mode.PREDICTED and used < len(ffns):
        note(f"predictors run in {used} of {len(ffns)} blocks; the others decode faster exact "
             "on this CPU (explain() shows the timings; predictors='all' runs every one)", opts.quiet)


def load(model: nn.Module, directory, gguf=None, kv_cache=None,
         distribute: bool = True, quiet: bool = False) -> CompiledModel:
    """Rebuild a compiled model from `cm.save(directory)` without profiling: `model` must be
    the model the plan was made from (checked by fingerprint); `gguf`: its GGUF file, for a plan
    compiled with quantize="gguf"; kv_cache as compile's (a runtime choice, not saved). A plan
    made with a gpu_budget runs split across the GPU as planned where one is here, as after
    compile; distribute=False keeps it all on the CPU (cm.distribute() splits it later).
    quiet: no notes (as compile's)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"picompile.load needs the torch.nn.Module the plan was made for, got "
                        f"{type(model).__name__}")
    check_not_compiled(model, "load")
    kv_dtype = check_kv_cache(kv_cache)
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
                quantize=saved.quantize, quant_calibration_tokens=saved.quant_calibration_tokens,
                gguf_types=saved.gguf_types)
    check_gguf(gguf)
    if plan.quantize == "gguf" and gguf is None:
        raise ValueError(f"the plan in {directory} keeps the GGUF file's quantized tensors: pass "
                         "gguf=<the file the model was loaded from>")
    if plan.quantize == "gguf":
        gguf_weights.check_model(gguf, getattr(model, "config", None))
        gguf_weights.check_types(gguf, plan.gguf_types, directory)
    elif gguf is not None:
        note(f"the GGUF file's own quantized tensors are not used: the plan in {directory} "
             f"was compiled with quantize={plan.quantize!r}", quiet)
    captured = _capture(model, plan)
    try:  # what can refuse the plan, before anything changes a weight: the model as it was then
        saving.check_blocks(plan.blocks, saved.blocks)
        if plan.quant_calibration_tokens:
            _check_saved_quant_blocks(captured, plan.quantize, tensors)
    except BaseException:
        _restore(model, captured)
        raise
    captured.forget_originals()
    plan.blocks = saved.blocks
    for block in saved.blocks:
        ffn = captured.ffns[block.name]
        ffn.block = block
        ffn.threshold = block.decided.threshold
        try:
            if f"{block.name}.order" in tensors:
                apply_order(ffn, tensors[f"{block.name}.order"])
            if block.decided.predictor_rank is not None:
                p = {k: tensors[f"{block.name}.predictor.{k}"] for k in ("p1", "pb1", "p2", "pb2")}
                _attach_predictor(captured.graphs, ffn, Predictor(**p, tau=block.decided.predictor_tau))
        except (KeyError, RuntimeError, IndexError) as e:
            raise saving.PlanError(f"the saved tensors for {block.name} are incomplete or do not "
                                   f"fit the model: {e}") from e
    rounding = None  # GPTQ blocks as compile chose them, saved with the plan
    if plan.quant_calibration_tokens:
        rounding = quantize_pass.Rounding(saved={k: t for k, t in tensors.items()
                                                 if k.endswith(".blocks")})
    if plan.placement.budget_bytes is not None and not plan.placement.fixed_on_gpu:
        _onto_cpu(model)  # as compile: the plan runs it on the CPU
    cm = _lower(captured, plan, gguf, rounding)
    cm.kv_cache_dtype = kv_dtype
    if runs_hybrid(plan) and distribute:
        torch.cuda.empty_cache()
        cm.distribute("cuda")
    elif runs_hybrid(plan):
        note("the plan splits the model across a GPU and the CPU (gpu_budget); it runs on the "
             "CPU until cm.distribute() puts it on the GPU as planned", quiet)
    cm.decoder()
    return cm


def _check_saved_quant_blocks(captured: Captured, fmt: str, tensors: dict) -> None:
    """PlanError unless a GPTQ plan's tensors hold the blocks of every weight quantize will
    round (Rounding.blocks would refuse it too, but only with the model half quantized). A
    layer under several names is saved (and rounded) under its first."""
    first = {}
    for key, (w, _, _) in quantize_pass.gptq_targets(captured.model, captured.ffns, fmt).items():
        first.setdefault(id(w), key)
    missing = sorted(f"{key}.blocks" for key in first.values() if f"{key}.blocks" not in tensors)
    if missing:
        raise saving.PlanError(f"saved tensor {missing[0]} is missing ({len(missing)} in all; the "
                               "plan was quantized by GPTQ and keeps the blocks of every weight): "
                               "compile the model again and save it")


def _attach_predictor(graphs, ffn: SparseFFN, predictor) -> None:
    ffn.predictor = predictor.to(ffn.w_up.device)  # trained predictors come back on the CPU
    predictors_pass.insert_predictor_node(graphs[ffn.block.module], name_in_graph(ffn.block))


def _place(model, ffns, placement, profiles, budget: int, max_context: int,
           formats: dict[str, tuple[str, str]], linears: dict[int, int]) -> None:
    """Run the placement pass and record its decision in plan.placement and the blocks.
    `formats`: {block: (gate / up format, down format)} of the blocks quantize will store in a
    block format (their neurons cost those bytes on the GPU); `linears`: {id(weight): bytes} of
    the other linear layers it will quantize."""
    from picompile.passes import place as place_pass

    fixed = place_pass.account(model, ffns, max_context=max_context, budget_bytes=budget,
                               planned_bytes=linears)
    demands = [place_pass.BlockDemand(name, f.n_ff, place_pass.neuron_bytes(f, formats.get(name)),
                                      profiles[name].freq)
               for name, f in ffns.items()]
    layers = place_pass.layer_demands(model, ffns, fixed, linears)
    result, host_layers, fixed = place_pass.place_layers(budget_bytes=budget, fixed_bytes=fixed,
                                                         blocks=demands, layers=layers)
    for name, ffn in ffns.items():
        apply_order(ffn, result.order[name])
        ffn.block.decided.hot_neurons = result.hot[name]
    placement.host_layers = host_layers
    placement.gpu_bytes = result.gpu_bytes
    placement.fixed_bytes = dict(fixed)
    placement.fixed_on_gpu = result.fixed_on_gpu
    placement.expected_gpu_share = result.expected_gpu_share
    placement.notes = list(result.notes)
    if not torch.cuda.is_available():
        placement.notes.append("no CUDA GPU here: the plan is made, execution stays on the CPU")
        warn_user("picompile: no CUDA GPU found; the placement is planned (see explain()) but "
                  "everything runs on the CPU")


def apply_order(ffn: SparseFFN, order: torch.Tensor) -> None:
    """Permute the block's neurons (hot first) and remember the order, for save()."""
    from picompile.passes import place as place_pass

    place_pass.apply_order(ffn, order)
    ffn.order = order.long()


def name_in_graph(block: BlockPlan) -> str:
    """The SparseFFN's attribute name inside its captured graph module."""
    return block.name[len(block.module) + 1:] if block.module else block.name
