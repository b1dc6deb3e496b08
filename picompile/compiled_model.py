"""CompiledModel: the model after compile, called and `.generate(...)`d like the model it wraps.

The wrapped model is `_orig_mod` (as in torch.compile's OptimizedModule): every other name
(`config`, HF's `model` backbone, `lm_head`, `generation_config`) is the model's own, read and
set through the wrapper. The wrapper holds what compile produced: the plan, the rewritten
graphs, the execution paths picked, and the whole-step decoder built from the kernels bound.
"""

from __future__ import annotations

import threading

import torch
import torch.fx as fx
from torch import nn

from picompile import saving
from picompile.plan import Plan, PredictorPolicy
from picompile.progress import note
from picompile.runtime.dense_linear import DenseLinear, QuantLinear
from picompile.runtime.kernel_module import KernelModule
from picompile.runtime.sparse_ffn import SparseFFN


def check_predictor_policy(policy) -> PredictorPolicy:
    if policy not in PredictorPolicy.values():
        raise ValueError(f"unknown predictors={policy!r}; choose one of "
                         f"{', '.join(map(repr, PredictorPolicy.values()))}")
    return PredictorPolicy(policy)


class CompiledModel(nn.Module):
    """The model with its FFN blocks rewritten. Called and `.generate(...)`d like the model it
    wraps; every other attribute (config, device, ...) is the wrapped model's."""

    def __init__(self, model: nn.Module, plan: Plan, graphs: dict[str, fx.GraphModule],
                 paths: dict[str, str]):
        super().__init__()
        self._orig_mod = model
        self.plan = plan
        # The rewritten graphs by module name. They are submodules of `model` already, so keep
        # them out of nn.Module's registry (no double counting in state_dict / parameters).
        object.__setattr__(self, "graphs", graphs)
        self.paths = paths  # block name -> execution path picked ("C", "reference (...)")
        self.linear_paths: dict[str, str] = {}  # other linears -> path at compile (passes/lower.py)
        # under plan.quantize: what stayed float, and why; which layers got another format
        self.quant_notes: list[str] = []
        # block -> [n_ff] share of calibration tokens each neuron fired on (original neuron
        # order), from compile's profile (mode="predicted" or a gpu_budget); kept for report();
        # not saved with a plan
        self.firing: dict[str, torch.Tensor] = {}
        # the C decoder's KV cache dtype (compile's kv_cache=); None: the model's own
        self.kv_cache_dtype: torch.dtype | None = None
        # tokens generate() drafts a step by prompt lookup (runtime/lookup.py) where a call sets
        # no prompt_lookup_num_tokens of its own; 0: none (as Hugging Face's generate)
        self.prompt_lookup = 0
        # the whole-step decoder (runtime/decoder.py) for the kernels bound now: see decoder()
        self._decoder_key = self._decoder = None
        self.decoder_reason = "not built yet"
        # whole-model capture (capture_whole.py): the exported decode / prefill steps, or None
        self.step_graphs = None
        # one generate at a time through the decoder: its KV cache and buffers are shared
        self._generating = threading.Lock()

    def forward(self, *args, **kwargs):
        return self._orig_mod(*self._to_input_device(args), **self._to_input_device(kwargs))

    def generate(self, *args, **kwargs):
        """Hugging Face's generate arguments; picompile's own loop (static KV cache, prefill then
        decode) runs them where it supports every one, else HF's generate, with a note."""
        from picompile.runtime import generate as fast

        if not hasattr(self._orig_mod, "generate"):
            raise TypeError(f"{type(self._orig_mod).__name__} has no generate(); call the model instead")
        args, kwargs = self._to_input_device(args), self._to_input_device(kwargs)
        reason = fast.supported(self._orig_mod, kwargs, args)
        if reason is None:
            with self._generating:  # another thread's generate would share the KV cache
                decoder = self.decoder()
                steps = self.step_graphs  # whole-model capture: only where no C decoder runs
                if decoder is not None or steps is None or not steps.current(self._orig_mod):
                    steps = None
                return fast.generate_hf(self._orig_mod, *args, decoder=decoder, steps=steps,
                                        prompt_lookup=self.prompt_lookup, **kwargs)
        if self._decoder is not None:  # HF's generate runs it: nothing taken from the cache
            self._decoder.prompt_reused = 0
        if not reason.startswith(fast.INVALID):  # else HF's generate raises its own error
            note(f"generate: Hugging Face's generate runs this call (picompile's loop does not "
                 f"handle {reason})")
        return self._orig_mod.generate(*args, **kwargs)

    def decoder(self):
        """The decode step in one C call (runtime/decoder.py) for the kernels bound now, or None
        (`decoder_reason` says why). Built and verified again when a kernel, threshold or
        predictor switch changes (a dtype change, use_predictors, distribute), or
        kv_cache_dtype."""
        from picompile.options import check_kv_cache
        from picompile.runtime import decoder as whole_step

        kv_dtype = check_kv_cache(self.kv_cache_dtype)
        key = (whole_step.Decoder.key(self._orig_mod), kv_dtype)
        if key != self._decoder_key:
            if self._decoder is not None:
                self._decoder.release()
                self._decoder = None
            self._decoder, self.decoder_reason = whole_step.build(self._orig_mod, kv_dtype)
            self._decoder_key = key
        return self._decoder

    def __getstate__(self):
        state = dict(super().__getstate__())
        state["_decoder"] = state["_decoder_key"] = None  # raw pointers: rebuilt when used
        state["step_graphs"] = None  # graphs of this process's modules: capture again
        del state["_generating"]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._generating = threading.Lock()

    def _to_input_device(self, values):
        """Tensors go where the model's first weights are (the GPU after distribute())."""
        device = next(iter(self._orig_mod.parameters())).device
        if device.type == "cpu":
            return values
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        if isinstance(values, dict):
            return {k: move(v) for k, v in values.items()}
        return tuple(move(v) for v in values)

    def _apply(self, fn, recurse=True):
        """.to() / .half() / .cuda(): every module that may refuse (a block split across
        devices) is asked first, since torch converts module by module and a refusal midway
        would leave the model half converted."""
        for module in self._orig_mod.modules():
            if isinstance(module, KernelModule):
                module._check_movable()
        return super()._apply(fn, recurse)

    def distribute(self, device: str | torch.device = "cuda") -> None:
        """Run hybrid as planned: non-FFN parts and each block's hot neurons on `device`,
        cold neurons on the CPU. compile() calls this when a gpu_budget is given and a GPU is
        there; device="cpu" lets the CPU stand in for the GPU (tests, debugging)."""
        from picompile.codegen.c import why_no_kernel
        from picompile.runtime.hybrid import distribute

        ffns, placement = self.ffns(), self.plan.placement
        distribute(self._orig_mod, ffns, device, move_non_ffn=placement.fixed_on_gpu,
                   host_layers=placement.host_layers)
        for module in self._orig_mod.modules():  # their weights may have moved
            if isinstance(module, (DenseLinear, QuantLinear)):
                module.select_kernel()
        for name, ffn in ffns.items():
            if ffn.hybrid is None:  # in a layer left on the CPU: its kernels bound there
                kernel = "C" if ffn.kernel is not None else why_no_kernel(ffn)
                self.paths[name] = f"{kernel}, on the CPU with its decoder layer (placement)"
                continue
            if ffn.predictor is not None:
                ffn.predictor.kernel = None  # the C kernel's weights were the CPU copies
            self.paths[name] = (f"hybrid: {ffn.block.decided.hot_neurons} hot on {device}, "
                                f"{ffn.n_ff - ffn.block.decided.hot_neurons} cold on the CPU")
        self.use_predictors(self.plan.predictors)

    def use_predictors(self, policy: str) -> None:
        """Which trained predictors run (the rest of the blocks run exact): "all", "none", or
        "auto": those whose block decodes faster with it on the CPU (BlockPlan.measured.decode_us_*,
        timed by passes/autotune.py), and every one in the hybrid runtime, where a predictor runs on the
        GPU, costs the CPU nothing and spares it the gate rows of the cold neurons not predicted
        (the blocks of decoder layers left on the CPU too: no autotune timed them, and at the
        sizes that need such layers predicting spares the CPU most of the gate rows)."""
        self.plan.predictors = policy = check_predictor_policy(policy)
        ffns = self.ffns().values()
        hybrid = any(ffn.hybrid is not None for ffn in ffns)
        for ffn in ffns:
            if ffn.predictor is not None:
                b = ffn.block
                ffn.predictor.enabled = policy == PredictorPolicy.ALL or policy == PredictorPolicy.AUTO and (
                    hybrid or b.measured.decode_us_predicted < b.measured.decode_us_exact)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("_orig_mod"), name)

    _OWN = frozenset({"plan", "graphs", "paths", "linear_paths", "quant_notes", "training",
                      "decoder_reason", "firing", "step_graphs", "kv_cache_dtype"})

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
        if name in CompiledModel._OWN or name.startswith("_") or "_orig_mod" not in self._modules:
            super().__setattr__(name, value)
        else:
            setattr(self._orig_mod, name, value)

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
        if self.plan.quant_calibration_tokens:  # GPTQ's blocks: load does not calibrate again
            tensors.update(self._quant_blocks())
        saving.save(self.plan.to_json(), tensors, self.plan.fingerprint, directory)

    def _quant_blocks(self) -> dict[str, torch.Tensor]:
        """"<key>.blocks" -> every quantized weight's blocks in GGUF's row layout, by the keys
        of passes/hessians.py (FFN "<block>.w_gate" / ".w_up" / ".w_down_t", linear layers by
        name, each layer once)."""
        out = {}
        for name, ffn in self.ffns().items():
            for role in ("w_gate", "w_up", "w_down_t"):
                fmt = ffn.down_qformat if role == "w_down_t" else ffn.qformat
                if getattr(ffn, role) is not None and fmt is not None:
                    out[f"{name}.{role}.blocks"] = ffn.row_blocks(role).contiguous()
        for name, m in self._orig_mod.named_modules():
            if isinstance(m, QuantLinear):
                out[f"{name}.blocks"] = m.row_blocks().contiguous()
        return out

    def ffns(self) -> dict[str, SparseFFN]:
        """Block name -> its SparseFFN module."""
        return {ffn.block.name: ffn for ffn in self._orig_mod.modules() if isinstance(ffn, SparseFFN)}

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
