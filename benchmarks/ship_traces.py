"""Write the trace-cache entries shipped with autopar (``autopar/traces``): one per preset
built on autopar's own model, at its default sequence length, so a first ``autopar plan`` of
a preset imports no torch and traces nothing (``autopar.profiles``).

    python benchmarks/ship_traces.py

Run it after changing the tracer, the built-in model or the presets (``tests/test_profiles.py``
fails until the entries match the sources); stale entries are removed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar.profiles import SHIPPED, _uses_transformers, cache_key, entry_text  # noqa: E402
from autopar.spec import PRESETS  # noqa: E402


def shipped_presets() -> list[str]:
    """The presets whose entries ship: those traced without transformers (its version is
    the user's)."""
    return sorted(name for name, spec in PRESETS.items() if not _uses_transformers(spec))


def main() -> None:
    from autopar.trace import profile_and_layout
    SHIPPED.mkdir(exist_ok=True)
    keep = set()
    for name in shipped_presets():
        spec = PRESETS[name]
        path = SHIPPED / f"{cache_key(spec)}.json"
        path.write_text(entry_text(*profile_and_layout(spec)), encoding="utf-8")
        keep.add(path.name)
        print(f"{name:16s} {path.name}")
    for stale in SHIPPED.glob("*.json"):
        if stale.name not in keep:
            stale.unlink()


if __name__ == "__main__":
    main()
