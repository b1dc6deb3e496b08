"""Calibrate: run calibration tokens through the model, measure each block's activity, and set
the per-block threshold of SiLU/GELU blocks for a target sparsity.

The criterion is the magnitude of the down projection's input, |act(gate x) * up x|, not the
gate's |act(gate x)| as CATS uses. Measured on SmolLM2-135M over English text (see
BENCHMARKS.md): at 50% sparsity the gate criterion raised perplexity by 39%, the down-input
criterion by 3%. It needs gate and up densely, so in exact mode it saves only the `down` rows;
predictors (mode="predicted") then skip gate and up too."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.func import functional_call

from picompile.progress import progress_bar
from picompile.runtime.sparse_ffn import SparseFFN, down_input

# |h| samples kept per block per forward call; the quantile is taken over all of them.
SAMPLES_PER_CALL = 1 << 16
# Token rows whose h a call computes: this many times the rows that hold SAMPLES_PER_CALL
# values (a random subset of the call's tokens; computing h for all of them was most of a
# SmolLM2 calibration's time, for samples drawn from 4% of the values).
SAMPLE_ROW_FACTOR = 4


def calibration_ids(calibration, tokenizer, seq_len: int = 256) -> torch.Tensor:
    """calibration: LongTensor [batch, seq] (or [seq]) of ids, or str / list of str with a
    tokenizer. Returns LongTensor [batch, seq]."""
    if isinstance(calibration, torch.Tensor):
        if calibration.dtype not in (torch.int64, torch.int32) or calibration.dim() not in (1, 2):
            raise ValueError(
                "calibration must be token ids: a LongTensor [batch, seq] or [seq], "
                f"got {calibration.dtype} with shape {tuple(calibration.shape)}"
            )
        if calibration.numel() == 0:
            raise ValueError(f"calibration holds no token ids (shape {tuple(calibration.shape)}): "
                             "pass at least one token per row")
        ids = calibration.long()
        return ids[None] if ids.dim() == 1 else ids
    if isinstance(calibration, str):
        calibration = [calibration]
    if isinstance(calibration, (list, tuple)) and all(isinstance(t, str) for t in calibration):
        if tokenizer is None:
            raise ValueError("calibration was given as text: also pass tokenizer= to turn it into ids")
        ids = tokenizer("\n\n".join(calibration), return_tensors="pt")["input_ids"][0]
        if ids.numel() == 0:
            raise ValueError("the calibration text gave no tokens: pass some text")
        rows = max(1, ids.numel() // seq_len)
        return ids[: rows * seq_len].reshape(rows, -1) if ids.numel() >= seq_len else ids[None]
    raise ValueError(
        "calibration must be a LongTensor of token ids or a list of strings (with tokenizer=), "
        f"got {type(calibration).__name__}"
    )


class LayerwiseUnsupported(ValueError):
    """The model has no list of decoder layers to calibrate one at a time."""


class _Caught(Exception):
    """Raised by the hook on the first decoder layer: its inputs are recorded, stop the forward."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: the first (outermost) ModuleList whose every child holds a
    SparseFFN. Children may be torch.fx GraphModules (what capture made of OPT's layers)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and all(
                any(isinstance(m, SparseFFN) for m in layer.modules()) for layer in module):
            # Layer 0's keyword arguments (attention mask, ...) are given to every layer: refuse
            # models whose layers take different ones (sliding-window layers between full ones).
            if len({getattr(layer, "attention_type", None) for layer in module}) > 1:
                break
            return module
    raise LayerwiseUnsupported(
        f"layer-by-layer calibration needs a model with a list of decoder layers (an "
        f"nn.ModuleList of layers that each hold an FFN block, all taking the same attention "
        f"mask); {type(model).__name__} has none: calibrate it whole (device=None)")


def calibration_device(model: nn.Module) -> tuple[str | None, torch.dtype | None]:
    """Where compile runs calibration, as (device, dtype) for run_calibration:

    ("cuda", None): layer by layer on the GPU, when one is there and the model's weights are on
    the CPU (the model may not fit the GPU);
    ("cpu", torch.float32): layer by layer on the CPU, each layer widened to float32 while it
    runs, for a float16 / bfloat16 model on a machine without one (torch's CPU matmul in those
    dtypes is a slow reference loop: hours for a 7B model; one float32 layer at a time costs a
    layer's memory, not the model's);
    (None, None): the whole model where it is (models without a list of decoder layers too)."""
    first = next(model.parameters())
    try:
        decoder_layers(model)
    except LayerwiseUnsupported:
        return None, None
    if first.device.type != "cpu":
        return None, None
    if torch.cuda.is_available():
        return "cuda", None
    if first.dtype in (torch.float16, torch.bfloat16):
        return "cpu", torch.float32
    return None, None


def _forward(model: nn.Module, batch: torch.Tensor, tensors: dict[str, torch.Tensor],
             all_logits: bool = True) -> None:
    """model(batch), its tensors named in `tensors` replaced by those for the call. Without
    all_logits, an HF model's LM head runs on the last position only (`logits_to_keep`): no
    hook reads the logits, and the head is a fifth of SmolLM2's multiply-adds per token."""
    kwargs = {"use_cache": False}
    if not all_logits and "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    try:
        functional_call(model, tensors, (batch,), kwargs)
    except TypeError:  # plain nn.Module models take only the ids
        functional_call(model, tensors, (batch,))


def _tensors_on(module: nn.Module, device: torch.device, dtype: torch.dtype | None,
                skip: set[int] = frozenset()) -> dict[str, torch.Tensor]:
    """{name: tensor} of `module`'s parameters and buffers (none whose id is in `skip`) on
    `device`, float ones in `dtype` (None: their own), each tensor converted once (tied weights
    stay one): what functional_call runs the module with. The module's own tensors are not
    touched, so nothing is copied back and no storage they share is split (the original modules
    compile keeps share the FFN weights with the rewritten blocks)."""
    done: dict[int, torch.Tensor] = {}
    out = {}
    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    for name, t in named:
        if id(t) in skip:
            continue
        if id(t) not in done:
            to_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
            done[id(t)] = t.detach().to(device=device, dtype=to_dtype)
        out[name] = done[id(t)]
    return out


def _head_only(model: nn.Module) -> set[int]:
    """ids of the output embedding's tensors that the input embedding does not share."""
    try:
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return set()
    if head is None:
        return set()
    shared = set() if embed is None else {id(t) for t in embed.parameters()}
    return {id(t) for t in head.parameters()} - shared


@torch.no_grad()
def run_calibration(model: nn.Module, ids: torch.Tensor, batch_size: int = 4, quiet: bool = False,
                    desc: str = "calibrating", device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None, hooks=(), after_layer=None,
                    all_logits: bool = True) -> None:
    """Feed calibration rows through the model (no KV cache), `batch_size` rows at a time, with
    `hooks` ((module, forward hook) pairs) registered for this run only. See _feed.
    all_logits: the LM head runs on every position (False: on the last only, for passes whose
    hooks do not read it).
    after_layer(layer): called layer by layer (device given) once every batch has passed a
    decoder layer, so a pass can finish with that layer's statistics and free them."""
    handles = [module.register_forward_hook(hook) for module, hook in hooks]
    try:
        _feed(model, ids, batch_size, quiet, desc, device, dtype, after_layer, all_logits)
    finally:
        for h in handles:
            h.remove()


def _feed(model: nn.Module, ids: torch.Tensor, batch_size: int, quiet: bool, desc: str,
          device: str | torch.device | None, dtype: torch.dtype | None, after_layer=None,
          all_logits: bool = True) -> None:
    """run_calibration's forward passes.

    device=None: the whole model, on the device of its first weights. A device ("cuda", or "cpu"
    in tests): layer by layer, as GPTQ calibrates, so a model larger than that device is run
    on it: the inputs of the first decoder layer are recorded for every batch, then each layer
    in turn runs on a copy of its tensors on `device` (functional_call), taking every batch's
    hidden states; the model's own tensors never move.
    Forward hooks on the SparseFFN modules fire as in a whole-model run, block by block in
    model order but with all batches of a layer before the next layer's. dtype (layer by layer
    only): the copies' float tensors, and so the hidden states, in that dtype."""
    if device is None:
        first = next(model.parameters()).device
        for start in progress_bar(range(0, ids.shape[0], batch_size), desc=desc, quiet=quiet):
            _forward(model, ids[start : start + batch_size].to(first), {}, all_logits)
        return

    layers = decoder_layers(model)
    device = torch.device(device)
    # 1. Everything before the first layer (embeddings, rotary tables, masks) runs on `device`;
    # a hook on layer 0 records its inputs and stops the forward there ("Catcher").
    hidden: list[torch.Tensor] = []  # per batch: hidden states [batch, seq, d] on `device`
    inputs: list[tuple[tuple, dict]] = []  # per batch: the rest of layer 0's (args, kwargs)

    def catch(_layer, args, kwargs):
        hidden.append(args[0])
        inputs.append((args[1:], kwargs))
        raise _Caught

    in_layers = {id(t) for t in (*layers.parameters(), *layers.buffers())}
    # embeddings, final norm, rotary buffers; not an untied LM head, which runs after the layers
    # (49152 x 4096 in float32 is 805 MB)
    outside = _tensors_on(model, device, dtype, skip=in_layers | _head_only(model))
    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for start in range(0, ids.shape[0], batch_size):
            try:
                _forward(model, ids[start : start + batch_size].to(device), outside)
            except _Caught:
                pass
    finally:
        handle.remove()
    del outside

    # 2. Layer by layer: all batches' hidden states [batch, seq, d] stay on `device` (32k tokens
    # of d=5120 in float16: 335 MB); one layer's weights are there at a time.
    for layer in progress_bar(layers, desc=desc, quiet=quiet, total=len(layers)):
        tensors = _tensors_on(layer, device, dtype)
        for i, (args, kwargs) in enumerate(inputs):
            out = functional_call(layer, tensors, (hidden[i], *args), kwargs)
            hidden[i] = out[0] if isinstance(out, (tuple, list)) else out  # OPT: maybe a tuple
        del tensors
        if after_layer is not None:
            after_layer(layer)


@torch.no_grad()
def calibrate(
    model: nn.Module,
    ffns: dict[str, SparseFFN],
    ids: torch.Tensor,
    sparsity: float | None,
    quiet: bool = False,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Set block.measured.sparsity for every block and, when a sparsity is asked for, the
    threshold of every non-ReLU block (ReLU blocks stay exact). device, dtype: as
    run_calibration's (None: the whole model where it is; else layer by layer on that device)."""
    samples: dict[str, list[torch.Tensor]] = {name: [] for name in ffns}
    # One generator per block: its samples are the same whichever order the blocks run in
    # (whole model: batch after batch; layer by layer: block after block).
    gens = {name: torch.Generator().manual_seed(i) for i, name in enumerate(ffns)}

    def hook(name):
        def record(ffn: SparseFFN, args, _out):
            x = args[0].reshape(-1, ffn.d_model)  # [T, d]
            rows = SAMPLE_ROW_FACTOR * -(-SAMPLES_PER_CALL // ffn.n_ff)
            if x.shape[0] > rows:  # the samples come from a random subset of the tokens
                keep = torch.randperm(x.shape[0], generator=gens[name])[:rows]  # CPU
                x = x[keep.to(x.device)]
            h = down_input(x, ffn.w_up, w_gate=ffn.w_gate, b_gate=ffn.b_gate, b_up=ffn.b_up,
                           act=ffn.act, drelu=ffn.drelu,
                           qformat=ffn.qformat).abs().flatten()  # [rows * n_ff]
            if h.numel() > SAMPLES_PER_CALL:
                pick = torch.randint(h.numel(), (SAMPLES_PER_CALL,), generator=gens[name])  # CPU
                h = h[pick.to(h.device)]
            samples[name].append(h)  # stays on the activations' device
        return record

    run_calibration(model, ids, quiet=quiet, device=device, dtype=dtype, all_logits=False,
                    hooks=[(ffn, hook(name)) for name, ffn in ffns.items()])

    for name, ffn in ffns.items():
        h = torch.cat(samples[name])  # [n] |down input| samples
        block = ffn.block
        if sparsity and not block.exact:
            k = max(1, int(round(sparsity * h.numel())))
            block.decided.threshold = float(h.kthvalue(k).values)
        ffn.threshold = block.decided.threshold
        block.measured.sparsity = float((h <= block.decided.threshold).float().mean())
