"""The runtime trains a user's own module (``path/to/file.py:factory``) — karpathy's nanoGPT and
minGPT, unmodified — under DP (DDP, FSDP2 ZeRO-1/2/3), TP with SP, and PP, exactly like one
process: the same losses and final weights, with ``tests/test_runtime.py``'s tolerances
(losses within 2e-6, weights within 1e-4 after 3 AdamW steps).

nanoGPT: SDPA attention, a packed Q/K/V projection cut with ``.split(n_embd)``, widths read off
its input (``B, T, C = x.size()``), a head tied to the embedding. minGPT: attention written out
with a causal-mask buffer, an MLP called through a lambda, an untied head. One torchrun job
runs every 4-process plan.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from autopar.cli import app
from autopar.runtime.context import ParallelContext, check_plan
from autopar.runtime.train import build_program, synthetic_batch
from test_runtime import STEPS, _assert_parity, _run, make_plan, reference

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NANO = f"{FIXTURES / 'nanogpt' / 'make.py'}:make"
MINI = f"{FIXTURES / 'mingpt' / 'make.py'}:make"

# name -> plan (global batch 8, like the reference's).
PLANS_4 = {
    "nanogpt fsdp zero3": make_plan(NANO, dp=4, zero=3, mbs=1, m=2),
    "nanogpt tp2 sp x dp2 zero1 selective": make_plan(NANO, tp=2, dp=2, sp=True, zero=1, mbs=2, m=2,
                                                      recompute="selective"),
    "nanogpt tied pp2 x tp2 sp": make_plan(NANO, pp=2, tp=2, sp=True, mbs=2, m=4, layers=(1, 3)),
    "mingpt ddp": make_plan(MINI, dp=4, mbs=1, m=2),
    "mingpt tp2 sp x dp2 zero3": make_plan(MINI, tp=2, dp=2, sp=True, zero=3, mbs=2, m=2),
    "mingpt pp2 interleaved v2 x dp2 zero2 full recompute": make_plan(
        MINI, pp=2, dp=2, zero=2, mbs=1, m=4, schedule="interleaved", v=2, recompute="full"),
}
ONE = ParallelContext(mesh=None, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def references():
    return {m: reference(m) for m in (NANO, MINI)}


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    return _run(PLANS_4, tmp_path_factory.mktemp("user4"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS_4))
def test_parity_world_4(name, runs_4, references):
    _assert_parity(name, PLANS_4[name], runs_4[name], references)


@pytest.mark.parametrize("model", [NANO, MINI])
def test_stage_logits_are_the_model_forward(model):
    """The runtime's stage runs the model's own forward and stops at the head: the logits of
    every position and the loss equal what the model returns given targets."""
    plan = make_plan(model, mbs=8, m=1)
    (stage,) = build_program(plan, ONE).modules
    x, y = synthetic_batch(plan, 0, 0)
    logits = stage(x)
    del stage.forward  # the class's own forward again
    own_logits, own_loss = stage(x, y.contiguous())
    assert logits.shape == (8, 16, 128)
    assert torch.equal(logits, own_logits)
    assert torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item() == pytest.approx(
        own_loss.item(), abs=1e-6)


def test_buffers_hold_the_factory_values():
    """minGPT's causal mask is a buffer: computed by the factory, not left uninitialised."""
    (stage,) = build_program(make_plan(MINI, mbs=8, m=1), ONE).modules
    buffers = dict(stage.named_buffers())
    assert len(buffers) == 4
    for buf in buffers.values():
        assert torch.equal(buf, torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))


def test_selective_recompute_checkpoints_the_sdpa_call():
    """nanoGPT calls SDPA: selective recompute keeps fewer activations than none and more than
    full. minGPT writes attention out op by op: refused before anything runs, naming the fix."""
    x, _ = synthetic_batch(make_plan(NANO, mbs=8, m=1), 0, 0)
    kept = {}
    for mode in ("none", "selective", "full"):
        (module,) = build_program(make_plan(NANO, mbs=8, m=1, recompute=mode), ONE).modules
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        kept[mode] = sum(seen.values())
    assert kept["full"] < kept["selective"] < kept["none"]
    with pytest.raises(ValueError, match="written out op by op; use --recompute none or full") as err:
        check_plan(make_plan(MINI, mbs=8, m=1, recompute="selective"))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_autopar_plan_then_run(tmp_path, references):
    """``autopar plan`` on the factory file, then ``autopar run --trust-code`` on the plan file:
    the losses are one process's (without the flag, run and explain refuse the plan file)."""
    runner = CliRunner()
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "--model", NANO, "--cluster", "cpu-local", "--gpus", "2",
                              "--global-batch", "8", "--dtype", "fp32", "--tp", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["mesh"]["tp"] == 2
    for command in ("run", "explain"):  # the plan file names a Python file: running it takes --trust-code
        res = runner.invoke(app, [command, str(out)])
        assert res.exit_code == 2 and "pass --trust-code" in res.stderr, res.output
    res = runner.invoke(app, ["run", str(out), "--steps", str(STEPS), "--json", "--trust-code"])
    assert res.exit_code == 0, res.output
    losses = json.loads(res.stdout.strip().splitlines()[-1])["losses"]
    assert losses == pytest.approx(references[NANO][0].losses, abs=2e-6)


@pytest.mark.slow
def test_verify_proves_the_user_module_itself(tmp_path, monkeypatch):
    """A factory cannot be resized: ``autopar verify``'s twin of a user module is the module at
    its own size (all 4 blocks, 16 tokens). minGPT's written-out attention fails the selective
    check with the runtime's one-line reason, which the planner then leaves out."""
    from autopar.spec import parse_model_spec
    from autopar.verify import Check, check_plan as twin_plan, twin_spec_text, verify
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    assert twin_spec_text(parse_model_spec(MINI)) == MINI
    assert twin_plan(MINI, Check.PP).stage_layers == (2, 2) and twin_plan(MINI, None).seq_len == 16
    (verdict,) = verify(MINI, checks=(Check.SELECTIVE,)).verdicts
    assert not verdict.ok and "written out op by op" in verdict.reason and "\n" not in verdict.reason
