"""A model's traced summary, kept: the cost model's ``ModelProfile`` and the runtime's
``Anatomy`` of a spec, traced once and then read from ``$AUTOPAR_CACHE`` (default
``~/.cache/autopar``) — so pricing a model again imports neither torch nor transformers
(about 1 s of a CLI command) and traces nothing (0.5–1.5 s for a 100-layer model on meta).

The trace is a pure function of the spec, the torch and transformers versions and autopar's
tracer, so the cache key is exactly that (the tracer's source files, hashed: changed code
traces anew). The presets on autopar's own model ship their entries (``SHIPPED``), so even a
first plan of one imports no torch. A user module (``path.py:factory``) is code that may change under the same
name: it is traced every time, as before. The cache holds JSON only, rebuilt with the Plan's
checked loader; an unreadable or malformed entry is traced again and rewritten. This module
imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from functools import lru_cache
from typing import TypeVar
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from autopar.errors import UserError
from autopar.layout import Anatomy
from autopar.spec import ModelSpec
from cost_models.model_profile import ModelProfile

_ROOT = Path(__file__).resolve().parent
_TRACER_SOURCES = ("trace/*.py", "model.py", "hf.py", "layout.py", "spec.py", "profiles.py")


def cache_root() -> Path:
    """``$AUTOPAR_CACHE``, or ``~/.cache/autopar``."""
    return Path(os.environ.get("AUTOPAR_CACHE") or Path.home() / ".cache" / "autopar")


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return ""


T = TypeVar("T")


def source_digest(*names: str) -> str:
    """sha256 (hex) of autopar's source files ``names`` (relative to the package)."""
    digest = hashlib.sha256()
    for name in names:
        digest.update((_ROOT / name).read_bytes())
    return digest.hexdigest()


def kept(kind: str, key: str, make: Callable[[], T], to_json: Callable[[T], object],
         from_json: Callable[[object], T]) -> T:
    """``make()``, kept as JSON under ``$AUTOPAR_CACHE/<kind>`` by ``key`` (whose parts must
    name everything the value depends on): read back with ``from_json``; an unreadable or
    malformed entry (``from_json`` raising) is made again and rewritten."""
    path = cache_root() / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        return from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, UserError, TypeError, KeyError, RecursionError):
        pass
    value = make()
    _write(path, json.dumps(to_json(value), sort_keys=True))
    return value


SHIPPED = _ROOT / "traces"
"""Entries of the presets built on autopar's own model, shipped with the package
(``benchmarks/ship_traces.py`` writes them): a first plan of a preset traces nothing either.
Their names are keys like any entry's, so an entry of other sources or versions is never read."""


def _uses_transformers(spec: ModelSpec) -> bool:
    """Whether tracing ``spec`` builds an HF transformers model (``hf:`` specs and MoE)."""
    return spec.arch == "hf" or bool(spec.experts)


def cache_key(spec: ModelSpec) -> str:
    """The key of ``spec``'s entry: its every field, torch's version, transformers' where the
    trace builds an HF model, and the tracer's source (versions read from the installed
    distributions' metadata: nothing imported)."""
    hf = _version("transformers") if _uses_transformers(spec) else "-"
    digest = hashlib.sha256(f"{spec!r}|{_version('torch')}|{hf}".encode())
    for f in sorted(p for pattern in _TRACER_SOURCES for p in _ROOT.glob(pattern)):
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    digest.update((_ROOT.parent / "cost_models" / "model_profile.py").read_bytes())
    return digest.hexdigest()[:32]


def _cache_file(spec: ModelSpec) -> Path:
    return cache_root() / "trace" / f"{cache_key(spec)}.json"


def _load(path: Path) -> tuple[ModelProfile, Anatomy | None] | None:
    from autopar.plan import rebuild  # the plan's checked JSON -> dataclass rebuild
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            return None
        return (rebuild(ModelProfile, data.get("profile"), "cached profile"),
                rebuild(Anatomy | None, data.get("layout"), "cached layout"))
    except (OSError, ValueError, UserError, TypeError, RecursionError):
        return None


def entry_text(profile: ModelProfile, layout: Anatomy | None) -> str:
    """An entry's JSON."""
    return json.dumps({"profile": dataclasses.asdict(profile),
                       "layout": dataclasses.asdict(layout) if layout else None}, sort_keys=True)


def _store(path: Path, profile: ModelProfile, layout: Anatomy | None) -> None:
    _write(path, entry_text(profile, layout))


def _write(path: Path, text: str) -> None:
    """Write atomically (a reader sees the old entry or the whole new one); an unwritable cache
    only costs the next command its work."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def profile_and_layout(spec: ModelSpec) -> tuple[ModelProfile, Anatomy | None]:
    """``autopar.trace.profile_and_layout`` of ``spec``, from the cache where it was traced
    before (a user module is always traced)."""
    if spec.arch == "module":
        from autopar.trace import profile_and_layout as traced
        return traced(spec)
    return _kept(spec)


@lru_cache(maxsize=64)
def _kept(spec: ModelSpec) -> tuple[ModelProfile, Anatomy | None]:
    """Specs are frozen data: a command that prices one model many times reads it once."""
    path = _cache_file(spec)
    hit = _load(path) or _load(SHIPPED / path.name)
    if hit is not None:
        return hit
    from autopar.trace import profile_and_layout as traced  # torch: only on a cache miss
    profile, layout = traced(spec)
    _store(path, profile, layout)
    return profile, layout


def profile_spec(spec: ModelSpec) -> ModelProfile:
    """The cost model's profile of ``spec`` (``profile_and_layout``)."""
    return profile_and_layout(spec)[0]


def shaped_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with every shape field known: a user module's traced, any other as it is."""
    if spec.arch != "module":
        return spec
    from autopar.trace import shaped_spec as traced
    return traced(spec)
