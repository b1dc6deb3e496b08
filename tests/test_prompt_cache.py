"""The prompt cache (runtime/decoder.py, Stack.cached_prefix): a generate whose prompt starts
with the tokens of the last one (a chat's next turn) prefills only the rest, over the keys and
values the decoder's KV cache holds (the C decoder's, and the device decoder's on the CPU
stand-in). What it must give: the tokens and the KV cache of a prefill from position 0
(PICOMPILE_PROMPT_CACHE=0), and no reuse where what is cached could be stale (weights edited,
in place, through .data or during the call) or is not whole (the C decoder past a sliding
window); a reply a streamer stops (a stop string, Ctrl-C) keeps what it cached. The C decoder
keeps snapshots of earlier prompts: a conversation interrupted by another prompt (a chat UI's
title request) keeps its cache."""

from __future__ import annotations

import pytest
import torch

import picompile
from picompile.config import PROMPT_SNAPSHOT_MIN_TOKENS, PROMPT_SNAPSHOTS
from picompile.runtime.device_decoder import DeviceDecoder
from tests import zoo
from tests.test_decoder import _compile_kw, _model
from tests.test_device_decoder import _split

NEW = 6


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, zoo.VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _compiled(arch: str, how: str = "exact"):
    cm = picompile.compile(_model(arch, layers=2), **_compile_kw(how))
    assert cm.decoder() is not None, cm.decoder_reason
    return cm


def _cached(dec, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions 0..n-1, [layers, kv heads, n, head dim] each, from either
    decoder's layout (the C one's [L, KV, max_len, hd]; the device one's per layer)."""
    return tuple(torch.stack([c.reshape(c.shape[-3:])[:, :n].float() for c in caches])
                 for caches in (dec.k_cache, dec.v_cache))


def _generate_both(cm, prompt: torch.Tensor, monkeypatch, max_new_tokens: int = NEW):
    """(tokens, KV cache positions it filled) with the prompt cache, then without it, and the
    positions the first took from the cache. Each run starts from the same cached state."""
    dec = cm.decoder()
    held = dec.held
    out = cm.generate(prompt, max_new_tokens=max_new_tokens)
    reused, n = dec.prompt_reused, out.shape[1] - 1
    kv = _cached(dec, n)
    dec.held = held
    with monkeypatch.context() as m:
        m.setenv("PICOMPILE_PROMPT_CACHE", "0")
        want = cm.generate(prompt, max_new_tokens=max_new_tokens)
        assert dec.prompt_reused == 0
    torch.testing.assert_close(kv, _cached(dec, n), rtol=1e-4, atol=1e-5)
    assert torch.equal(out, want)
    return out, reused


@pytest.mark.parametrize("arch", ["llama_relu", "qwen3", "phi3", "opt", "gemma2"])
@pytest.mark.parametrize("how", ["exact", "threshold"])
def test_a_next_turn_prefills_only_its_new_tokens(arch, how, monkeypatch):
    cm = _compiled(arch, how)
    first = cm.generate(_ids(10, 1), max_new_tokens=NEW)  # [1, 16]
    assert len(cm.decoder().held) == first.shape[1] - 1  # the last token was never fed
    turn = torch.cat([first, _ids(5, 2)], 1)
    out, reused = _generate_both(cm, turn, monkeypatch)
    assert reused == first.shape[1] - 1
    assert torch.equal(out[:, : turn.shape[1]], turn)


def test_a_prompt_that_differs_reuses_the_common_part(monkeypatch):
    cm = _compiled("llama_relu")
    a = _ids(12, 1)
    cm.generate(a, max_new_tokens=NEW)
    b = torch.cat([a[:, :7], _ids(9, 3)], 1)
    b[0, 7] = (a[0, 7] + 1) % zoo.VOCAB  # differs from position 7 on
    _, reused = _generate_both(cm, b, monkeypatch)
    assert reused == 7


def test_the_same_prompt_again_prefills_its_last_position(monkeypatch):
    cm = _compiled("llama_relu")
    a = _ids(12, 1)
    first = cm.generate(a, max_new_tokens=NEW)
    out, reused = _generate_both(cm, a, monkeypatch)
    assert reused == 11
    assert torch.equal(out, first)


def test_weights_edited_in_place_are_not_reused(monkeypatch):
    cm = _compiled("llama_relu")
    a = _ids(12, 1)
    first = cm.generate(a, max_new_tokens=NEW)
    with torch.no_grad():
        cm.model.norm.weight.mul_(1.5)  # every cached key and value is still the old model's
    _, reused = _generate_both(cm, torch.cat([first, _ids(4, 2)], 1), monkeypatch)
    assert reused == 0


def test_a_conversation_interrupted_by_another_prompt_keeps_its_cache(monkeypatch):
    """A turn, another prompt (its own conversation: the first is saved as a snapshot before
    being overwritten), then the first conversation's next turn: its keys and values come back
    and only its new tokens are prefilled, with the tokens and cache of a prefill from 0."""
    cm = _compiled("llama_relu")
    dec = cm.decoder()
    first = cm.generate(_ids(PROMPT_SNAPSHOT_MIN_TOKENS, 1), max_new_tokens=NEW)
    other = cm.generate(_ids(PROMPT_SNAPSHOT_MIN_TOKENS + 3, 4), max_new_tokens=NEW)
    assert dec.prompt_reused == 0 and len(dec._snapshots) == 1
    _, reused = _generate_both(cm, torch.cat([first, _ids(5, 2)], 1), monkeypatch)
    assert reused == first.shape[1] - 1
    assert [len(s[0]) for s in dec._snapshots] == [other.shape[1] - 1]  # the other, saved


def test_the_oldest_snapshot_comes_back_when_the_slots_are_full(monkeypatch):
    """All slots taken and the held prompt about to be saved (which drops the oldest): the
    oldest is the one the next prompt continues, and it is the one brought back."""
    cm = _compiled("llama_relu")
    dec = cm.decoder()
    outs = [cm.generate(_ids(40, 30 + j), max_new_tokens=NEW)
            for j in range(PROMPT_SNAPSHOTS + 1)]
    assert len(dec._snapshots) == PROMPT_SNAPSHOTS
    _, reused = _generate_both(cm, torch.cat([outs[0], _ids(5, 2)], 1), monkeypatch)
    assert reused == outs[0].shape[1] - 1


def test_snapshots_are_bounded_and_dropped_where_stale(monkeypatch):
    cm = _compiled("llama_relu")
    dec = cm.decoder()
    cm.generate(_ids(PROMPT_SNAPSHOT_MIN_TOKENS - NEW - 1, 9), max_new_tokens=NEW)  # too short
    cm.generate(_ids(40, 10), max_new_tokens=NEW)
    assert dec._snapshots == []
    prompts = [_ids(40, 20 + j) for j in range(PROMPT_SNAPSHOTS + 2)]
    for p in prompts:
        cm.generate(p, max_new_tokens=NEW)
    kept = [s[0][:40] for s in dec._snapshots]
    assert len(kept) == PROMPT_SNAPSHOTS  # the newest, each prompt's but the held one
    assert all(torch.equal(k, p[0]) for k, p in zip(kept, prompts[-PROMPT_SNAPSHOTS - 1:-1]))
    with torch.no_grad():
        cm.model.norm.weight.mul_(1.5)  # every snapshot is the old model's
    _, reused = _generate_both(cm, torch.cat([prompts[-2], _ids(4, 2)], 1), monkeypatch)
    assert reused == 0 and dec._snapshots == []
    dec.forget()
    assert dec.held is None and dec._snapshots is None


def test_the_cache_keeps_its_positions_when_it_grows(monkeypatch):
    cm = _compiled("llama_relu")
    first = cm.generate(_ids(10, 1), max_new_tokens=NEW)
    size = cm.decoder().max_len
    turn = torch.cat([first, _ids(size, 2)], 1)  # needs more room than reserved
    _, reused = _generate_both(cm, turn, monkeypatch)
    assert cm.decoder().max_len > size
    assert reused == first.shape[1] - 1


def test_calls_the_decoder_does_not_run_leave_the_cache_as_it_was(monkeypatch):
    cm = _compiled("llama_relu")
    first = cm.generate(_ids(10, 1), max_new_tokens=NEW)
    cm.generate(torch.cat([_ids(16, 4), _ids(16, 5)]), max_new_tokens=3)  # a batch: per module
    _, reused = _generate_both(cm, torch.cat([first, _ids(4, 2)], 1), monkeypatch)
    assert reused == first.shape[1] - 1


def test_sliding_windows_are_reused_until_a_call_runs_past_one(monkeypatch):
    cm = _compiled("gemma3")  # a sliding layer of 64 positions and a global one
    assert min(layer.window or 1e9 for layer in cm.decoder().layers) == 64
    first = cm.generate(_ids(30, 1), max_new_tokens=NEW)
    turn, reused = _generate_both(cm, torch.cat([first, _ids(4, 2)], 1), monkeypatch)
    assert reused == first.shape[1] - 1
    # 46 positions, then 52 + 14 > 64: the window slides in HF's cache, no reuse; nor after
    _, reused = _generate_both(cm, torch.cat([turn, _ids(6, 3)], 1), monkeypatch, 14)
    assert reused == 0
    assert cm.decoder().held is None


class _StopAfter:
    """A streamer that raises (as a stop string or Ctrl-C does) at its n-th new token, after
    `edit()` where one is given."""

    def __init__(self, n: int, edit=None):
        self.puts, self.n, self.edit = 0, n, edit

    def put(self, tokens):
        self.puts += 1  # the first put is the prompt
        if self.puts == self.n + 1:
            if self.edit is not None:
                self.edit()
            raise KeyboardInterrupt

    def end(self):
        pass


def test_a_reply_a_streamer_stops_keeps_what_it_cached(monkeypatch):
    cm = _compiled("llama_relu")
    first = cm.generate(_ids(10, 1), max_new_tokens=NEW)  # [1, 16]
    turn = torch.cat([first, _ids(4, 2)], 1)  # [1, 20]
    with pytest.raises(KeyboardInterrupt):  # at its third new token: two were stepped
        cm.generate(turn, max_new_tokens=NEW, streamer=_StopAfter(3))
    held = cm.decoder().held
    assert len(held) == turn.shape[1] + 2 and torch.equal(held[:20], turn[0])
    _, reused = _generate_both(cm, torch.cat([held[None], _ids(3, 3)], 1), monkeypatch)
    assert reused == len(held)


def test_weights_edited_through_data_are_not_reused(monkeypatch):
    """`.data` edits (how LoRA merges are made) bump no version counter."""
    cm = _compiled("llama_relu")
    first = cm.generate(_ids(12, 1), max_new_tokens=NEW)
    for layer in cm.model.layers:
        layer.self_attn.k_proj.weight.data += 0.5
    _, reused = _generate_both(cm, torch.cat([first, _ids(4, 2)], 1), monkeypatch)
    assert reused == 0


def test_weights_edited_during_a_call_are_not_held():
    cm = _compiled("llama_relu")

    def edit():
        with torch.no_grad():
            cm.model.norm.weight.mul_(2)

    with pytest.raises(KeyboardInterrupt):
        cm.generate(_ids(12, 1), max_new_tokens=NEW, streamer=_StopAfter(3, edit))
    assert cm.decoder().held is None


@pytest.mark.parametrize("arch", ["llama_relu", "gemma3"])
def test_the_device_decoder_prefills_only_the_new_tokens_too(arch, monkeypatch):
    config = zoo.hf_config(arch)
    if arch == "gemma3":
        config.sliding_window = 4  # its cache is whole: windows are masks there
    _, cm = _split(arch, (0.5,), config=config)
    assert isinstance(cm.decoder(), DeviceDecoder), cm.decoder_reason
    first = cm.generate(_ids(10, 1), max_new_tokens=NEW)
    turn, reused = _generate_both(cm, torch.cat([first, _ids(5, 2)], 1), monkeypatch)
    assert reused == first.shape[1] - 1
    size = cm.decoder().max_len  # and once more, past the room reserved
    _, reused = _generate_both(cm, torch.cat([turn, _ids(size, 3)], 1), monkeypatch)
    assert cm.decoder().max_len > size
    assert reused == turn.shape[1] - 1
