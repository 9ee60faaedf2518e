"""The scripts that train a plan on a cluster (``autopar launch``): torchrun per node, Slurm, run.md.

Each script starts the entry point ``autopar run`` uses, ``python -m autopar.runtime.worker
PLAN.json --steps K [--data FILE] [--save DIR [--save-every K]] [--resume DIR] [--trust-code]
--out DIR/result.json``, under
torchrun with c10d rendezvous (``--nnodes N --nproc-per-node G --rdzv-backend c10d
--rdzv-endpoint HOST:PORT --rdzv-id ID --max-restarts R``): ``node.sh`` is the command every
node runs (the rendezvous gives each node its ranks; the node whose address is the endpoint
hosts it), ``sbatch.sh`` runs it on every node of a Slurm allocation with ``srun``, the first
node of ``$SLURM_JOB_NODELIST`` hosting the rendezvous. Paths are written absolute: the nodes
must see them at the same place (a shared file system).

Every word that comes from the user (paths, the endpoint) is quoted with ``shlex.quote``, and
none is written into a comment or an ``#SBATCH`` line, so no name can run a command of its own.
Nothing here imports torch: scripts can be written where torch is not installed.
"""

from __future__ import annotations

import os
import shlex
import uuid
from dataclasses import dataclass
from pathlib import Path

from autopar.checkpoint_dir import resolve
from autopar.data import open_corpus
from autopar.errors import UserError
from autopar.plan import Plan

DEFAULT_PORT = 29500
"""torchrun's default rendezvous port."""
ENDPOINT_VAR = "AUTOPAR_RDZV_ENDPOINT"
"""Where ``node.sh`` reads HOST:PORT when ``--rdzv-endpoint`` was not given for several nodes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """What ``autopar launch`` writes, every default resolved."""

    plan: Plan
    out: Path
    """The directory the scripts, the plan's copy and the run's result go to (absolute)."""
    nodes: int
    gpus_per_node: int
    endpoint: str | None
    """HOST:PORT of the rendezvous in ``node.sh``; None: read from ``$AUTOPAR_RDZV_ENDPOINT``."""
    port: int
    """The rendezvous port on the first node of a Slurm allocation."""
    rdzv_id: str
    max_restarts: int
    steps: int
    data: Path | None = None
    save: Path | None = None
    save_every: int = 0
    """Checkpoint every this many steps too (0: after the last step only)."""
    resume: Path | None = None
    trust_code: bool = False
    """The worker may import the plan's Python file and load a checkpoint without a manifest."""
    gpus: bool = True
    """Ask Slurm for GPUs (``--gpus-per-node``); False for a CPU (gloo) cluster profile."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as (host, port); anything else is a ``UserError``."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in text):
        raise UserError(f"--rdzv-endpoint {text!r} must be HOST:PORT, e.g. node001:{DEFAULT_PORT}")
    return host, int(port)


def _absolute(path: Path | None) -> Path | None:
    return None if path is None else Path(os.path.abspath(path))


def plan_launch(plan: Plan, out: Path, *, nodes: int | None = None, gpus_per_node: int | None = None,
                endpoint: str | None = None, max_restarts: int = 0, steps: int = 3, data: Path | None = None,
                save: Path | None = None, resume: Path | None = None, rdzv_id: str | None = None,
                save_every: int = 0, trust_code: bool = False) -> Launch:
    """Resolve ``autopar launch``'s options for ``plan``: devices per node default to the
    cluster profile's (at most the plan's), nodes to the rest; nodes x devices per node must
    be the plan's device count."""
    from cost_models import ProfileError, load_profile
    try:
        profile = load_profile(plan.cluster)
        per_node, gpus = profile.devices_per_node, profile.launcher != "gloo"
    except ProfileError:
        per_node, gpus = None, True
    for name, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--steps", steps)):
        if value is not None and value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    if max_restarts < 0:
        raise UserError(f"--max-restarts must be at least 0, got {max_restarts}")
    if save_every < 0:
        raise UserError(f"--save-every must be at least 0, got {save_every}")
    if gpus_per_node is None:
        if nodes is not None:
            if plan.gpus % nodes:
                raise UserError(f"the plan's {plan.gpus} devices do not split evenly over --nodes {nodes}")
            gpus_per_node = plan.gpus // nodes
        elif per_node is not None:
            gpus_per_node = min(per_node, plan.gpus)
        else:
            raise UserError(f"cluster profile {plan.cluster!r} is not readable here; give --gpus-per-node")
    if nodes is None:
        nodes = max(1, plan.gpus // gpus_per_node)
    if nodes * gpus_per_node != plan.gpus:
        raise UserError(f"--nodes {nodes} x --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} devices, "
                        f"but the plan is for {plan.gpus}; launch it on nodes x devices per node = {plan.gpus}")
    port = DEFAULT_PORT
    if endpoint is not None:
        port = parse_endpoint(endpoint)[1]
    elif nodes == 1:
        endpoint = f"localhost:{DEFAULT_PORT}"
    return Launch(plan=plan, out=Path(os.path.abspath(out)), nodes=nodes, gpus_per_node=gpus_per_node,
                  endpoint=endpoint, port=port, rdzv_id=rdzv_id or f"autopar-{uuid.uuid4().hex[:12]}",
                  max_restarts=max_restarts, steps=steps, data=_absolute(data), save=_absolute(save),
                  resume=_absolute(resume), gpus=gpus, save_every=save_every, trust_code=trust_code)


def local_notes(launch: Launch) -> list[str]:
    """Check the data and the checkpoint to resume from where they are on this machine (a
    ``UserError`` if one is not what it should be); one note for each that is not here."""
    notes = []
    if launch.data is not None:
        if launch.data.exists():
            open_corpus(launch.data, launch.plan.seq_len)
        else:
            notes.append(f"--data {launch.data} is not on this machine: the nodes must see it there")
    if launch.resume is not None:
        if launch.resume.exists():  # its checksums are verified by the run's rank 0
            resolve(launch.resume, trust_code=launch.trust_code, check=False)
        else:
            notes.append(f"--resume {launch.resume} is not on this machine: the nodes must see it there")
    return notes


def worker_argv(launch: Launch) -> list[str]:
    """The worker's module and arguments, after torchrun's options (unquoted)."""
    argv = ["-m", "autopar.runtime.worker", str(launch.out / "plan.json"), "--steps", str(launch.steps)]
    for flag, path in (("--data", launch.data), ("--save", launch.save), ("--resume", launch.resume)):
        if path is not None:
            argv += [flag, str(path)]
    if launch.save is not None and launch.save_every:
        argv += ["--save-every", str(launch.save_every)]
    if launch.trust_code:
        argv.append("--trust-code")
    return argv + ["--out", str(launch.out / "result.json")]


def _torchrun_lines(launch: Launch, endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun's options, one pair a line, then the worker; ``endpoint`` and ``rdzv_id`` are
    shell words already (a quoted value or a variable)."""
    q = shlex.quote
    return [f"--nnodes {launch.nodes}", f"--nproc-per-node {launch.gpus_per_node}", "--rdzv-backend c10d",
            f"--rdzv-endpoint {endpoint}", f"--rdzv-id {rdzv_id}", f"--max-restarts {launch.max_restarts}",
            " ".join(map(q, worker_argv(launch)))]


_RESTART_STORE = ("# torch 2.13 keeps one TCPStore across restarts, where gloo would find the killed attempt's\n"
                  "# addresses: each rendezvous round gets its own store.\n"
                  "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n")


def _continued(first: str, lines: list[str]) -> str:
    return " \\\n    ".join([first, *lines]) + "\n"


def node_script(launch: Launch) -> str:
    """``node.sh``: the torchrun command each node runs."""
    q = shlex.quote
    if launch.endpoint is not None:
        endpoint = q(launch.endpoint)
        where = "the node whose address the endpoint names hosts it"
    else:
        endpoint = f'"${{{ENDPOINT_VAR}:?set {ENDPOINT_VAR} to HOST:PORT, the rendezvous on the first node}}"'
        where = f"${ENDPOINT_VAR} names it, HOST:PORT on the first node"
    return ("#!/usr/bin/env bash\n"
            f"# Written by `autopar launch` (see run.md). Run on each of the {launch.nodes} node(s): starts\n"
            f"# {launch.gpus_per_node} worker(s) here; the c10d rendezvous gives each node its ranks;\n"
            f"# {where}.\n"
            "set -eu\n"
            f"{_RESTART_STORE}"
            + _continued("exec torchrun", _torchrun_lines(launch, endpoint, q(launch.rdzv_id))))


def sbatch_script(launch: Launch) -> str:
    """``sbatch.sh``: one task per node runs torchrun; the allocation's first node hosts the
    rendezvous, the job id is its id."""
    gpus = f"#SBATCH --gpus-per-node={launch.gpus_per_node}\n" if launch.gpus else ""
    return ("#!/usr/bin/env bash\n"
            "#SBATCH --job-name=autopar\n"
            f"#SBATCH --nodes={launch.nodes}\n"
            "#SBATCH --ntasks-per-node=1\n"
            f"{gpus}"
            "#SBATCH --exclusive\n"
            "# Written by `autopar launch` (see run.md): submit with sbatch. srun starts torchrun once per\n"
            f"# node, which starts {launch.gpus_per_node} worker(s); the first node hosts the rendezvous.\n"
            "set -eu\n"
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)\n'
            ': "${head_node:?no host in SLURM_JOB_NODELIST}"\n'
            f"{_RESTART_STORE}"
            + _continued(f"srun --nodes={launch.nodes} --ntasks-per-node=1 torchrun",
                         _torchrun_lines(launch, f'"$head_node:{launch.port}"', '"$SLURM_JOB_ID"')))


def run_md(launch: Launch) -> str:
    """``run.md``: what to run where."""
    q, m = shlex.quote, launch.plan.mesh
    out = launch.out
    if launch.endpoint is not None:
        host = parse_endpoint(launch.endpoint)[0]
        rendezvous = (f"The rendezvous is `{launch.endpoint}`: the node called `{host}` hosts it, so one of the "
                      "nodes must be that one; the others join it, in any order.")
    else:
        rendezvous = (f"Set `{ENDPOINT_VAR}=HOST:PORT` on every node first, HOST the first node (it hosts the "
                      f"rendezvous), PORT a free port, e.g. `export {ENDPOINT_VAR}=node001:{DEFAULT_PORT}` "
                      "(or re-run `autopar launch` with `--rdzv-endpoint`).")
    data = f"the token file {q(str(launch.data))}" if launch.data else "synthetic tokens"
    lines = [
        "# Launch", "",
        f"Plan `{out / 'plan.json'}`: {launch.plan.gpus} devices as dp={m.dp} tp={m.tp} pp={m.pp}, on "
        f"{launch.nodes} node(s) x {launch.gpus_per_node}; {launch.steps} step(s) on {data}.",
        "",
        "Every node needs this directory, the plan's data and checkpoints at the same absolute paths (a shared "
        "file system), and `torchrun` on its PATH from a Python environment with autopar and torch installed.",
        "", "## Slurm", "",
        "From a shell where `torchrun` runs this autopar (sbatch passes the environment on):", "",
        f"    sbatch {q(str(out / 'sbatch.sh'))}", "",
        f"It asks for {launch.nodes} whole node(s), one task each; that task runs torchrun, which starts "
        f"{launch.gpus_per_node} worker(s). Add `#SBATCH` lines your site needs (partition, account, time, "
        "`--cpus-per-task` if it binds a task to one core).",
        "", "## Each node by hand", "",
        f"On each of the {launch.nodes} node(s), at about the same time:", "",
        f"    bash {q(str(out / 'node.sh'))}", "",
        rendezvous, "",
        "## Output", "",
        "Rank 0 prints each step's loss; at the end it writes the losses and step times to "
        f"`{out / 'result.json'}`. A rank that fails prints one line `autopar: rank R: ...` and writes its "
        f"traceback to `{out}/rank<R>.err`.",
    ]
    if launch.save is not None:
        every = f" and every {launch.save_every} steps" if launch.save_every else ""
        lines.append(f"After the last step{every} the run saves a checkpoint into `{launch.save}` (`step-N` "
                     "directories, `latest` naming the last complete one; any plan of the model resumes from it: "
                     "`autopar run` or `autopar launch` with `--resume`).")
    if launch.resume is not None:
        lines.append(f"The run starts from the checkpoint `{launch.resume}`, with its data position.")
    if launch.max_restarts:
        again = ("from the latest checkpoint the run saved in --save (else from its start)" if launch.save
                 else "from its start: add --save DIR --save-every K to keep the progress")
        lines.append(f"torchrun restarts the workers up to {launch.max_restarts} time(s) after a failure; each "
                     f"restart resumes {again}.")
    return "\n".join(lines) + "\n"


def write_launch(launch: Launch) -> list[Path]:
    """Write ``plan.json``, ``node.sh``, ``sbatch.sh`` and ``run.md`` into ``launch.out``;
    returns their paths."""
    if launch.out.exists() and not launch.out.is_dir():
        raise UserError(f"--out {launch.out} is a file; give a directory")
    launch.out.mkdir(parents=True, exist_ok=True)
    files = {"plan.json": launch.plan.to_json(), "node.sh": node_script(launch),
             "sbatch.sh": sbatch_script(launch), "run.md": run_md(launch)}
    paths = []
    for name, text in files.items():
        path = launch.out / name
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
        paths.append(path)
    return paths
