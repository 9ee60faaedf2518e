"""The command line's checks of its own options, run before any work starts (a bad path or
size costs no search and leaves no file): one ``UserError`` line each, naming the fix."""

from __future__ import annotations

import os
from pathlib import Path

from autopar.errors import UserError
from autopar.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_LAYERS, check_count
from autopar.plan import AXES


def parse_axis_order(text: str | None) -> tuple[str, ...] | None:
    """``--axis-order pp,dp,tp`` as a tuple; a wrong list is a one-line error."""
    if text is None:
        return None
    order = tuple(a.strip() for a in text.split(","))
    if sorted(order) != sorted(AXES):
        raise UserError(f"--axis-order {text!r} must list {', '.join(AXES)} once each, outermost first")
    return order


def check_pins(**pins: int | None) -> None:
    """Pinned degrees and sizes: positive and within autopar's limits (``--mbs 0`` is refused,
    not searched)."""
    limits = {"mbs": MAX_GLOBAL_BATCH, "vpp": MAX_LAYERS}
    for name, value in pins.items():
        if value is not None:
            check_count(f"--{name}", value, limits.get(name, MAX_GPUS))


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


def check_save(save: Path | None, resume: Path | None) -> None:
    """``--save DIR``: a new directory or an earlier checkpoint, never a file or a folder of other
    files; ``--resume DIR``: a checkpoint. Checked before the run starts."""
    try:
        if resume is not None and not (resume / ".metadata").is_file():
            raise UserError(f"--resume {resume} is not a checkpoint (no .metadata); write one with "
                            "`autopar run --save DIR`")
        if save is None:
            return
        if save.exists() and not save.is_dir():
            raise UserError(f"--save {save} is an existing file; a checkpoint is a directory: give a new "
                            "directory path")
        if save.is_dir():
            if any(save.iterdir()) and not (save / ".metadata").is_file():
                raise UserError(f"--save {save} holds files that are not a checkpoint; give a new or empty directory")
            _writable_dir(save, "--save", save)
        else:
            _writable_dir(save.parent, "--save", save)
    except OSError as exc:
        raise UserError(f"--save/--resume: {exc.strerror or exc}") from None
