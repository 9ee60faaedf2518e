"""Checkpoints that never lose training (``autopar.checkpoint_dir``, ``runtime.checkpoint``),
in one process (DCP without a process group): the store keeps the last two complete
checkpoints, a save cut short leaves the previous one as the latest, a changed byte or a
crafted pickle is one line naming the file, another model's checkpoint is refused.
The multi-process halves (a SIGKILLed rank, torchrun's restart) are in ``test_elastic.py``."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from autopar import checkpoint_dir as cd
from autopar.errors import UserError
from autopar.plan import Mesh, Plan
from autopar.runtime import checkpoint
from autopar.runtime.context import ParallelContext
from autopar.runtime.state import full_state
from autopar.runtime.train import build_program, train

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,tied=0"
OTHER = "gpt:layers=2,hidden=48,heads=2,vocab=64,seq=8,tied=0"


def _program(model: str = GPT):
    plan = Plan(model=model, cluster="cpu-local", gpus=1, global_batch=4, seq_len=8, dtype="fp32", mesh=Mesh(),
                micro_batch_size=4, num_microbatches=1, stage_layers=(2,), recompute=("none",) * 2)
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    return plan, ctx, build_program(plan, ctx)


@pytest.fixture()
def store(tmp_path):
    """A store with checkpoints after steps 2 and 4 (saved every 2 steps) and the weights at each."""
    plan, ctx, prog = _program()
    weights = {}
    for step in (2, 4):
        train(plan, 2, ctx, program=prog, start_step=step - 2)
        checkpoint.save(prog, tmp_path / "ck", step, step * plan.global_batch,
                        cd.RunRecord(run_id="r", start_step=0, end_step=4, losses=(1.0,) * step))
        weights[step] = full_state(prog)
    return tmp_path / "ck", weights


def _loaded(found: cd.Found) -> tuple[checkpoint.Position, dict]:
    _, _, prog = _program()
    where = checkpoint.load(prog, found)
    return where, full_state(prog)


def test_store_keeps_the_last_two_and_latest_names_the_newest(store):
    ck, weights = store
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    assert (ck / "latest").read_text().strip() == "step-00000004"
    manifest = cd.verify(ck / "step-00000004")
    assert manifest.step == 4 and manifest.samples == 16 and manifest.run.losses == (1.0,) * 4
    assert set(manifest.files) == {".metadata", "__0_0.distcp"}
    # --resume accepts the store (its latest) or a checkpoint in it
    for path, step in ((ck, 4), (ck / "step-00000002", 2)):
        where, state = _loaded(cd.resolve(path, trust_code=False))
        assert where == checkpoint.Position(step=step, samples=4 * step)
        assert all(torch.equal(state[k], v) for k, v in weights[step].items())
    _, _, prog = _program()
    checkpoint.save(prog, ck, 6, 24)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000004", "step-00000006"]


def test_a_save_cut_short_leaves_the_previous_checkpoint(store):
    """A save killed after its shards were written (no manifest, not renamed; or renamed but
    ``latest`` not yet replaced) leaves the last complete checkpoint loadable as the latest."""
    ck, weights = store
    _, _, prog = _program()
    tmp = ck / ".tmp-step-00000006"
    dcp.save({"model": {"x": torch.ones(2)}}, checkpoint_id=str(tmp))  # shards, then the process died
    assert cd.resolve(ck, trust_code=False).path == ck / "step-00000004"
    (ck / "latest").write_text("step-00000009\n")  # names a checkpoint that never completed
    assert cd.resolve(ck, trust_code=False).path == ck / "step-00000004"
    where, state = _loaded(cd.resolve(ck, trust_code=False))
    assert where.step == 4 and all(torch.equal(state[k], v) for k, v in weights[4].items())
    checkpoint.save(prog, ck, 6, 24)  # the next save clears the debris
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000004", "step-00000006"]


def test_a_flipped_byte_is_one_line_naming_the_file(store):
    ck, _ = store
    shard = ck / "step-00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"__0_0.distcp does not match its sha256") as err:
        cd.resolve(ck, trust_code=True)
    assert "\n" not in str(err.value) and "step-00000004" in str(err.value)
    (ck / "step-00000002" / "extra.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="extra.bin is not in its manifest.json"):
        cd.resolve(ck / "step-00000002", trust_code=False)


def test_another_models_checkpoint_is_refused(store):
    ck, _ = store
    _, _, other = _program(OTHER)
    with pytest.raises(UserError, match=r"is not of this plan's model .*: .* is \[.*\] there, \[.*\] here") as err:
        checkpoint.load(other, cd.resolve(ck, trust_code=False))
    assert "\n" not in str(err.value)


def test_a_checkpoint_without_manifest_takes_trust_code(tmp_path, store):
    """Plain DCP (not autopar's): its .metadata is a pickle, loaded only with --trust-code."""
    ck, weights = store
    raw = tmp_path / "raw"
    shutil.copytree(ck / "step-00000004", raw)
    (raw / "manifest.json").unlink()
    with pytest.raises(UserError, match="has no manifest.json .* pass --trust-code"):
        cd.resolve(raw, trust_code=False)
    where, state = _loaded(cd.resolve(raw, trust_code=True))
    assert where.step == 4 and all(torch.equal(state[k], v) for k, v in weights[4].items())


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_an_autopar_checkpoint_runs_no_code(tmp_path, store, monkeypatch):
    """A .metadata crafted to call a function, with a manifest that matches it: refused, named,
    and nothing ran (the metadata is read with an allow-list of DCP's classes)."""
    ck, _ = store
    monkeypatch.chdir(tmp_path)
    bad = ck / "step-00000004"
    (bad / ".metadata").write_bytes(pickle.dumps(_Boom()))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"][".metadata"] = cd.sha256(bad / ".metadata")
    (bad / "manifest.json").write_text(json.dumps(manifest))
    _, _, prog = _program()
    with pytest.raises(UserError, match="names posix.system, which is not DCP metadata") as err:
        checkpoint.load(prog, cd.resolve(ck, trust_code=False))
    assert "\n" not in str(err.value)
    assert not Path("pwned").exists()
