"""Saving plans safely (issue 12): where a save may write, crash safety, permissions, and
validation of every field and tensor of a loaded plan."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import stat

import pytest
import torch

import picompile
from picompile import plan as plan_module
from picompile import saving
from picompile.plan import BlockPlan, Decisions, Measurements, Placement, Plan, Unmatched
from tests import zoo

OURS = {"manifest.json", "plan.json", "tensors.safetensors"}


@pytest.fixture(scope="module")
def compiled():
    dense = zoo.make("llama_relu")
    cm = picompile.compile(copy.deepcopy(dense), quiet=True)
    return dense, cm


@pytest.fixture(scope="module")
def plans(compiled):
    """Two different plans for the same model: (plan JSON, tensors), old and new."""
    _, cm = compiled
    old_json = cm.plan.to_json()
    old_tensors = {f"{b.name}.order": torch.arange(b.d_ff) for b in cm.plan.blocks}
    new_json = copy.deepcopy(old_json)
    new_json["calibration_tokens"] = 123
    new_json["blocks"][0]["decided"]["hot_neurons"] = 5
    new_json["placement"]["budget_bytes"] = 10**6  # (hot neurons are placed ones)
    gen = torch.Generator().manual_seed(0)
    new_tensors = {f"{b.name}.order": torch.randperm(b.d_ff, generator=gen) for b in cm.plan.blocks}
    return cm.plan.fingerprint, (old_json, old_tensors), (new_json, new_tensors)


def files(d: pathlib.Path) -> dict[str, bytes]:
    """Every file under d (recursively), by relative path."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def same(got, want) -> bool:
    (gj, gt), (wj, wt) = got, want
    return gj == wj and gt.keys() == wt.keys() and all(
        gt[k].dtype == wt[k].dtype and torch.equal(gt[k], wt[k]) for k in wt)


def rewrite(d: pathlib.Path, name: str, data: bytes) -> None:
    """Replace a plan file and its checksum in the manifest: a deliberate hand edit."""
    (d / name).write_bytes(data)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256(data).hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))


# -- where a save may write -------------------------------------------------------------------


def test_save_refuses_a_directory_that_is_not_a_plan(compiled, tmp_path):
    _, cm = compiled
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('hello')\n")
    (project / "README.md").write_text("my project\n")
    before = files(project)
    with pytest.raises(saving.SaveRefused, match="not a picompile plan") as e:
        cm.save(project)
    assert "README.md" in str(e.value) and isinstance(e.value, saving.PlanError)
    assert files(project) == before
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "src"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]


def test_save_refuses_a_directory_with_a_foreign_manifest(compiled, tmp_path):
    _, cm = compiled
    ext = tmp_path / "extension"
    ext.mkdir()
    (ext / "manifest.json").write_text('{"name": "a browser extension", "version": 1}')
    before = files(ext)
    with pytest.raises(saving.SaveRefused, match="not a picompile plan"):
        cm.save(ext)
    assert files(ext) == before


def test_save_refuses_a_regular_file(compiled, tmp_path):
    _, cm = compiled
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    with pytest.raises(saving.SaveRefused, match="is a file"):
        cm.save(f)
    assert f.is_file() and f.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_save_under_a_regular_file_is_refused_naming_it(compiled, tmp_path):
    _, cm = compiled
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    with pytest.raises(saving.SaveRefused, match=r"notes.txt is a file, so .* cannot be made"):
        cm.save(f / "plan")
    assert f.read_text() == "keep me"


def test_a_plan_json_naming_another_model_than_its_manifest_is_refused(compiled, tmp_path):
    """A hand-edited plan.json with another fingerprint (checksums made again) would load, and
    a later save would write its fingerprint into the new manifest."""
    dense, cm = compiled
    path = tmp_path / "plan"
    cm.save(path)
    data = json.loads((path / "plan.json").read_text())
    data["fingerprint"] = "0" * 64
    rewrite(path, "plan.json", json.dumps(data).encode())
    with pytest.raises(saving.PlanError, match="names another model than manifest.json"):
        picompile.load(copy.deepcopy(dense), path)


@pytest.mark.parametrize("where", ["absent", "nested", "empty"])
def test_save_into_a_new_or_empty_directory(compiled, tmp_path, where):
    dense, cm = compiled
    path = tmp_path / "a" / "b" / "plan" if where == "nested" else tmp_path / "plan"
    if where == "empty":
        path.mkdir()
        path.chmod(0o750)
    previous = os.umask(0o022)
    try:
        cm.save(path)
    finally:
        os.umask(previous)
    assert {p.name for p in path.iterdir()} == OURS
    assert stat.S_IMODE(path.stat().st_mode) == (0o750 if where == "empty" else 0o755)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a" if where == "nested" else "plan"]
    assert picompile.load(copy.deepcopy(dense), path).plan.to_json() == cm.plan.to_json()


def test_save_replaces_a_plan_and_keeps_files_it_did_not_write(compiled, plans, tmp_path):
    dense, _ = compiled
    fp, old, new = plans
    path = tmp_path / "plan"
    saving.save(*old, fp, path)
    (path / "NOTES.md").write_text("how I made this plan")
    saving.save(*new, fp, path)
    assert {p.name for p in path.iterdir()} == OURS | {"NOTES.md"}
    assert (path / "NOTES.md").read_text() == "how I made this plan"
    assert same(saving.read(path, fp), new)
    loaded = picompile.load(copy.deepcopy(dense), path)
    assert loaded.plan.calibration_tokens == 123 and loaded.plan.blocks[0].decided.hot_neurons == 5


def test_save_through_a_symlink_keeps_the_link(compiled, plans, tmp_path):
    fp, old, new = plans
    real = tmp_path / "real"
    saving.save(*old, fp, real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    saving.save(*new, fp, link)
    assert link.is_symlink() and same(saving.read(real, fp), new)


# -- crash safety -----------------------------------------------------------------------------


class Killed(BaseException):
    """The saving process died (not an Exception: nothing may catch it and go on)."""


class DyingOS:
    """`os` for picompile.saving in which the process dies at the k-th filesystem change: that
    call and every later one raise Killed, so cleanup handlers cannot run either, as after a kill."""

    CHANGES = {"mkdir", "makedirs", "rename", "replace", "rmdir", "unlink", "remove", "fsync",
               "write", "truncate", "ftruncate", "chmod"}

    def __init__(self, k: int):
        self.k, self.calls = k, 0

    def step(self, what: str) -> None:
        self.calls += 1
        if self.calls >= self.k:
            raise Killed(what)

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in self.CHANGES:
            return real

        def change(*args, **kwargs):
            self.step(name)
            return real(*args, **kwargs)

        return change


def interrupted_save(monkeypatch, k: int, save) -> bool:
    """Run save() with the process dying at step k -> whether it completed."""
    dying = DyingOS(k)
    real_save_file = saving.save_file

    def save_file(*args, **kwargs):
        dying.step("save_file")
        return real_save_file(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(saving, "os", dying)
        m.setattr(saving, "save_file", save_file)
        try:
            save()
        except Killed:
            return False
    return True


def seen_without_cleanup(monkeypatch, path, fp):
    """What a reader that may not write the directory (so does not clean up) loads."""
    with monkeypatch.context() as m:
        m.setattr(saving, "_recover", lambda d: pytest.fail("a read-only reader wrote"))
        m.setattr(saving, "_writable_dir", lambda d: False)
        return saving.read(path, fp)


def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_plan(compiled, plans, tmp_path,
                                                                 monkeypatch):
    dense, _ = compiled
    fp, old, new = plans
    ref_old, ref_new = tmp_path / "ref_old", tmp_path / "ref_new"
    saving.save(*old, fp, ref_old)
    saving.save(*new, fp, ref_new)
    old_files, new_files = files(ref_old), files(ref_new)
    outcomes = []
    for k in range(1, 100):
        path = tmp_path / f"plan{k}"
        saving.save(*old, fp, path)
        done = interrupted_save(monkeypatch, k, lambda: saving.save(*new, fp, path))
        # a reader that cannot clean up sees one whole plan
        seen = seen_without_cleanup(monkeypatch, path, fp)
        assert same(seen, old) or same(seen, new), k
        outcome = "new" if same(seen, new) else "old"
        assert outcome == "new" or not done
        outcomes.append(outcome)
        # a load finishes or undoes the interrupted save: exactly the files of one of the plans
        loaded = picompile.load(copy.deepcopy(dense), path)
        assert loaded.plan.calibration_tokens == (123 if outcome == "new" else 0)
        assert files(path) == (new_files if outcome == "new" else old_files), k
        # and the next save works and leaves nothing else behind
        saving.save(*new, fp, path)
        assert files(path) == new_files
        assert {p.name for p in path.iterdir()} == OURS
        if done:
            break
    else:
        pytest.fail("the save never completed")
    assert k > 8  # it was interrupted at every step: staging, commit, each move
    assert outcomes[0] == "old" and outcomes[-1] == "new"
    assert outcomes == sorted(outcomes, key=["old", "new"].index)  # old ... old new ... new
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ref_old", "ref_new", *(f"plan{i}" for i in range(1, k + 1))])


def test_a_first_save_killed_at_any_step_leaves_no_plan_or_the_new(plans, tmp_path, monkeypatch):
    fp, _, new = plans
    ref = tmp_path / "ref"
    saving.save(*new, fp, ref)
    for k in range(1, 100):
        path = tmp_path / f"plan{k}"
        done = interrupted_save(monkeypatch, k, lambda: saving.save(*new, fp, path))
        try:
            outcome = same(saving.read(path, fp), new)
        except saving.PlanError as e:
            assert "not a saved picompile plan" in str(e) or "does not exist" in str(e), e
            outcome = False
        assert outcome or not done
        saving.save(*new, fp, path)  # an interrupted first save does not block the next
        assert files(path) == files(ref)
        if done:
            break
    assert k > 8


def test_save_leaves_directories_beside_dir_alone(plans, tmp_path):
    """Next to DIR nothing proves a directory is picompile's: the names picompile before issue
    12 left when killed (.plan.tmp-*, .plan.old-PID) may be a user's backup of a plan, or
    their notes; a save keeps them all."""
    fp, old, new = plans
    path = tmp_path / "plan"
    saving.save(*old, fp, path)
    for leftover in (".plan.tmp-abc123", ".plan.old-4242", ".plan.old-backup"):
        saving.save(*old, fp, tmp_path / "scratch")
        (tmp_path / "scratch").rename(tmp_path / leftover)
    mine = tmp_path / ".plan.old-777"
    mine.mkdir()
    (mine / "diary.txt").write_text("private")
    beside = {f: f.read_bytes() for f in tmp_path.rglob("*")
              if f.is_file() and path not in f.parents}
    saving.save(*new, fp, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".plan.old-4242", ".plan.old-777", ".plan.old-backup", ".plan.tmp-abc123", "plan"]
    assert {f: f.read_bytes() for f in beside} == beside


def test_a_tensor_file_that_cannot_be_written_is_an_oserror_naming_it(plans, tmp_path,
                                                                    monkeypatch):
    """safetensors' own I/O errors (a full disk) are not OSErrors: the command line would show
    a traceback; the save says which file and leaves the earlier plan as it was."""
    fp, old, new = plans
    path = tmp_path / "plan"
    saving.save(*old, fp, path)
    before = {f.name: f.read_bytes() for f in path.iterdir()}

    def full(*args, **kwargs):
        raise saving.SafetensorError("No space left on device (os error 28)")

    monkeypatch.setattr(saving, "save_file", full)
    with pytest.raises(OSError, match=r"could not write .*tensors\.safetensors: No space left"):
        saving.save(*new, fp, path)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before


def test_load_points_at_a_plan_an_earlier_picompile_left_aside(plans, tmp_path):
    fp, old, _ = plans
    saving.save(*old, fp, tmp_path / "scratch")
    (tmp_path / "scratch").rename(tmp_path / ".plan.old-4242")
    with pytest.raises(saving.PlanError, match=r"\.plan\.old-4242"):
        saving.read(tmp_path / "plan", fp)


# -- permissions ------------------------------------------------------------------------------


def test_save_refuses_a_read_only_plan_directory(plans, tmp_path):
    fp, old, new = plans
    path = tmp_path / "plan"
    saving.save(*old, fp, path)
    before = files(path)
    path.chmod(0o555)
    try:
        with pytest.raises(saving.SaveRefused, match="read-only"):
            saving.save(*new, fp, path)
        assert files(path) == before
        assert same(saving.read(path, fp), old)  # a read-only plan still loads
    finally:
        path.chmod(0o755)


def test_save_refuses_a_plan_whose_files_are_read_only(plans, tmp_path):
    fp, old, new = plans
    path = tmp_path / "plan"
    saving.save(*old, fp, path)
    before = files(path)
    for p in path.iterdir():
        p.chmod(0o444)
    with pytest.raises(saving.SaveRefused, match="read-only"):
        saving.save(*new, fp, path)
    assert files(path) == before
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o444 for p in path.iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_new_plan_directories_follow_the_umask(plans, tmp_path, umask):
    fp, old, new = plans
    previous = os.umask(umask)
    try:
        saving.save(*old, fp, tmp_path / "plan")
        saving.save(*new, fp, tmp_path / "plan")  # a replacement too
    finally:
        os.umask(previous)
    path = tmp_path / "plan"
    assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()} == {0o666 & ~umask}


def test_replacing_a_plan_keeps_the_directory_mode(plans, tmp_path):
    fp, old, new = plans
    path = tmp_path / "plan"
    saving.save(*old, fp, path)
    path.chmod(0o750)
    saving.save(*new, fp, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o750


# -- validation of a loaded plan ----------------------------------------------------------------


def test_every_plan_field_has_a_check(compiled):
    for cls, spec in [(Plan, plan_module.PLAN_FIELDS), (BlockPlan, plan_module.BLOCK_FIELDS),
                      (Unmatched, plan_module.UNMATCHED_FIELDS),
                      (Placement, plan_module.PLACEMENT_FIELDS),
                      (Decisions, plan_module.DECISION_FIELDS),
                      (Measurements, plan_module.MEASUREMENT_FIELDS)]:
        assert {f.name for f in dataclasses.fields(cls)} == set(spec), cls.__name__
    _, cm = compiled
    assert Plan.from_json(json.loads(json.dumps(cm.plan.to_json()))).to_json() == cm.plan.to_json()


def _set(path: str, value):
    def edit(data):
        keys = path.split(".")
        target = data
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[keys[-1]] = value
    return edit


def _delete(path: str):
    def edit(data):
        *keys, last = path.split(".")
        target = data
        for key in keys:
            target = target[int(key)] if isinstance(target, list) else target[key]
        del target[last]
    return edit


INVALID = {
    "mode": _set("mode", "turbo"),
    "predictors": _set("predictors", "sometimes"),
    "target_sparsity": _set("target_sparsity", 1.5),
    "calibration_tokens": _set("calibration_tokens", 1.5),
    "fingerprint": _set("fingerprint", 42),
    "blocks": _set("blocks", {"not": "a list"}),
    "threshold": _set("blocks.0.decided.threshold", -0.5),
    "decided.threshold": _set("blocks.0.decided.threshold", 0.5),  # a ReLU block: 0 only
    "hot_neurons": _set("blocks.0.decided.hot_neurons", 81),  # d_ff is 80
    "d_ff": _set("blocks.0.d_ff", "80"),
    "d_model": _set("blocks.1.d_model", 0),
    "bias": _set("blocks.0.bias", "yes"),
    "kind": _set("blocks.0.kind", "moe"),
    "act": _set("blocks.0.act", "swish"),
    "dtype": _set("blocks.0.dtype", "int8"),
    "sparsity": _set("blocks.0.measured.sparsity", 2.0),
    "predictor_rank": _set("blocks.0.decided.predictor_rank", -3),
    "predictor_tau": _set("blocks.0.decided.predictor_tau", math.nan),
    "fused_gate_half": _set("blocks.0.fused_gate_half", 2),
    "linears": _set("blocks.0.linears", ["up_proj"]),
    "decode_us_exact": _set("blocks.0.measured.decode_us_exact", math.inf),
    "name": _set("blocks.1.name", "model.layers.0.mlp.sparse_ffn"),  # a duplicate
    "reason": _set("unmatched.0.reason", None),
    "gpu_bytes": _set("placement.gpu_bytes", 10),  # over budget_bytes (5, set below)
    "budget_bytes": _set("placement.budget_bytes", -1),
    "expected_gpu_share": _set("placement.expected_gpu_share", 1.5),
    "fixed_on_gpu": _set("placement.fixed_on_gpu", 1),
    "notes": _set("placement.notes", "a string"),
    "unknown_field": _set("blocks.0.unknown_field", 1),
    "decided": _set("blocks.0.decided", [0.5]),
    "'d_ff'": _delete("blocks.0.d_ff"),  # missing
    "'mode'": _delete("mode"),
    "'threshold'": _delete("blocks.1.decided.threshold"),  # would run the block dense
    "'hot_neurons'": _delete("blocks.0.decided.hot_neurons"),
    "'decode_us_exact'": _delete("blocks.0.measured.decode_us_exact"),
    "'decided'": _delete("blocks.0.decided"),
    "nothing placed": _set("blocks.0.decided.hot_neurons", 5),  # hot neurons, no budget
    "quant_calibration_tokens > 0": _set("quant_calibration_tokens", 64),  # GPTQ, float
}


@pytest.mark.parametrize("field", list(INVALID))
def test_an_impossible_plan_value_is_refused_naming_the_field(compiled, field, tmp_path):
    dense, cm = compiled
    data = json.loads(json.dumps(cm.plan.to_json()))
    if field == "gpu_bytes":
        data["placement"]["budget_bytes"] = 5
    INVALID[field](data)
    with pytest.raises(saving.PlanError, match=field):
        Plan.from_json(data)
    path = tmp_path / "plan"
    cm.save(path)
    rewrite(path, "plan.json", json.dumps(data).encode())
    with pytest.raises(saving.PlanError, match=field) as e:
        picompile.load(copy.deepcopy(dense), path)
    assert "allowed" in str(e.value) or "lacks" in str(e.value)


@pytest.mark.parametrize("text", [b"{not json", b"\xff\xfe", b"[1, 2]", b"null"])
def test_plan_json_that_is_not_a_plan_is_refused(compiled, tmp_path, text):
    dense, cm = compiled
    path = tmp_path / "plan"
    cm.save(path)
    rewrite(path, "plan.json", text)
    with pytest.raises(saving.PlanError, match="not valid JSON|invalid plan: plan is"):
        picompile.load(copy.deepcopy(dense), path)


@pytest.mark.parametrize("files_value", [["plan.json"], {"plan.json": 1}, None])
def test_a_manifest_with_wrong_types_is_refused(compiled, tmp_path, files_value):
    dense, cm = compiled
    path = tmp_path / "plan"
    cm.save(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = files_value
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(saving.PlanError, match="files"):
        picompile.load(copy.deepcopy(dense), path)


def test_a_manifest_nested_too_deep_is_refused_as_corrupt(compiled, tmp_path):
    """JSON nested deeper than Python's parser recurses: a PlanError, not a RecursionError."""
    dense, cm = compiled
    path = tmp_path / "plan"
    cm.save(path)
    (path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(saving.PlanError, match="corrupt"):
        picompile.load(copy.deepcopy(dense), path)


def _with_predictor(data: dict, rank: int) -> dict:
    data = copy.deepcopy(data)
    data["blocks"][0]["decided"]["predictor_rank"] = rank
    return data


def _predictor(rank: int, d: int = 32, n_ff: int = 80) -> dict:
    name = "model.layers.0.mlp.sparse_ffn"
    return {f"{name}.predictor.p1": torch.zeros(rank, d), f"{name}.predictor.pb1": torch.zeros(rank),
            f"{name}.predictor.p2": torch.zeros(n_ff, rank), f"{name}.predictor.pb2": torch.zeros(n_ff)}


ORDER = "model.layers.0.mlp.sparse_ffn.order"
BAD_TENSORS = {
    "short order": (lambda j: j, {ORDER: torch.arange(79)}, ORDER),
    "float order": (lambda j: j, {ORDER: torch.arange(80).float()}, ORDER),
    "not a permutation": (lambda j: j, {ORDER: torch.zeros(80, dtype=torch.long)}, "permutation"),
    "unknown tensor": (lambda j: j, {"model.layers.9.mlp.order": torch.arange(80)}, "layers.9"),
    "predictor without rank": (lambda j: j, _predictor(4), "predictor"),
    "missing predictor": (lambda j: _with_predictor(j, 4), {}, "p1 is missing"),
    "wrong rank": (lambda j: _with_predictor(j, 4), _predictor(5), r"p1.*\(5, 32\).*\(4, 32\)"),
    "wrong n_ff": (lambda j: _with_predictor(j, 4), _predictor(4, n_ff=81), "p2"),
    "NaN predictor": (lambda j: _with_predictor(j, 4),
                      {**_predictor(4), "model.layers.0.mlp.sparse_ffn.predictor.pb2":
                       torch.full((80,), float("nan"))}, "pb2 holds NaN"),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_tensors_that_do_not_fit_the_plan_are_refused(compiled, tmp_path, case):
    dense, cm = compiled
    edit, tensors, match = BAD_TENSORS[case]
    saving.check_tensors(Plan.from_json(_with_predictor(cm.plan.to_json(), 4)).blocks,
                         _predictor(4))  # these fit
    path = tmp_path / "plan"
    saving.save(edit(cm.plan.to_json()), tensors, cm.plan.fingerprint, path)
    with pytest.raises(saving.PlanError, match=match):
        picompile.load(copy.deepcopy(dense), path)


def test_a_damaged_tensor_file_is_refused(compiled, tmp_path):
    dense, cm = compiled
    path = tmp_path / "plan"
    cm.save(path)
    rewrite(path, "tensors.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    with pytest.raises(saving.PlanError, match="safetensors"):
        picompile.load(copy.deepcopy(dense), path)


@pytest.mark.parametrize("field,value", [("d_ff", 64), ("d_model", 16), ("act", "silu"),
                                         ("kind", "plain"), ("module", "model.layers.1.mlp")])
def test_check_blocks_refuses_a_plan_describing_other_blocks(compiled, field, value):
    _, cm = compiled
    saved = [copy.deepcopy(b) for b in cm.plan.blocks]
    saving.check_blocks(cm.plan.blocks, saved)
    setattr(saved[0], field, value)
    with pytest.raises(saving.PlanError, match=field):
        saving.check_blocks(cm.plan.blocks, saved)


def test_a_plan_refused_after_capture_leaves_the_model_as_it_was(tmp_path):
    """load captures the model before it can compare the plan's blocks with it: a plan of other
    blocks is refused with the model put back (GPT-2's Conv1D layers too), and the right plan
    loads onto it afterwards."""
    cm = picompile.compile(zoo.make("gpt2"), quiet=True)
    cm.save(tmp_path / "good")
    data = cm.plan.to_json()
    data["blocks"][0]["linears"]["up"] = "c_fc2"
    saving.save(data, {}, cm.plan.fingerprint, tmp_path / "bad")
    model = zoo.make("gpt2")
    before = list(model.modules())
    with pytest.raises(saving.PlanError, match="linears"):
        picompile.load(model, tmp_path / "bad")
    assert list(model.modules()) == before
    loaded = picompile.load(model, tmp_path / "good")
    ids = torch.randint(0, zoo.VOCAB, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(zoo.logits(loaded, ids), zoo.logits(cm, ids))
