"""The command line's checks of its own options, run before any work starts (a bad path or
size costs no search and leaves no file): one ``UserError`` line each, naming the fix."""

from __future__ import annotations

import os
from pathlib import Path

from autopar.errors import UserError
from autopar.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_LAYERS, check_count
from cost_models.axes import Axis, parse_order
from cost_models.recipe import DEFAULT_RECIPE, RecipeError, load_recipe


def parse_axis_order(text: str | None) -> tuple[Axis, ...] | None:
    """``--axis-order pp,dp,tp`` as an axis order; a wrong list is a one-line error."""
    if text is None:
        return None
    try:
        return parse_order(a.strip() for a in text.split(","))
    except ValueError as exc:
        raise UserError(f"--axis-order {text!r} {exc}") from None


def check_pins(**pins: int | None) -> None:
    """Pinned degrees and sizes: positive and within autopar's limits (``--mbs 0`` is refused,
    not searched)."""
    limits = {"mbs": MAX_GLOBAL_BATCH, "vpp": MAX_LAYERS}
    for name, value in pins.items():
        if value is not None:
            check_count(f"--{name}", value, limits.get(name, MAX_GPUS))


def check_cp(cp: int | None, recipe: str | None) -> None:
    """``--cp`` above 1 only under a recipe whose program has context parallelism (checked
    before any tracing; an unreadable recipe is reported where the job is read)."""
    if cp is None or cp <= 1:
        return
    try:
        rec = load_recipe(recipe or DEFAULT_RECIPE)
    except RecipeError:
        return
    if not rec.has_context_parallel:
        raise UserError(f"--cp {cp}: the {rec.name} recipe has no context parallelism; plan with --recipe autopar "
                        "(all-gathered K,V) or megatron-core (ring attention), or drop --cp")


def _writable_dir(directory: Path, option: str, target: Path) -> None:
    """``directory`` exists and a file can be created in it (tried, then removed)."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{option} {target}: {directory} is not a directory; give a path in a directory")
    if not directory.is_dir():
        raise UserError(f"{option} {target}: directory {directory} does not exist; create it first")
    probe = directory / f".autopar-probe-{os.getpid()}"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{option} {target}: cannot write in {directory} ({exc.strerror or exc}); "
                        "choose a writable directory") from None


def check_out(out: Path | None) -> None:
    """``--out FILE``: a file path (new or to replace) in a writable directory; checked before
    the search starts, so a bad path costs no search and leaves no file."""
    if out is None:
        return
    try:
        if out.is_dir():
            raise UserError(f"--out {out} is a directory; give a file path, e.g. {out / 'plan.json'}")
        _writable_dir(out.parent, "--out", out)
    except OSError as exc:  # a name the OS refuses (too long ...)
        raise UserError(f"--out {out}: {exc.strerror or exc}") from None


def check_save(save: Path | None, resume: Path | None, *, trust_code: bool = False, save_every: int = 0,
               verify: bool = True) -> None:
    """``--save DIR``: a new or empty directory, or one autopar saved checkpoints into, never a
    file or a folder of other files; ``--save-every K``: K >= 0, with ``--save``; ``--resume``:
    a checkpoint or such a directory, its checksums verified (``verify``) and, without autopar's
    manifest, only with ``--trust-code``. Checked before the run starts."""
    from autopar.checkpoint_dir import is_store, resolve
    if save_every < 0:
        raise UserError(f"--save-every must be at least 0, got {save_every}")
    if save_every and save is None:
        raise UserError(f"--save-every {save_every} saves into --save DIR; add --save DIR")
    try:
        if resume is not None and resume.exists():
            resolve(resume, trust_code=trust_code, check=verify)
        elif resume is not None and verify:
            raise UserError(f"--resume {resume} does not exist; give a checkpoint written by `autopar run --save DIR`")
        if save is None:
            return
        if save.exists() and not save.is_dir():
            raise UserError(f"--save {save} is an existing file; checkpoints go into a directory: give a new "
                            "directory path")
        if save.is_dir():
            if any(save.iterdir()) and not is_store(save):
                raise UserError(f"--save {save} holds files that are not a checkpoint store of autopar's "
                                "(step-N directories, latest); give a new or empty directory")
            _writable_dir(save, "--save", save)
        else:
            _writable_dir(save.parent, "--save", save)
    except OSError as exc:
        raise UserError(f"--save/--resume: {exc.strerror or exc}") from None


def load_plan_file(path: Path, trust_code: bool):
    """``load_plan``, refusing a plan that names a Python file unless ``--trust-code``."""
    from autopar.plan import load_plan, refuse_code
    plan = load_plan(path)
    if not trust_code:
        refuse_code(plan, path)
    return plan
