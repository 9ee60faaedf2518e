"""`autopar launch`: the per-node torchrun command and the Slurm script run the worker `autopar
run` runs. Two "nodes" on this machine (two torchruns of 2 CPU ranks, c10d rendezvous on
localhost) train like one process; the Slurm script starts the right torchrun under stub
`srun`/`scontrol`; no model, path or name reaches the shell unquoted; a resumed run on another
plan continues the data where the checkpoint left it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from autopar.cli import DEMO_TEXT, app
from autopar.data import tokenize_file
from autopar.plan import Mesh, Plan, load_plan
from autopar.runtime import RunSpec, TrainConfig, run_job
from autopar.runtime.context import ParallelContext
from autopar.runtime.train import train
from autopar.runtime.worker import parse_args

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
"""Where this Python's torchrun is."""
TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16,tied=0"
LOSS_TOL = 2e-6  # float32 rounding of sharded sums (tests/test_runtime.py)
runner = CliRunner()


def make_plan(model: str = TINY, *, dp: int = 1, tp: int = 1, mbs: int = 8, m: int = 1,
              cluster: str = "cpu-local") -> Plan:
    return Plan(model=model, cluster=cluster, gpus=dp * tp, global_batch=dp * mbs * m, seq_len=16, dtype="fp32",
                mesh=Mesh(dp=dp, tp=tp), micro_batch_size=mbs, num_microbatches=m, stage_layers=(2,),
                recompute=("none",) * 2)


def launch(*args: str | Path) -> Path:
    res = runner.invoke(app, ["launch", *map(str, args)])
    assert res.exit_code == 0, res.output
    return Path(args[args.index("--out") + 1]).absolute()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


STUB = """#!/bin/sh
printf '%s\\0' "$@" > "$RECORD/{name}"
{extra}"""


def stubbed(tmp: Path, **env: str) -> dict[str, str]:
    """An environment whose PATH has stub srun, scontrol (listing nodeA, nodeB) and torchrun,
    each recording its arguments in ``tmp/record/<name>``."""
    bin_dir, record = tmp / "stubs", tmp / "record"
    bin_dir.mkdir(exist_ok=True)
    record.mkdir(exist_ok=True)
    for name, extra in (("srun", ""), ("torchrun", ""), ("scontrol", "printf 'nodeA\\nnodeB\\n'\n")):
        (bin_dir / name).write_text(STUB.format(name=name, extra=extra))
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(tmp), **env}


def recorded(tmp: Path, name: str) -> list[str] | None:
    path = tmp / "record" / name
    return path.read_text().split("\0")[:-1] if path.is_file() else None


def bash(script: Path, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, f"{script}: syntax"
    return subprocess.run(["bash", str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def reference(data: Path, steps: int) -> list[float]:
    """One process, the whole global batch of 8, on the same token file."""
    plan = make_plan()
    return train(plan, steps, ParallelContext(mesh=None, device=torch.device("cpu")), TrainConfig(data=data)).losses


@pytest.mark.slow
def test_two_nodes_train_like_one_process(tmp_path):
    """node.sh, run twice at once (two torchruns of 2 ranks, c10d on localhost), trains dp2 x tp2
    on the tokenized Declaration: rank 0 prints each step and writes losses equal to one process's."""
    data = tokenize_file(DEMO_TEXT, tmp_path / "decl.bin").path
    make_plan(dp=2, tp=2, mbs=2, m=2).save(tmp_path / "plan.json")
    job = launch(tmp_path / "plan.json", "--out", tmp_path / "job", "--nodes", "2", "--gpus-per-node", "2",
                 "--rdzv-endpoint", f"localhost:{free_port()}", "--data", data, "--steps", "2")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))},
           "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(["bash", str(job / "node.sh")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env, cwd=tmp_path) for _ in range(2)]
    try:
        logs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)
    assert sum("step 1: loss" in log for log in logs) == 1  # rank 0 prints, on whichever node it is
    losses = json.loads((job / "result.json").read_text())["runs"][0]["losses"]
    want = reference(data, 2)
    assert len(losses) == 2 and want[1] < want[0]
    for step, (got, ref) in enumerate(zip(losses, want)):
        assert abs(got - ref) <= LOSS_TOL, f"step {step}: {got} vs one process {ref}"


def test_slurm_script_runs_torchrun_once_per_node(tmp_path):
    """sbatch.sh passes `bash -n`; under stub srun/scontrol it asks scontrol for the first node
    and runs torchrun there with c10d rendezvous, the job id, and the worker's arguments, which
    the worker parses into the run launch wrote. node.sh runs the same worker."""
    data = tokenize_file(DEMO_TEXT, tmp_path / "decl.bin").path
    make_plan(dp=16, mbs=1, cluster="dgx-a100-80g").save(tmp_path / "plan.json")
    job = launch(tmp_path / "plan.json", "--out", tmp_path / "job", "--nodes", "2", "--max-restarts", "1",
                 "--steps", "2", "--data", data, "--save", tmp_path / "ck")
    script = (job / "sbatch.sh").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"):
        assert line in script.splitlines()
    run = bash(job / "sbatch.sh", stubbed(tmp_path, SLURM_JOB_NODELIST="nodeA,nodeB", SLURM_JOB_ID="4242"), tmp_path)
    assert run.returncode == 0, run.stderr
    assert recorded(tmp_path, "scontrol") == ["show", "hostnames", "nodeA,nodeB"]
    worker = ["-m", "autopar.runtime.worker", str(job / "plan.json"), "--steps", "2", "--data", str(data),
              "--save", str(tmp_path / "ck"), "--out", str(job / "result.json")]
    assert recorded(tmp_path, "srun") == [
        "--nodes=2", "--ntasks-per-node=1", "torchrun", "--nnodes", "2", "--nproc-per-node", "8",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "nodeA:29500", "--rdzv-id", "4242", "--max-restarts", "1",
        *worker]
    assert parse_args(worker[2:]) == {"runs": [{"plan": str(job / "plan.json"), "steps": 2, "resume": None,
                                                "save": str(tmp_path / "ck"), "save_every": 0}],
                                      "out": str(job / "result.json"), "data": str(data), "trust_code": False}
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script.splitlines()
    assert load_plan(job / "plan.json") == load_plan(tmp_path / "plan.json")

    # Several nodes and no --rdzv-endpoint: node.sh wants $AUTOPAR_RDZV_ENDPOINT, and says so.
    run = bash(job / "node.sh", stubbed(tmp_path), tmp_path)
    assert run.returncode != 0 and "set AUTOPAR_RDZV_ENDPOINT to HOST:PORT" in run.stderr
    assert recorded(tmp_path, "torchrun") is None
    run = bash(job / "node.sh", stubbed(tmp_path, AUTOPAR_RDZV_ENDPOINT="nodeA:1234"), tmp_path)
    assert run.returncode == 0, run.stderr
    args = recorded(tmp_path, "torchrun")
    assert args is not None and args[:8] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                                             "--rdzv-endpoint", "nodeA:1234"]
    assert args[8] == "--rdzv-id" and args[9].startswith("autopar-") and args[10:] == ["--max-restarts", "1", *worker]


@pytest.mark.parametrize("args, fragment", [
    (["--nodes", "3"], "the plan's 4 devices do not split evenly over --nodes 3"),
    (["--nodes", "2", "--gpus-per-node", "4"], "--nodes 2 x --gpus-per-node 4 = 8 devices, but the plan is for 4"),
    (["--rdzv-endpoint", "node 1:29500"], "must be HOST:PORT"),
    (["--rdzv-endpoint", "node1"], "must be HOST:PORT"),
    (["--steps", "0"], "--steps must be at least 1"),
], ids=["nodes", "nodes x gpus", "endpoint space", "endpoint port", "steps"])
def test_bad_launch_is_one_line(tmp_path, args, fragment):
    make_plan(dp=4, mbs=2).save(tmp_path / "plan.json")
    res = runner.invoke(app, ["launch", str(tmp_path / "plan.json"), "--out", str(tmp_path / "job"), *args])
    assert res.exit_code == 2 and fragment in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "job").exists()


def test_names_cannot_inject_shell(tmp_path):
    """A model, plan, data, checkpoint and output directory whose names hold quotes, `$(...)`,
    backticks, `;` and a newline: the scripts, run under stubs, pass each path to torchrun
    verbatim and never run the injected `touch`."""
    evil = "$(touch pwned) `touch pwned`; touch pwned ' \" \\ \n; touch pwned #"
    factory_dir = tmp_path / "models x'; touch pwned; '"  # a model is a real spec: a factory file here
    factory_dir.mkdir()
    (factory_dir / "make.py").write_text((ROOT / "tests" / "fixtures" / "nanogpt" / "make.py").read_text()
                                         .replace("from model import", "import sys; sys.path.insert(0, "
                                                  f"{str(ROOT / 'tests' / 'fixtures' / 'nanogpt')!r}); from model import"))
    model = f"{factory_dir / 'make.py'}:make"
    weird = tmp_path / f"data {evil}"
    weird.mkdir()
    data = tokenize_file(DEMO_TEXT, weird / "t $(touch pwned).bin").path
    plan_file = tmp_path / f"plan {evil}.json"
    make_plan(model, dp=4, mbs=2).save(plan_file)
    out, save, resume = (tmp_path / f"{kind} {evil}" for kind in ("out", "ck", "old"))
    job = launch(plan_file, "--out", out, "--nodes", "2", "--gpus-per-node", "2", "--data", data,
                 "--save", save, "--resume", resume, "--trust-code")  # the plan names a Python file
    assert load_plan(job / "plan.json").model == model
    worker = ["-m", "autopar.runtime.worker", str(out / "plan.json"), "--steps", "3", "--data", str(data),
              "--save", str(save), "--resume", str(resume), "--trust-code", "--out", str(out / "result.json")]
    env = stubbed(tmp_path, SLURM_JOB_NODELIST="nodeA,nodeB", SLURM_JOB_ID="7", AUTOPAR_RDZV_ENDPOINT="h:1")
    for script, stub in (("node.sh", "torchrun"), ("sbatch.sh", "srun")):
        run = bash(out / script, env, tmp_path)
        assert run.returncode == 0, run.stderr
        args = recorded(tmp_path, stub)
        assert args is not None and args[-len(worker):] == worker
    assert not (tmp_path / "pwned").exists()
    assert not any(p.name == "pwned" for p in tmp_path.rglob("*"))
    for script in ("node.sh", "sbatch.sh"):  # nothing of the user's in a comment or an #SBATCH line
        assert all("pwned" not in line for line in (out / script).read_text().splitlines() if line.startswith("#"))


@pytest.mark.slow
def test_resume_continues_the_data_on_another_plan(tmp_path):
    """With a token file: 4 steps on dp2 equal 2 steps on dp2, a checkpoint, and 2 more on tp2
    resumed from it (the checkpoint's data position, not the first batch again)."""
    data = tokenize_file(DEMO_TEXT, tmp_path / "decl.bin").path
    dp2, tp2 = make_plan(dp=2, mbs=2, m=2), make_plan(tp=2, mbs=4, m=2)
    whole, first, rest = run_job([RunSpec(plan=dp2, steps=4), RunSpec(plan=dp2, steps=2, save=tmp_path / "ck"),
                                  RunSpec(plan=tp2, steps=2, resume=tmp_path / "ck")],
                                 workdir=tmp_path / "job", cfg=TrainConfig(data=data), timeout_s=300)
    assert rest.start_step == 2
    assert first.losses == pytest.approx(whole.losses[:2], abs=LOSS_TOL)
    assert rest.losses == pytest.approx(whole.losses[2:], abs=LOSS_TOL)
    assert whole.losses == pytest.approx(reference(data, 4), abs=LOSS_TOL)
