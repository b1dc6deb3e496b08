"""compile(quantize=...): every FFN block and linear layer reads GGUF blocks; the model equals
the float model whose weights went through the same quantization (the kernels add nothing but
float32 rounding); plans record the format; a GGUF file's own tensors are kept as they are.

The quantization's rules, which the fake-quantized reference models mirror: a 4-bit format
quantizes the LM head and the FFN down rows (along d) to q8_0 (in "gguf" mode the file's 4-bit
down_proj, blocked along n_ff, is re-quantized); a layer with 4-bit rows dotted with its input
(q/k/v/o, gate, up) reads that input rounded to int8 blocks (quant.round_activations).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import picompile
from picompile import quant, saving
from picompile.passes import quantize as quantize_pass
from picompile.runtime.dense_linear import QuantLinear
from picompile.runtime.sparse_ffn import SparseFFN
from tests import zoo

FORMATS = sorted(quant.FORMATS)
FOUR_BIT = ("q4_0", "q4_1")


def _fake_quant(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w [rows, cols] through quantize -> dequantize, in w's dtype."""
    return quant.dequantize(quant.quantize(w, fmt), fmt, w.shape[1]).to(w.dtype)


class _RoundedInput(nn.Module):
    """A linear layer whose input is rounded as the quantized kernels round it."""

    def __init__(self, linear: nn.Linear, fmt: str):
        super().__init__()
        self.linear, self.fmt = linear, fmt

    def forward(self, x):
        return self.linear(quant.round_activations(x, self.fmt).to(x.dtype))


@torch.no_grad()
def _fake_quant_model(dense: nn.Module, fmt: str, gguf: bool = False,
                      ffn_only: bool = False) -> nn.Module:
    """The float model with what compile(quantize=fmt) quantizes quantized and dequantized:
    every nn.Linear, the down projection along its output dimension (the kernels' rows are
    neurons), the LM head untied from the embedding (which stays float), both in q8_0 where fmt
    is 4-bit. gguf=True: what compile(gguf=file) does to a model whose weights are the file's
    (`fmt` blocks) dequantized: every layer kept as the file has it, but the down projection
    quantized again along its output dimension, to q8_0 where fmt is 4-bit. ffn_only: only the
    FFN blocks run quantized kernels (the input rounding applies to gate and up alone)."""
    ref = copy.deepcopy(dense)
    head = ref.get_output_embeddings()
    for name, m in ref.named_modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            if name.endswith("down_proj"):
                down = "q8_0" if fmt in FOUR_BIT else fmt
                q = _fake_quant(w.t().contiguous(), down).t()
            elif gguf:
                continue  # the file's own blocks: the model holds their values already
            else:
                q = _fake_quant(w, "q8_0" if m is head and fmt in FOUR_BIT else fmt)
            m.weight = nn.Parameter(q.contiguous(), requires_grad=False)
    for m in list(ref.modules()):  # rows dotted with their input read it rounded: all but down
        for child, lin in list(m.named_children()):
            if isinstance(lin, nn.Linear) and child != "down_proj" \
                    and (not ffn_only or child in ("gate_proj", "up_proj")):
                rounding = "q8_0" if lin is head and fmt in FOUR_BIT else fmt
                setattr(m, child, _RoundedInput(lin, rounding))
    return ref


@torch.no_grad()
def _assert_same_outputs(cm, ref) -> None:
    """Prefill logits within float32 rounding of the reference, and the same greedy decode
    (the kernels, through the whole-step decoder where it runs)."""
    ids = torch.randint(0, zoo.VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(zoo.logits(cm, ids), zoo.logits(ref, ids), atol=2e-4, rtol=2e-4)
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    got = cm.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["llama_relu", "llama_silu"])
def test_quantized_model_equals_the_fake_quantized_float_model(fmt, arch):
    dense = zoo.make(arch, hidden=64, n_ff=96)
    ref = _fake_quant_model(dense, fmt)
    cm = picompile.compile(copy.deepcopy(dense), quantize=fmt, quiet=True)
    ffns = [m for m in cm._orig_mod.modules() if isinstance(m, SparseFFN)]
    linears = [m for m in cm._orig_mod.modules() if isinstance(m, QuantLinear)]
    assert ffns and all(f.qformat == fmt and f.w_up.dtype == torch.uint8 for f in ffns)
    high = "q8_0" if fmt in FOUR_BIT else fmt  # the down rows and the LM head
    assert all(f.down_qformat == high for f in ffns)
    head = cm._orig_mod.get_output_embeddings()
    head_fmt = high
    assert isinstance(head, QuantLinear) and head.qformat == head_fmt
    assert len(linears) == 2 * 4 + 1  # q k v o x2, head
    assert all(m.qformat == fmt for m in linears if m is not head)
    _assert_same_outputs(cm, ref)
    text = picompile.explain(cm)
    assert f"FFN {fmt} " in text and f"linear {fmt}" in text
    assert ("(down q8_0)" in text) == (fmt in FOUR_BIT)
    assert ("lm_head: the LM head, q8_0 (not " in text) == (fmt in FOUR_BIT)


def _file_blocks(dense: nn.Module, fmt: str) -> dict:
    """gguf_weights.read's answer for a file holding `dense`'s linears in `fmt` blocks (the
    rows of each module's weight in the HF order), down_proj as the file stores it: blocked
    along n_ff."""
    from picompile import gguf_weights

    blocks = {}
    for name, m in dense.named_modules():
        if isinstance(m, nn.Linear):
            blocks[name] = gguf_weights.Blocks(fmt, quant.quantize(m.weight.detach(), fmt),
                                               fmt.upper())
    return blocks


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_mode_requantizes_4_bit_down_rows_to_q8_0(fmt):
    """quantize_ffns in "gguf" mode on a model whose weights are a file's `fmt` blocks: gate and
    up rows are the file's blocks, down rows q8_0 along d for 4-bit files, the file's format for
    q8_0 ones, quantized again from the file's values either way (noted once: the file blocks
    them along n_ff); the model equals the fake-quantized reference and explain shows the down
    rows' format."""
    dense = zoo.make("llama_silu", hidden=64, n_ff=96)
    with torch.no_grad():  # the float model a GGUF file loads as: its blocks dequantized
        for m in dense.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(_fake_quant(m.weight, fmt))
    blocks = _file_blocks(dense, fmt)
    ref = _fake_quant_model(dense, fmt, gguf=True, ffn_only=True)
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    ffns = cm.ffns()
    notes = quantize_pass.quantize_ffns(ffns, "gguf", blocks)
    down = "q8_0" if fmt in FOUR_BIT else fmt
    for name, ffn in ffns.items():
        up = blocks[name.replace("sparse_ffn", "up_proj")].data
        assert ffn.qformat == fmt and ffn.down_qformat == down
        assert torch.equal(ffn.w_up, up if ffn.order is None else up[ffn.order])
        assert ffn.kernel is not None and ffn.kernel.variant.down_dtype == down
    requantized = [n for n in notes if "re-quantized to q8_0 along d from the file's" in n]
    assert len(requantized) == 1 and f"of {len(ffns)} blocks" in requantized[0]
    _assert_same_outputs(cm, ref)
    cm.quant_notes = notes
    text = picompile.explain(cm)
    assert (f"FFN {fmt} (down q8_0) " in text) == (fmt in FOUR_BIT)
    assert f"FFN {fmt} " in text and f"quantization: {requantized[0]}" in text


def test_quantized_plan_saves_and_loads(tmp_path):
    dense = zoo.make("llama_relu", hidden=64, n_ff=96)
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", quiet=True)
    cm.save(tmp_path / "plan")
    loaded = picompile.load(copy.deepcopy(dense), tmp_path / "plan")
    assert loaded.plan.quantize == "q4_0"
    ids = torch.randint(0, zoo.VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(loaded, ids), zoo.logits(cm, ids))


def test_bad_quantize_arguments_are_refused_before_any_change():
    dense = zoo.make("llama_relu", hidden=64, n_ff=96)
    with pytest.raises(ValueError, match="quantize must be one of"):
        picompile.compile(dense, quantize="q5_k", quiet=True)
    with pytest.raises(ValueError, match="pass gguf="):
        picompile.compile(dense, quantize="gguf", quiet=True)
    assert not any(isinstance(m, SparseFFN) for m in dense.modules())


def test_widths_off_the_block_size_stay_float_with_a_note(capsys):
    dense = zoo.make("llama_relu", hidden=48, n_ff=96)  # 48 is not a multiple of 32
    cm = picompile.compile(dense, quantize="q8_0")
    assert "quantize='q8_0' quantized no weight" in capsys.readouterr().err
    assert not any(isinstance(m, QuantLinear) for m in cm._orig_mod.modules())
    assert all(f.qformat is None for f in cm._orig_mod.modules() if isinstance(f, SparseFFN))
    text = picompile.explain(cm)
    assert "stays float" in text and "not a multiple of 32" in text
    assert "no weight quantized" in text and "pass calibration=" not in text


def _file_blocks_of(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Blocks of w's shape in `fmt` as a file might hold them but round-to-nearest of their own
    values would not give again: w's scales (and minimums), random integers. A block kept from
    the file is then told apart from one quantized again from the float weights."""
    q = quant.quantize(w.detach(), fmt)
    head = quant.format_of(fmt).head_bytes
    blocks = q.reshape(q.shape[0], -1, quant.format_of(fmt).block_bytes)
    gen = torch.Generator().manual_seed(q.shape[0] * 31 + q.shape[1])
    blocks[..., head:] = torch.randint(0, 256, blocks[..., head:].shape, generator=gen,
                                       dtype=torch.uint8)
    return q


GGUF_ARCH = {"llama_silu": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3": "gemma3", "phi3": "phi3"}  # zoo arch -> the file's general.architecture


def _llama_cpp_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q / k row order for "llama" files (each head's rotary halves
    interleaved; whole rows)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, -1).transpose(1, 2).reshape(rows.shape)


def _gguf_type_blocks(w: torch.Tensor, kind: str) -> np.ndarray:
    """uint8 [rows, row_bytes] of GGUF `kind` blocks (Q5_0: w quantized by the gguf package;
    Q4_K, which it cannot quantize: random integers, scales and minimums, at w's magnitude)."""
    import gguf

    if kind == "Q5_0":
        return gguf.quants.quantize(w.detach().numpy(), gguf.GGMLQuantizationType.Q5_0)
    rng = np.random.default_rng(w.shape[0] * 31 + w.shape[1])
    raw = rng.integers(0, 256, (w.numel() // 256, 144), dtype=np.uint8)
    top = float(w.abs().max()) / (63 * 15)
    raw[:, 0:4] = rng.uniform(0.5 * top, top, (len(raw), 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(w.shape[0], -1)


HEAD_FORMAT = {"q4_0": "q8_0", "q4_1": "q8_0", "Q4_K": "Q5_0"}  # the LM head's, as llama.cpp's


def _write_gguf(model: nn.Module, arch: str, fmt: str, path, loadable: bool = False,
                gate_fmt: str | None = None) -> dict[str, torch.Tensor]:
    """Write the model's linears as a GGUF file of `arch` the way llama.cpp's converter names
    them (gguf's name map; the LM head q8_0 under a 4-bit format, and where it is tied to the
    embedding only token_embd), every weight in `fmt` blocks (_file_blocks_of; a GGUF type
    gguf_transcode writes exactly, "Q4_K" or "Q5_0": _gguf_type_blocks, the blocks picompile
    should keep then those transcoded). The model's weights become the kept blocks dequantized
    (what transformers loads from the file, up to Q4_K's float16 scales).
    loadable: also what transformers needs to load the file: the config keys it reads, the
    shipped file's tokenizer, an untied embedding (q8_0), norms in float32 (Gemma's stored as
    1 + weight). gate_fmt: the FFN gate projections' format instead of `fmt`.
    -> {module name: its blocks, in the model's row order}."""
    import gguf

    from picompile import gguf_transcode, gguf_weights

    c = model.config
    names = gguf_weights.tensor_name  # an architecture gguf does not know: Llama's names
    to_tensor = names(arch, c.num_hidden_layers) or names("llama", c.num_hidden_layers)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embed.weight
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    if loadable:
        _add_config_and_tokenizer(writer, c)

    def write(name: str, m: nn.Module, m_fmt: str, tensor: str) -> None:
        with torch.no_grad():
            if m_fmt in gguf_transcode.EXACT:
                rows = torch.from_numpy(_gguf_type_blocks(m.weight, m_fmt))
                q = torch.from_numpy(gguf_transcode.transcode(rows.numpy(), m_fmt))
                kept = gguf_transcode.EXACT[m_fmt]
            else:
                rows = q = _file_blocks_of(m.weight, m_fmt)
                kept = m_fmt
            m.weight.copy_(quant.dequantize(q, kept, m.weight.shape[1]))
        blocks[name] = q
        if arch == "llama" and name.endswith(("q_proj", "k_proj")):
            heads = c.num_attention_heads if name.endswith("q_proj") else c.num_key_value_heads
            rows = _llama_cpp_rows(rows, heads)
        writer.add_tensor(tensor, rows.numpy(), raw_dtype=gguf.GGMLQuantizationType[m_fmt.upper()])

    blocks = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m_fmt = gate_fmt if gate_fmt and name.endswith("gate_proj") else fmt
            write(name, m, HEAD_FORMAT.get(fmt, fmt) if m is head else m_fmt,
                  "token_embd.weight" if m is head and tied else to_tensor(name))
    if loadable:
        if not tied:
            write("model.embed_tokens", embed, "q8_0", "token_embd.weight")
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms
                shift = 1.0 if arch.startswith("gemma") else 0.0
                writer.add_tensor(to_tensor(name.rsplit(".", 1)[0]), (p.detach() + shift).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return blocks


def _add_config_and_tokenizer(writer, config) -> None:
    """The config keys transformers reads from a GGUF file, and the shipped file's tokenizer."""
    import gguf

    from picompile import models

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for key, field in gguf.GGUFReader(models.default_gguf()).fields.items():
        if key.startswith("tokenizer."):
            vtype, sub = field.types[0], field.types[-1]
            array = vtype == gguf.GGUFValueType.ARRAY
            strings = [bytes(field.parts[i]) for i in field.data]
            value = ((strings if array else strings[0]) if gguf.GGUFValueType.STRING in (vtype, sub)
                     else field.contents())
            writer.add_key_value(key, value, vtype, sub_type=sub if array else None)


def _assert_keeps_file_blocks(cm, blocks: dict[str, torch.Tensor]) -> list[str]:
    """Every linear of `blocks` (_write_gguf's) that compile made a QuantLinear, and every FFN
    block's gate and up rows (a fused gate_up's halves; in the block's neuron order), hold
    exactly the blocks the file should keep. -> the names of those linears."""
    mods = dict(cm._orig_mod.named_modules())
    kept = [name for name in blocks if isinstance(mods.get(name), QuantLinear)]
    for name in kept:
        assert torch.equal(mods[name].row_blocks(), blocks[name]), name
    for name, ffn in cm.ffns().items():
        module = name.removesuffix(".sparse_ffn")
        if "gate_up" in ffn.block.linears:
            gate, up = blocks[f"{module}.gate_up_proj"].chunk(2)
        else:
            gate, up = blocks[f"{module}.gate_proj"], blocks[f"{module}.up_proj"]
        order = slice(None) if ffn.order is None else ffn.order
        assert torch.equal(ffn.row_blocks("w_up"), up[order]), name
        assert torch.equal(ffn.row_blocks("w_gate"), gate[order]), name
    return kept


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_gguf_files_of_each_architecture_keep_their_blocks(arch, tmp_path):
    """compile(model, gguf=file) for every architecture whose file keeps its blocks: each linear
    and each FFN block's gate and up rows are the file's blocks (Phi-3's fused gate_up split in
    halves, Llama's q and k in transformers' row order), the tied LM head the token embedding's;
    the model equals the fake-quantized reference."""
    fmt = "q4_0"
    dense = zoo.make(arch, hidden=64, n_ff=96)
    blocks = _write_gguf(dense, GGUF_ARCH[arch], fmt, tmp_path / "model.gguf")
    ref = _fake_quant_model(dense, fmt, gguf=True)
    cm = picompile.compile(copy.deepcopy(dense), gguf=tmp_path / "model.gguf", quiet=True)
    assert cm.plan.quantize == "gguf"
    kept = _assert_keeps_file_blocks(cm, blocks)
    assert "lm_head" in kept and any("self_attn" in name for name in kept)
    assert all(ffn.qformat == fmt and ffn.down_qformat == "q8_0" for ffn in cm.ffns().values())
    _assert_same_outputs(cm, ref)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_a_gguf_file_transformers_loads_keeps_its_blocks(arch, tmp_path):
    """A Qwen3 / Gemma 2 file (tiny, the shipped tokenizer) loaded by picompile's loader
    (transformers), then compiled with gguf=: every linear keeps the file's blocks (Gemma's
    tied LM head its embedding's), the gate and up rows too; the compiled model equals the
    fake-quantized float model transformers made."""
    import transformers as T

    from picompile import models

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    config = T.Qwen3Config(**common) if arch == "qwen3" else T.Gemma2Config(**common, head_dim=32)
    path = tmp_path / f"tiny-{arch}.gguf"
    torch.manual_seed(0)
    written = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms off their defaults (Gemma's weights are stored as 1 + w)
        for p in written.parameters():
            if p.dim() == 1:
                p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.1)
    blocks = _write_gguf(written, arch, "q4_0", path, loadable=True)
    model, _ = models.load(str(path))
    ref = _fake_quant_model(model, "q4_0", gguf=True)
    cm = picompile.compile(copy.deepcopy(model), gguf=path, quiet=True)
    linears = [n for n, m in cm._orig_mod.named_modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4 + 1, linears
    assert sorted(_assert_keeps_file_blocks(cm, blocks)) == sorted(linears)
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, dense = zoo.logits(cm, ids), zoo.logits(ref, ids), zoo.logits(model, ids)
    # The kernels' integer sums against the reference's float ones, through the next layer's
    # rounding of its input (see test_gguf_file_tensors_are_kept_as_they_are): well within the
    # reference's own distance from the float model, the same greedy tokens.
    assert (got - want).abs().max() < 0.5 * (want - dense).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_gguf_plan_loads_only_with_a_file_of_its_types(tmp_path):
    """A plan compiled on a file's Q8_0 blocks, loaded with a Q4_0 file of the same weights
    (which passes the rows' check, as a quantization of them): a clear error naming a tensor
    and both types, not a model running blocks its plan was not made for. The plan's own file
    loads, to the same logits."""
    dense = zoo.make("qwen2", hidden=64, n_ff=96)
    _write_gguf(copy.deepcopy(dense), "qwen2", "q4_0", tmp_path / "q4.gguf")
    _write_gguf(dense, "qwen2", "q8_0", tmp_path / "q8.gguf")  # dense: as loaded from q8.gguf
    cm = picompile.compile(copy.deepcopy(dense), gguf=tmp_path / "q8.gguf", quiet=True)
    assert set(cm.plan.gguf_types.values()) == {"Q8_0"}
    cm.save(tmp_path / "plan")
    with pytest.raises(ValueError, match=r"not the GGUF file the plan .* is Q4_0, the plan's "
                                         r"file had Q8_0"):
        picompile.load(copy.deepcopy(dense), tmp_path / "plan", gguf=tmp_path / "q4.gguf")
    loaded = picompile.load(copy.deepcopy(dense), tmp_path / "plan", gguf=tmp_path / "q8.gguf")
    ids = torch.randint(0, zoo.VOCAB, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(loaded, ids), zoo.logits(cm, ids))


def test_gguf_types_without_a_kernel_are_requantized_or_say_they_run_float(tmp_path):
    """Ternary TQ1_0 has a nearest format (q4_0, re-quantized, with a note); a type with none
    (an integer tensor here) runs float, and both the note and the layer's reason say so
    (not "float in the GGUF file")."""
    import gguf

    from picompile import gguf_weights

    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "qwen2")
    writer.add_block_count(1)
    ternary = gguf.quants.quantize(np.random.randn(64, 256).astype(np.float32),
                                   gguf.GGMLQuantizationType.TQ1_0)
    writer.add_tensor("blk.0.ffn_up.weight", ternary, raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.int8),
                      raw_dtype=gguf.GGMLQuantizationType.I8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors, notes = gguf_weights.read(tmp_path / "m.gguf")
    assert tensors.get("model.layers.0.mlp.up_proj").fmt == "q4_0"
    assert "TQ1_0 has no kernel here: re-quantized to q4_0" in notes[0]
    assert "I8 has no kernel" in notes[1] and "runs as float" in notes[1] and "quantize=" in notes[1]
    layer = nn.Linear(64, 64)
    assert quantize_pass._linear_format("model.layers.0.self_attn.q_proj", layer, "gguf", None,
                                        tensors) == (None, "I8 in the GGUF file, a type with no "
                                                           "kernel here")


def test_a_gate_in_another_gguf_type_than_up_is_quantized_again_with_a_note(tmp_path):
    dense = zoo.make("qwen2", hidden=64, n_ff=96)
    blocks = _write_gguf(dense, "qwen2", "q4_0", tmp_path / "m.gguf", gate_fmt="q8_0")
    cm = picompile.compile(copy.deepcopy(dense), gguf=tmp_path / "m.gguf", quiet=True)
    ffn = cm.ffns()["model.layers.0.mlp.sparse_ffn"]
    assert ffn.qformat == "q4_0"  # up's format
    order = slice(None) if ffn.order is None else ffn.order
    assert torch.equal(ffn.row_blocks("w_up"), blocks["model.layers.0.mlp.up_proj"][order])
    assert any("model.layers.0.mlp: gate rows Q8_0 in the file, quantized again to q4_0" in n
               for n in cm.quant_notes), cm.quant_notes


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_0"])
def test_q4_k_and_q5_0_tensors_keep_their_values_as_q4_1_and_q8_0_blocks(kind, tmp_path):
    """A file of Q4_K (LM head Q5_0, as llama.cpp's fallback for widths off 256) or Q5_0
    tensors: every linear, gate and up hold gguf_transcode's blocks of the file's (not the
    float weights quantized again), with one note a type; the model equals the reference on
    those blocks."""
    from picompile import gguf_transcode

    fmt = gguf_transcode.EXACT[kind]
    dense = zoo.make("llama_silu", hidden=256, n_ff=512)
    blocks = _write_gguf(dense, "llama", kind, tmp_path / "m.gguf")
    ref = _fake_quant_model(dense, fmt, gguf=True)
    cm = picompile.compile(copy.deepcopy(dense), gguf=tmp_path / "m.gguf", quiet=True)
    kept = _assert_keeps_file_blocks(cm, blocks)
    assert len(kept) == 2 * 4 + 1, kept
    assert all(ffn.qformat == fmt for ffn in cm.ffns().values())
    assert any(f"{kind} tensors: written as {fmt} blocks of the same values" in n
               for n in cm.quant_notes), cm.quant_notes
    _assert_same_outputs(cm, ref)


def test_gguf_blocks_of_another_model_are_refused(tmp_path):
    """A file whose blocks are not the model's weights (another model's, here another seed)
    is a clear error, not a silently different model."""
    _write_gguf(zoo.make("qwen2", hidden=64, n_ff=96, seed=1), "qwen2", "q8_0", tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="not this module's weight.*loaded from"):
        picompile.compile(zoo.make("qwen2", hidden=64, n_ff=96), gguf=tmp_path / "m.gguf",
                          quiet=True)


@pytest.mark.parametrize("arch, why", [("stablelm", "transforms some weights"),
                                       ("no-such-arch", "no tensor name map")])
def test_gguf_files_whose_blocks_cannot_be_kept_are_quantized_to_their_formats(arch, why, tmp_path):
    """Architectures whose weights transformers changes on loading (or which gguf's name map
    does not know): every linear is quantized from the float weights to its tensor's format in
    the file (unmapped: the file's most common one; the LM head is `output` in every file), with
    a note, never left float."""
    dense = zoo.make("llama_silu", hidden=64, n_ff=96)
    _write_gguf(dense, arch, "q4_1", tmp_path / "m.gguf")
    cm = picompile.compile(copy.deepcopy(dense), gguf=tmp_path / "m.gguf", quiet=True)
    text = picompile.explain(cm)
    assert why in text
    assert all(ffn.qformat == "q4_1" for ffn in cm.ffns().values())
    linears = {n: m for n, m in cm._orig_mod.named_modules() if isinstance(m, QuantLinear)}
    assert len(linears) == 9  # 2 layers of q, k, v, o and the LM head (output.weight: q8_0)
    assert {n: m.qformat for n, m in linears.items()} == {
        n: "q8_0" if n == "lm_head" else "q4_1" for n in linears}


@pytest.mark.slow
def test_gguf_file_tensors_are_kept_as_they_are():
    """SmolLM2's Q4_1 file: q/k/v/o, gate and up keep the file's blocks (q and k in the row
    order transformers gives them), the tied LM head its Q8_0 embedding blocks, down rows q8_0
    along d; the compiled model equals the float model transformers dequantized with its down
    projections through q8_0 along d."""
    import gguf

    from picompile import gguf_weights, models

    model, _ = models.load()
    path = models.default_gguf()
    dense = copy.deepcopy(model)
    cm = picompile.compile(model, gguf=path, quiet=True)
    assert cm.plan.quantize == "gguf"
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    mods = dict(cm._orig_mod.named_modules())
    v = mods["model.layers.3.self_attn.v_proj"]
    assert v.qformat == "q4_1" and torch.equal(v.row_blocks(), torch.from_numpy(reader["blk.3.attn_v.weight"].data.copy()))
    assert mods["lm_head"].qformat == "q8_0"
    q = mods["model.layers.3.self_attn.q_proj"]
    torch.testing.assert_close(quant.dequantize(q.row_blocks(), "q4_1", 576),
                               dense.model.layers[3].self_attn.q_proj.weight, atol=0, rtol=0)
    ffn = cm.ffns()["model.layers.3.mlp.sparse_ffn"]
    assert ffn.qformat == "q4_1" and ffn.down_qformat == "q8_0"
    torch.testing.assert_close(quant.dequantize(ffn.row_blocks("w_up"), "q4_1", 576),
                               dense.model.layers[3].mlp.up_proj.weight, atol=0, rtol=0)
    assert gguf_weights.tensor_name("llama", 30)("model.layers.3.mlp.up_proj") == "blk.3.ffn_up.weight"
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = _fake_quant_model(dense, "q4_1", gguf=True)
    with torch.no_grad():
        a, b, c = zoo.logits(cm, ids), zoo.logits(dense, ids), zoo.logits(ref, ids)
    cos = torch.nn.functional.cosine_similarity
    assert cos(a.flatten(), b.flatten(), dim=0) > 0.99
    # Prefill runs the 4-bit kernels, which sum integer products exactly where the reference
    # sums float ones: each layer's output differs in float32 rounding, and the next layer's
    # int8 rounding of its input turns some of that into whole steps, so 30 layers agree to
    # about 1% of a logit (the reference's own distance to float is 4x that).
    assert cos(a.flatten(), c.flatten(), dim=0) > 0.9999
    # The reference's greedy token is the compiled model's, or within a tenth of a logit of its
    # top one (a near-tie: the reference's own margin there is smaller than that difference).
    chosen = a.gather(-1, c.argmax(-1, keepdim=True)).squeeze(-1)  # [1, 12]
    assert ((a.amax(-1) - chosen) <= 0.1).all()
    assert (a.argmax(-1) == c.argmax(-1)).float().mean() >= 0.9
    assert (a - c).abs().max() < 0.5 * (b - c).abs().max()
    text = picompile.explain(cm)
    assert "FFN q4_1 (down q8_0)" in text and "re-quantized to q8_0 along d" in text


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_quantized_blocks_are_placed_by_their_quantized_bytes(fmt, tmp_path, monkeypatch):
    """compile(quantize=, gpu_budget=): placement (before quantizing) counts each neuron at the
    bytes the quantized block holds, so the same budget takes more hot neurons than float; the
    plan runs on the CPU here, and split across a device as distribute() puts it (the CPU
    standing in for the GPU) with the same outputs. Where the plan runs hybrid on a GPU, the
    attention projections and the LM head are quantized too (they go to the GPU whole, where
    codegen.cuda.quant_linear runs them)."""
    import warnings

    from picompile import compiler
    from picompile.passes import place

    dense = zoo.make("llama_relu", hidden=64, n_ff=256)
    ids = torch.randint(0, zoo.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    fixed = place.account(dense, {}, max_context=64)  # the non-FFN parts: all but the blocks
    fixed = sum(fixed.values()) - fixed["non_ffn_weights"] + sum(
        p.nbytes for name, p in dense.named_parameters() if ".mlp." not in name)
    float_ffn = sum(p.nbytes for name, p in dense.named_parameters() if ".mlp." in name)
    budget = place.budget_holding(fixed + 0.3 * float_ffn)  # 30% as float
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no CUDA GPU found": the plan is made
        kw = dict(gpu_budget=budget, calibration=ids, max_context=64, quiet=True)
        floated = picompile.compile(copy.deepcopy(dense), **kw)
        cm = picompile.compile(copy.deepcopy(dense), quantize=fmt, **kw)
    placement = cm.plan.placement
    assert placement.fixed_on_gpu
    hot = {b.name: b.decided.hot_neurons for b in cm.plan.blocks}
    hot_float = {b.name: b.decided.hot_neurons for b in floated.plan.blocks}
    assert sum(hot.values()) > sum(hot_float.values())
    ffn_bytes = sum(hot[name] * place.neuron_bytes(f) for name, f in cm.ffns().items())
    assert all(f.qformat == fmt for f in cm.ffns().values())
    assert placement.gpu_bytes == sum(placement.fixed_bytes.values()) + ffn_bytes
    assert placement.gpu_bytes <= placement.budget_bytes
    assert any(isinstance(m, QuantLinear) for m in cm._orig_mod.modules())  # CPU: all quantized
    cm.save(tmp_path / "plan")
    prompt = torch.randint(0, zoo.VOCAB, (1, 6))
    with torch.no_grad():
        want = zoo.logits(cm, prompt)
        cm.distribute("cpu")
        assert all(f.hybrid is not None for f in cm.ffns().values())
        torch.testing.assert_close(zoo.logits(cm, prompt), want, rtol=1e-4, atol=1e-4)

    # the same plan where a GPU runs it: linears quantized as on the CPU, blocks too
    monkeypatch.setattr(compiler, "runs_hybrid", lambda plan: True)
    loaded = picompile.load(copy.deepcopy(dense), tmp_path / "plan", distribute=False)
    assert any(isinstance(m, QuantLinear) for m in loaded._orig_mod.modules())
    assert all(f.qformat == fmt for f in loaded.ffns().values())
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(loaded, prompt), want, rtol=1e-4, atol=1e-4)


FIXTURE = __import__("pathlib").Path(__file__).parent / "fixtures" / "relu_llama"


@pytest.fixture(scope="module")
def fixture_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURE)
    return AutoModelForCausalLM.from_pretrained(FIXTURE).eval(), tok


def _heldout_nll(model, tok, rows: int = 8) -> float:
    from picompile import corpus

    ids = corpus.token_batches(tok, "heldout", rows * 256)  # [rows, 256]
    with torch.no_grad():
        logits = zoo.logits(model, ids)[:, :-1]
    return float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_calibrated_quantization_is_closer_to_float(fixture_model, fmt):
    """compile(quantize=, tokenizer=) rounds by GPTQ on the calibration split's Hessians: the
    trained fixture's held-out loss moves less from float than with round-to-nearest, the
    blocks are the kernels' formats as before, explain says how they were rounded, and a saved
    plan loads back to the same blocks (saved with it: load does not calibrate)."""
    dense, tok = fixture_model
    base = _heldout_nll(dense, tok)
    rtn = picompile.compile(copy.deepcopy(dense), quantize=fmt, quiet=True)
    cal = picompile.compile(copy.deepcopy(dense), quantize=fmt, tokenizer=tok,
                            calibration_tokens=4096, quiet=True)
    assert cal.plan.quant_calibration_tokens == 4096 and rtn.plan.quant_calibration_tokens == 0
    loss_rtn, loss_cal = _heldout_nll(rtn, tok) - base, _heldout_nll(cal, tok) - base
    assert 0 < loss_cal < 0.8 * loss_rtn
    ffn = next(iter(cal.ffns().values()))
    assert ffn.qformat == fmt and ffn.down_qformat == "q8_0" and ffn.w_up.dtype == torch.uint8
    assert "rounded by GPTQ on the Hessians of 4096 calibration tokens" in picompile.explain(cal)
    assert "rounded to nearest" in picompile.explain(rtn)


def test_calibrated_plan_saves_and_loads_its_blocks(tmp_path):
    dense = zoo.make("llama_silu", hidden=64, n_ff=96)
    ids = torch.randint(0, zoo.VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_1", calibration=ids, quiet=True)
    rtn = picompile.compile(copy.deepcopy(dense), quantize="q4_1", quiet=True)
    ffn, ffn_rtn = next(iter(cm.ffns().values())), next(iter(rtn.ffns().values()))
    assert not torch.equal(ffn.w_up, ffn_rtn.w_up)  # GPTQ chose other blocks
    cm.save(tmp_path / "plan")
    loaded = picompile.load(copy.deepcopy(dense), tmp_path / "plan")
    assert loaded.plan.quant_calibration_tokens == cm.plan.quant_calibration_tokens == 256
    want = {k: t.clone() for k, t in cm._quant_blocks().items()}
    got = loaded._quant_blocks()
    assert want.keys() == got.keys() and len(want) == 2 * 7 + 1  # 2 layers: 3 FFN + 4 attention
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert "saved with the plan" in picompile.explain(loaded)
    test = torch.randint(0, zoo.VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(loaded, test), zoo.logits(cm, test), atol=0, rtol=0)
    # a plan whose GPTQ blocks lack a weight's (its checksums made anew): refused before any
    # weight is quantized, not rounded to nearest
    plan_json, tensors = saving.read(tmp_path / "plan", cm.plan.fingerprint)
    for key in ("model.layers.1.mlp.sparse_ffn.w_up.blocks", "lm_head.blocks"):
        saving.save(plan_json, {k: t for k, t in tensors.items() if k != key},
                    cm.plan.fingerprint, tmp_path / "short")
        model = copy.deepcopy(dense)
        with pytest.raises(saving.PlanError, match=f"saved tensor {key} is missing"):
            picompile.load(model, tmp_path / "short")
        with torch.no_grad():
            assert torch.equal(zoo.logits(model, test), zoo.logits(dense, test))


def test_calibrated_layer_by_layer_leaves_the_head_to_nearest():
    """A float16 model on the CPU calibrates layer by layer in float32 (passes/calibrate.py):
    the Hessians come from the decoder layers; the LM head, not run there, rounds to nearest."""
    dense = zoo.make("llama_silu", dtype=torch.float16, hidden=64, n_ff=96)
    ids = torch.randint(0, zoo.VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", calibration=ids, quiet=True)
    # 2 x (3 + 4), not the head
    assert "14 of 15 weight matrices rounded by GPTQ" in picompile.explain(cm)
    assert "the other 1 to nearest" in picompile.explain(cm)
    head = cm._orig_mod.get_output_embeddings()
    assert torch.equal(head.row_blocks(), quant.quantize(dense.lm_head.weight, "q8_0"))


def test_gptq_too_large_for_memory_rounds_to_nearest_with_a_note(monkeypatch):
    """Where every layer's Hessians would exceed hessians.MAX_BYTES, compile does not gather
    them: blocks rounded to nearest (gguf's reference), and a note says why."""
    from picompile.passes import hessians

    dense = zoo.make("llama_relu", hidden=64, n_ff=96)
    assert 0 < hessians.estimate_bytes(dense, {}) < hessians.MAX_BYTES
    monkeypatch.setattr(hessians, "MAX_BYTES", 1)
    monkeypatch.setattr(hessians, "collect", lambda *a, **k: pytest.fail("Hessians gathered"))
    ids = torch.randint(0, zoo.VOCAB, (4, 32))  # as many tokens as the widest weight's inputs
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", calibration=ids, quiet=True)
    assert any("rounded to nearest" in n and "would take" in n for n in cm.quant_notes)
    ffn = next(iter(cm.ffns().values()))
    assert torch.equal(ffn.row_blocks("w_up"), quant.quantize(ffn_float_up(dense, ffn), "q4_0"))


def ffn_float_up(dense, ffn):
    """The float up rows of `ffn`'s block in the original model (its neuron order)."""
    up = dense.get_submodule(f"{ffn.block.module}.{ffn.block.linears['up']}").weight
    return up if ffn.order is None else up[ffn.order]


def test_gptq_layer_by_layer_equals_gptq_weight_by_weight():
    """Layer by layer, hessians.collect hands each decoder layer's Hessians to `done` once every
    batch has passed the layer (and keeps none), and Rounding.gather runs GPTQ on them at once,
    the weights that share a Hessian stacked: the blocks are GPTQ's of each weight alone, on
    Hessians gathered whole. (The FFN blocks' weights: the linears are lowered here already.)"""
    from picompile import gptq
    from picompile.passes import hessians as hessians_pass

    cm = picompile.compile(zoo.make("llama_silu", hidden=64, n_ff=96, layers=3), quiet=True)
    model, ffns = cm._orig_mod, cm.ffns()
    ids = torch.randint(0, zoo.VOCAB, (6, 16), generator=torch.Generator().manual_seed(3))
    whole, n = hessians_pass.collect(model, ffns, ids, quiet=True, device="cpu",
                                     dtype=torch.float32)
    targets = quantize_pass.gptq_targets(model, ffns, "q4_0")
    gathered = quantize_pass.Rounding(tokens=ids.numel())  # 96: as many as down's inputs
    layers_seen = []

    def done(hessians):
        layers_seen.append({key.split(".")[2] for key in hessians})  # model.layers.<i>.…
        gathered.gather(hessians, targets)

    rest, n2 = hessians_pass.collect(model, ffns, ids, quiet=True, device="cpu",
                                     dtype=torch.float32, done=done)
    assert n == n2 == ids.numel() and rest == {}
    assert layers_seen == [{"0"}, {"1"}, {"2"}]
    assert set(gathered.ready) == set(whole) and len(whole) == 3 * 3  # gate, up, down_t
    assert whole[next(iter(ffns)) + ".w_gate"] is whole[next(iter(ffns)) + ".w_up"]  # shared
    for key, h in whole.items():
        w, fmt, transposed = targets[key]
        assert (fmt, transposed) == (("q8_0", True) if key.endswith("down_t") else ("q4_0", False))
        prep = gptq.prepare(h, act_order=not transposed)
        want = gptq.quantize_transposed(w, fmt, prep) if transposed else gptq.quantize(w, fmt, prep)
        assert torch.equal(gathered.blocks(key, w, fmt, transposed), want), key
    assert gathered.count == len(whole) and not gathered.ready
    key = next(iter(ffns)) + ".w_up"
    gathered.gather({key: whole[key]}, targets)
    with pytest.raises(AssertionError, match="q8_0"):  # not the format GPTQ used: a bug, loud
        gathered.blocks(key, targets[key][0], "q8_0")


def test_gptq_targets_name_each_weight_with_the_format_compile_gives_it():
    model = zoo.make("llama_silu", hidden=64, n_ff=96)  # uncompiled: every linear an nn.Linear
    targets = quantize_pass.gptq_targets(model, {}, "q4_0")
    formats = {key: (fmt, transposed) for key, (w, fmt, transposed) in targets.items()}
    assert formats["lm_head"] == ("q8_0", False)  # 4-bit formats keep the head at q8_0
    assert formats["model.layers.1.self_attn.k_proj"] == ("q4_0", False)
    assert targets["model.layers.0.mlp.up_proj"][0] is model.model.layers[0].mlp.up_proj.weight
    assert quantize_pass.gptq_targets(model, {}, "q8_0")["lm_head"][1] == "q8_0"


def test_gptq_goes_layer_by_layer_where_all_hessians_at_once_are_too_many(monkeypatch):
    """A float32 model calibrates whole, holding every layer's Hessians; where those would
    exceed hessians.MAX_BYTES but one layer's would not, GPTQ runs layer by layer instead of
    giving up (the LM head, not run there, rounds to nearest)."""
    from picompile.passes import hessians

    dense = zoo.make("llama_silu", hidden=64, n_ff=96)
    # the plain model's per-layer count (gate and up apart) is above the compiled model's
    # per-layer one (one FFN input) and below its whole one (two layers and the head)
    bound = hessians.estimate_bytes(dense, {}, layers=dense.model.layers)
    monkeypatch.setattr(hessians, "MAX_BYTES", bound)
    ids = torch.randint(0, zoo.VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", calibration=ids, quiet=True)
    # 2 x (3 + 4), not the head
    assert "14 of 15 weight matrices rounded by GPTQ" in picompile.explain(cm)
    assert not any("would take" in n for n in cm.quant_notes)
    head = cm._orig_mod.get_output_embeddings()
    assert torch.equal(head.row_blocks(), quant.quantize(dense.lm_head.weight, "q8_0"))
    monkeypatch.setattr(hessians, "MAX_BYTES", 1)  # not even one layer's: to nearest, noted
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", calibration=ids, quiet=True)
    assert any("per layer" in n and "would take" in n for n in cm.quant_notes)


def test_gptq_leaves_weights_with_more_inputs_than_tokens_to_nearest():
    """A Hessian of more inputs than calibration tokens is singular: those weights are rounded
    to nearest (GPTQ on it measured worse on new text), and the note says how many tokens
    would do."""
    from picompile.passes import hessians as hessians_pass

    cm = picompile.compile(zoo.make("llama_silu", hidden=64, n_ff=96, layers=2), quiet=True)
    model, ffns = cm._orig_mod, cm.ffns()
    ids = torch.randint(0, zoo.VOCAB, (5, 16), generator=torch.Generator().manual_seed(4))
    targets = quantize_pass.gptq_targets(model, ffns, "q4_0")
    hessians, n = hessians_pass.collect(model, ffns, ids, quiet=True)
    rounding = quantize_pass.Rounding(tokens=n)  # 80: more than gate / up's 64 inputs, fewer
    rounding.gather(hessians, targets)  # than down's 96
    assert {key.rsplit(".", 1)[1] for key in rounding.ready} == {"w_gate", "w_up"}
    rounding.too_wide = quantize_pass.too_wide(targets, n)
    assert rounding.too_wide == {96: 2}  # each block's down rows
    narrow, _ = hessians_pass.collect(model, ffns, ids, quiet=True, max_width=n)
    assert set(narrow) == {key for key in hessians if not key.endswith("w_down_t")}
    assert hessians_pass.estimate_bytes(model, ffns, max_width=n) == \
        hessians_pass.estimate_bytes(model, ffns) - 2 * 4 * 96 * 96  # the memory guard too
    rounding.count = 4
    note = quantize_pass.rounding_note(rounding, n, 2 * 3 + 4 + 1)
    assert "2 weights with more inputs than calibration tokens (up to 96)" in note
    assert "pass at least 96 calibration tokens" in note


def test_too_few_calibration_tokens_for_every_weight_skip_the_hessians():
    """Fewer tokens than any weight's inputs: no Hessians are gathered, every block is rounded to
    nearest, and explain() says how many tokens GPTQ needs."""
    dense = zoo.make("llama_silu", hidden=64, n_ff=96, layers=2)
    ids = torch.randint(0, zoo.VOCAB, (1, 32), generator=torch.Generator().manual_seed(5))
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", calibration=ids, quiet=True)
    rtn = picompile.compile(copy.deepcopy(dense), quantize="q4_0", quiet=True)
    assert cm.plan.quant_calibration_tokens == 0
    text = picompile.explain(cm)
    assert "32 calibration tokens are fewer than the inputs of every weight (at least 64)" in text
    assert "pass at least 96 for GPTQ on all" in text
    for (name, ffn), ffn_rtn in zip(cm.ffns().items(), rtn.ffns().values()):
        assert torch.equal(ffn.w_up, ffn_rtn.w_up), name


@pytest.mark.parametrize("arch", ["llama_relu", "opt"])  # OPT's LM head is tied to its embedding
def test_placement_counts_the_linears_at_the_bytes_compile_quantizes_them_to(arch, monkeypatch):
    """compile(quantize=, gpu_budget=) places before it quantizes: the bytes placement counts for
    the weights outside the FFN blocks (attention projections and the LM head in the formats
    they will have, a head tied to the embedding as its blocks and the float embedding) are the
    bytes the compiled model holds there."""
    import warnings

    from picompile.passes import place
    from picompile.runtime import memory

    monkeypatch.setenv(memory.ENV, "0")  # each tensor its own storage, as account counts them
    dense = zoo.make(arch, hidden=64, n_ff=256)
    ids = torch.randint(0, zoo.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no CUDA GPU found": the plan is made
        cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", gpu_budget=2**30,
                               calibration=ids, max_context=64, quiet=True)
    model = cm._orig_mod
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) >= 9  # 4 per layer + head
    planned = cm.plan.placement.fixed_bytes["non_ffn_weights"]
    assert planned == place.account(model, cm.ffns(), max_context=64)["non_ffn_weights"]
    float_bytes = place.account(dense, {}, max_context=64)["non_ffn_weights"] - sum(
        p.nbytes for name, p in dense.named_parameters() if ".mlp." in name or ".fc" in name)
    assert planned < 0.6 * float_bytes


def test_predicted_mode_counts_the_bytes_of_the_quantized_rows():
    """Predictors train on the float model, before quantize: the decode bytes per token they
    record (explain, report) are counted again at the rows the blocks then hold."""
    from picompile.passes.predictors import exact_decode_bytes

    dense = zoo.make("llama_relu", hidden=64, n_ff=256)
    ids = torch.randint(0, zoo.VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))
    kw = dict(mode="predicted", calibration=ids, quiet=True, predictors="all")
    floated = picompile.compile(copy.deepcopy(dense), **kw)
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", **kw)
    for (name, ffn), b_float in zip(cm.ffns().items(), floated.plan.blocks):
        m = ffn.block.measured
        assert ffn.qformat == "q4_0"
        assert m.decode_bytes_exact == exact_decode_bytes(ffn, m.true_density)
        assert m.decode_bytes_exact < 0.5 * b_float.measured.decode_bytes_exact, name
        assert 0 < m.decode_bytes_predicted < b_float.measured.decode_bytes_predicted, name


def test_a_gguf_file_of_another_model_is_refused_before_compiling(tmp_path):
    """gguf= a file whose metadata gives another layer count (or width) than the model's: a
    clear error before anything is measured, not every layer 'float in the GGUF file'."""
    small = zoo.make("llama_relu", hidden=64, n_ff=96, layers=2)
    _write_gguf(small, "llama", "q4_0", tmp_path / "small.gguf")
    other = zoo.make("llama_relu", hidden=64, n_ff=96, layers=3)
    with pytest.raises(ValueError, match="is not the GGUF file this model was loaded from: its "
                                         "llama.block_count is 2, the model's num_hidden_layers 3"):
        picompile.compile(copy.deepcopy(other), gguf=tmp_path / "small.gguf", quiet=True)
    picompile.compile(copy.deepcopy(small), gguf=tmp_path / "small.gguf", quiet=True)  # its own


def test_gptq_false_rounds_to_nearest_though_calibration_data_is_given():
    """compile(quantize=, calibration=, gptq=False): no Hessians, every block the reference's
    round-to-nearest one, and explain says why; gptq must be a bool."""
    dense = zoo.make("llama_relu", hidden=64, n_ff=96)
    ids = torch.randint(0, zoo.VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    cm = picompile.compile(copy.deepcopy(dense), quantize="q4_0", calibration=ids, gptq=False,
                           quiet=True)
    assert cm.plan.quant_calibration_tokens == 0
    layer = dense.model.layers[0]
    q_proj = cm._orig_mod.model.layers[0].self_attn.q_proj
    assert torch.equal(q_proj.row_blocks(), quant.quantize(layer.self_attn.q_proj.weight, "q4_0"))
    assert any("gptq=False" in n for n in cm.quant_notes)
    gptq = picompile.compile(copy.deepcopy(dense), quantize="q4_0", calibration=ids, quiet=True)
    assert gptq.plan.quant_calibration_tokens > 0  # the default: GPTQ with calibration data
    with pytest.raises(ValueError, match="gptq must be True"):
        picompile.compile(copy.deepcopy(dense), quantize="q4_0", gptq="no")
