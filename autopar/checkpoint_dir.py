"""Checkpoint directories on disk: layout, manifest, checksums, atomic publication (no torch).

``--save DIR`` makes DIR a *checkpoint store*::

    DIR/step-00000008/       a complete checkpoint: DCP's files + manifest.json (written last)
    DIR/step-00000006/       the one before, kept until a newer one is complete
    DIR/latest               the name of the last complete checkpoint ("step-00000008")
    DIR/.tmp-step-00000010/  a checkpoint being written (ignored; removed by the next save)

A checkpoint is written into ``.tmp-step-N``; after every rank's shards are on disk (a
barrier), rank 0 hashes every file into ``manifest.json``, renames the directory to
``step-N`` (one ``rename``: atomic on a POSIX file system) and replaces ``latest`` (written
beside, then ``os.replace``). Only then are older checkpoints pruned (the last ``KEEP`` stay).
A process killed at any point leaves the previous complete checkpoint and ``latest`` naming it.

``manifest.json`` (``FORMAT``) holds the sha256 of every other file, the step and data
position, the run that wrote it (torchrun's run id, its first and last step) and the losses of
the steps before it. Loading verifies every checksum first: a changed byte is one error line
naming the file. A directory of DCP files without a manifest was not written by autopar (or
by an autopar before manifests): its ``.metadata`` is a Python pickle, so it loads only with
``--trust-code`` (README, *What is code*).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from autopar.errors import UserError

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "autopar-checkpoint/1"
KEEP = 2
"""Complete checkpoints kept in a store: the newest and the one before it."""
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
DCP_METADATA = ".metadata"
MAX_MANIFEST_BYTES = 64 * 2**20
"""A manifest lists files and losses: far below this."""
_CHUNK_BYTES = 2**20


def step_name(step: int) -> str:
    """The directory name of the checkpoint after ``step`` optimizer steps."""
    return f"{PREFIX}{step:08d}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunRecord:
    """The run a checkpoint belongs to and the losses before it, for an exact restart."""

    run_id: str | None = None
    """torchrun's run id (``TORCHELASTIC_RUN_ID``; Slurm: the job id): a restarted worker
    resumes only from a checkpoint its own run wrote."""
    start_step: int = 0
    """The step the run began at."""
    end_step: int = 0
    """The step the run stops after (start + --steps)."""
    first_step: int = 0
    """The step of ``losses[0]``."""
    losses: tuple[float, ...] = ()
    """Global-batch mean loss of each step from ``first_step`` up to the checkpoint."""
    step_times_s: tuple[float, ...] = ()
    """Wall time of each of those steps, s."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """What ``manifest.json`` says about its checkpoint."""

    step: int
    """Optimizer steps taken."""
    samples: int
    """Training sequences drawn from the data (``autopar.data``)."""
    model: str
    """The plan's model spec (for messages; shapes are checked against DCP's metadata)."""
    files: dict[str, str] = field(default_factory=dict)
    """sha256 (hex) of every other file, by name relative to the checkpoint."""
    run: RunRecord = RunRecord()

    def to_json(self) -> str:
        r = self.run
        return json.dumps({"format": FORMAT, "step": self.step, "samples": self.samples, "model": self.model,
                           "run": {"id": r.run_id, "start_step": r.start_step, "end_step": r.end_step,
                                   "first_step": r.first_step, "losses": list(r.losses),
                                   "step_times_s": list(r.step_times_s)},
                           "files": self.files}, indent=1, sort_keys=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """A checkpoint to load: its directory and manifest (None: not autopar's, loaded on trust)."""

    path: Path
    manifest: Manifest | None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, as sorted relative POSIX names."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part (write beside, fsync, replace)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _as_int(data: dict, key: str, where: Path) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UserError(f"{where}: {key} must be a non-negative integer; the checkpoint is damaged, resume "
                        "from an earlier one")
    return value


def read_manifest(directory: Path) -> Manifest:
    """The checkpoint's manifest (``UserError`` if it is not one autopar wrote)."""
    path = directory / MANIFEST
    try:
        raw = path.read_bytes() if path.stat().st_size <= MAX_MANIFEST_BYTES else b""
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is not readable JSON ({' '.join(str(exc).split())[:120]}); the checkpoint "
                        "is damaged, resume from an earlier one") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path} is not an autopar manifest ({FORMAT}); resume from a checkpoint autopar wrote")
    files, run = data.get("files"), data.get("run") or {}
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise UserError(f"{path}: files must map names to sha256 digests; the checkpoint is damaged")
    if not isinstance(run, dict):
        raise UserError(f"{path}: run must be an object; the checkpoint is damaged")
    losses, times = run.get("losses") or [], run.get("step_times_s") or []
    if not all(isinstance(x, (int, float)) for x in (*losses, *times)):
        raise UserError(f"{path}: losses must be numbers; the checkpoint is damaged")
    run_id = run.get("id")
    return Manifest(step=_as_int(data, "step", path), samples=_as_int(data, "samples", path),
                    model=str(data.get("model", "")), files=files,
                    run=RunRecord(run_id=run_id if isinstance(run_id, str) else None,
                                  start_step=_as_int(run, "start_step", path) if "start_step" in run else 0,
                                  end_step=_as_int(run, "end_step", path) if "end_step" in run else 0,
                                  first_step=_as_int(run, "first_step", path) if "first_step" in run else 0,
                                  losses=tuple(map(float, losses)), step_times_s=tuple(map(float, times))))


def verify(directory: Path) -> Manifest:
    """The manifest, after checking that the files are exactly the ones it lists, each with
    its sha256; any difference is a ``UserError`` naming the file."""
    manifest = read_manifest(directory)
    present = _files(directory)
    for name in present:
        if name not in manifest.files:
            raise UserError(f"checkpoint {directory}: {name} is not in its {MANIFEST} (added after the save); "
                            "remove it, or resume from an earlier checkpoint")
    for name, digest in manifest.files.items():
        path = directory / name
        if name not in present:
            raise UserError(f"checkpoint {directory}: {name} is missing (listed in {MANIFEST}); resume from "
                            "an earlier checkpoint")
        if sha256(path) != digest:
            raise UserError(f"checkpoint {directory}: {name} does not match its sha256 in {MANIFEST} "
                            "(corrupted or changed); resume from an earlier checkpoint")
    return manifest


def is_checkpoint(directory: Path) -> bool:
    """A checkpoint directory itself (autopar's, or any DCP checkpoint)."""
    return (directory / MANIFEST).is_file() or (directory / DCP_METADATA).is_file()


def is_store(directory: Path) -> bool:
    """A directory ``--save`` writes checkpoints into (``latest`` or ``step-N`` inside)."""
    return (directory / LATEST).is_file() or any(p.is_dir() and p.name.startswith(PREFIX)
                                                 for p in directory.iterdir())


def _complete(store: Path) -> list[Path]:
    return [p for p in store.glob(f"{PREFIX}*") if p.is_dir() and (p / MANIFEST).is_file()]


def latest(store: Path) -> Path | None:
    """The last complete checkpoint of a store: the one ``latest`` names, or else (a save cut
    between its two renames) the complete one whose manifest was written last."""
    try:
        name = (store / LATEST).read_text().strip()
    except OSError:
        name = ""
    if name.startswith(PREFIX) and "/" not in name and (store / name / MANIFEST).is_file():
        return store / name
    done = _complete(store)
    return max(done, key=lambda p: (p / MANIFEST).stat().st_mtime_ns) if done else None


def resolve(path: Path, *, trust_code: bool, check: bool = True) -> Found:
    """The checkpoint ``--resume PATH`` means: PATH itself, or a store's latest complete one.
    With ``check`` every checksum is verified (``verify``). Without a manifest it loads only
    with ``trust_code``. Any other case is one ``UserError`` naming the fix."""
    path = Path(path)
    try:
        if path.is_dir() and not is_checkpoint(path) and is_store(path):
            found = latest(path)
            if found is None:
                raise UserError(f"--resume {path} holds no complete checkpoint (a save never finished); "
                                "resume from another directory or start without --resume")
            path = found
        if not path.is_dir() or not is_checkpoint(path):
            raise UserError(f"--resume {path} is not a checkpoint (no {MANIFEST} or {DCP_METADATA}); write one "
                            "with `autopar run --save DIR`")
        if not (path / MANIFEST).is_file():
            if not trust_code:
                raise UserError(f"--resume {path} has no {MANIFEST} (not written by autopar): its DCP metadata is "
                                "a Python pickle, which can run code; pass --trust-code if you trust it")
            return Found(path=path, manifest=None)
        return Found(path=path, manifest=verify(path) if check else read_manifest(path))
    except OSError as exc:
        raise UserError(f"--resume {path}: {exc.strerror or exc}") from None


def of_run(store: Path, run_id: str | None) -> Found | None:
    """The store's latest checkpoint if the run ``run_id`` wrote it (a restarted worker's
    own progress), else None."""
    if run_id is None or not Path(store).is_dir():
        return None
    found = latest(Path(store))
    if found is None:
        return None
    manifest = read_manifest(found)
    return Found(path=found, manifest=manifest) if manifest.run.run_id == run_id else None


def prepare(store: Path, step: int) -> Path:
    """Rank 0, before a save: the empty temporary directory to write into (a stale one of a
    killed save removed)."""
    tmp = Path(store) / f"{TMP_PREFIX}{step_name(step)}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, manifest: Manifest, keep: int = KEEP) -> Path:
    """Rank 0, after every rank wrote its files into ``tmp``: hash them into the manifest,
    rename ``tmp`` into place, point ``latest`` at it, prune to ``keep`` complete checkpoints."""
    store = tmp.parent
    files = {name: sha256(tmp / name) for name in _files(tmp)}
    text = Manifest(step=manifest.step, samples=manifest.samples, model=manifest.model, files=files,
                    run=manifest.run).to_json()
    _write_atomic(tmp / MANIFEST, text)
    name = step_name(manifest.step)
    final = store / name
    previous = latest(store)
    if final.exists():  # the same step again (a restart): the old copy goes aside first
        aside = store / f"{OLD_PREFIX}{name}"
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    tmp.rename(final)
    _fsync_dir(store)
    _write_atomic(store / LATEST, name + "\n")
    kept = {name} | ({previous.name} if previous is not None and keep > 1 else set())
    for p in store.iterdir():
        stale = p.name.startswith((TMP_PREFIX, OLD_PREFIX)) or (p.name.startswith(PREFIX) and p.name not in kept)
        if p.is_dir() and stale:
            shutil.rmtree(p, ignore_errors=True)
    return final
