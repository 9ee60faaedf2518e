"""Published measured training runs (``benchmarks/published/*.json``) as typed records.

    from benchmarks.published_rows import load_sources
    for src in load_sources():
        for row in src.rows: ...

One JSON file per source; each carries its citation, the framework that ran it, notes common to
its rows, and rows giving a complete configuration (model spec for ``autopar.spec.parse_model_spec``,
device, parallel layout, batch, recompute, precision) and one measured value (or that it ran out
of memory), with the peak memory it reports where it does (``memory_gib``). ``assumed`` says what
the source left unstated and what was chosen; ``needs`` lists features autopar cannot express yet
(``cp``, ``fp8``, ``moe``, ``async_tp``, ``torch_compile``, ``a100_40g``, ``h100_96g``,
``cpu_offload``, ``per_op_sac``: torchtitan's per-operator selective checkpointing,
``eager_loss``: torchtitan's blocks compiled but not its loss, as before April 2025;
``moe_folding``: Megatron's experts on a TP x DP regrouping of their own, ``ep_overlap``: the
expert all-to-alls hidden behind another micro-batch, ``hybrid_ep``: DeepEP/HybridEP dispatch
kernels, ``cuda_graphs``, ``mtp``: DeepSeek's multi-token prediction layer,
``pipeline_layout``: blocks placed on stages by hand, ``recompute_modules``: Megatron's
``--recompute-modules`` other than core attention, recorded as the nearest mode), so a
validator can skip those rows until they are supported or pick the recipe that has them.

Pure data: no torch, no autopar import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PUBLISHED_DIR = Path(__file__).resolve().parent / "published"

FRAMEWORKS = ("megatron-2021", "megatron-core", "deepspeed", "torchtitan", "llm-foundry", "nemo")
METRICS = ("tokens_per_s_per_gpu", "step_time_s", "tflops_per_gpu", "mfu", "out_of_memory")
"""What ``value`` measures; ``out_of_memory``: the source reports the run ran out of device
memory (value 1: nothing to price but that it must not be predicted to fit)."""
RECOMPUTE = ("none", "selective", "full")
FLOPS_CONVENTIONS = ("model", "hardware")
NEEDS = ("cp", "fp8", "moe", "async_tp", "torch_compile", "a100_40g", "h100_96g", "cpu_offload",
         "per_op_sac", "fp8_rowwise", "eager_loss", "moe_folding", "ep_overlap", "hybrid_ep", "cuda_graphs",
         "mtp", "pipeline_layout", "recompute_modules")


# How benchmarks/validate_rows.py prices each source's rows (plain data, like the rows).

SOURCE_RECIPE = {
    "narayanan2021_t1": "megatron-2021", "korthikanti2022_t5": "megatron-core",
    "mtnlg": "deepspeed", "bloom": "deepspeed", "torchtitan_a100": "torchtitan",
    "torchtitan_h100": "torchtitan", "torchtitan_h200": "torchtitan",
    "llmfoundry": "llm-foundry", "nemo_h100": "megatron-core-te",
    "megatron_bridge_h100": "megatron-core-te", "megatron_bridge_moe": "megatron-core-te",
    "megatron_bridge_b200": "megatron-core-te", "megatron_moe_modelzoo": "megatron-core-te",
}
"""The execution recipe of each source's framework (``cost_models/recipes``)."""
FEATURE_RECIPE = {"torchtitan": {frozenset({"torch_compile"}): "torchtitan-compile",
                                 frozenset({"torch_compile", "async_tp"}): "torchtitan-asynctp",
                                 frozenset({"torch_compile", "eager_loss"}): "torchtitan-compile-eager-loss",
                                 frozenset({"torch_compile", "async_tp", "eager_loss"}): "torchtitan-asynctp-eager-loss"}}
"""A framework's recipe for rows that ran with program features (``Row.needs``) its plain
recipe does not have, by the set of those features."""
FEATURES = frozenset({"torch_compile", "async_tp", "eager_loss"})
"""The needs that select a recipe (``FEATURE_RECIPE``) rather than a strategy or a profile."""
MEMORY_APPROXIMATED = frozenset({"recompute_modules"})
"""Needs priced at the nearest configuration autopar has, which keeps more than the run did:
``recompute_modules`` (Megatron recomputing the norms or the experts' activation, recorded as
recompute none) adds element-wise work the time leaves out and frees memory the peak keeps.
Their time is priced; their fit is shown but is not a run "predicted not to fit although it
ran" (the configuration priced is not the one that ran)."""
SUPPORTED = frozenset({"a100_40g", "h100_96g", "fp8", "cp", "per_op_sac", "moe"}) | FEATURES | MEMORY_APPROXIMATED
"""Needs (``published_rows.NEEDS``) autopar can express now."""
CHECK_ONLY = frozenset({"cp", "per_op_sac", "moe"})
"""Needs whose rows are priced and reported but never fitted on: out-of-sample checks of a
newly priced feature by construction. ``cp``: NeMo's and Megatron-Bridge's context-parallel H100
rows (Llama-3 8B / 70B at CP 2, Llama-3.1 405B at CP 2) check the ring-attention pricing with the
constants the other rows fit. ``per_op_sac``: torchtitan's per-op selective recompute (``op``),
recorded by the sources as "selective", checked the same way. ``moe``: Megatron-Bridge's
mixture-of-experts rows check the routed experts' pricing (grouped GEMMs, all-to-alls) the
same way."""

class PublishedDataError(ValueError):
    """A published-data file is malformed; the message names the file and row."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One measured run: its configuration and one published value."""

    id: str
    model: str
    """An autopar model spec (preset name or ``gpt:``/``llama:`` form)."""
    device: str
    cluster: str
    """An autopar hardware profile name where one exists, else a suggested name."""
    gpus: int
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    micro_batch: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    vpp: int
    """Model chunks per pipeline rank (1: no interleaving)."""
    zero: int
    """0 (plain DP), 1 (optimizer states sharded / distributed optimizer), 2, 3 (FSDP full shard)."""
    sequence_parallel: bool
    recompute: str
    recompute_layers: int | None
    """Blocks recomputed with ``recompute`` (the others none); None: all blocks."""
    dtype: str
    fp8: bool
    metric: str
    value: float
    flops_convention: str | None
    """For ``tflops_per_gpu``/``mfu`` only: ``model`` or ``hardware`` (counts recompute)."""
    assumed: str
    needs: tuple[str, ...]
    memory_gib: float | None = None
    """Peak device memory the source reports for the run, GiB (what it measures is in the
    source's notes: torchtitan logs the caching allocator's peak reserved bytes); None: not
    reported."""

    @property
    def supported(self) -> bool:
        """Nothing in ``needs``: autopar can express the whole configuration."""
        return not self.needs


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """One published table (one JSON file)."""

    source: str
    title: str
    cite: str
    framework: str
    notes: str
    rows: tuple[Row, ...]
    path: Path


_SOURCE_KEYS = {"source": str, "title": str, "cite": str, "framework": str, "notes": str, "rows": list}
_ROW_KEYS: dict[str, type | tuple[type, ...]] = {
    "id": str, "model": str, "device": str, "cluster": str, "gpus": int, "seq_len": int,
    "global_batch": int, "micro_batch": int, "dp": int, "tp": int, "pp": int, "cp": int, "ep": int,
    "vpp": int, "zero": int, "sequence_parallel": bool, "recompute": str,
    "recompute_layers": (int, type(None)), "dtype": str, "fp8": bool, "metric": str,
    "value": (int, float), "assumed": str, "needs": list,
}
_OPTIONAL_ROW_KEYS: dict[str, type | tuple[type, ...]] = {"flops_convention": (str, type(None)),
                                                           "memory_gib": (int, float, type(None))}


def _is(value: object, types: type | tuple[type, ...]) -> bool:
    # bool is an int subclass: keep True out of integer fields and 1 out of bool fields.
    if isinstance(value, bool):
        return (types is bool) or (isinstance(types, tuple) and bool in types)
    return isinstance(value, types)


def _row(data: object, where: str) -> Row:
    if not isinstance(data, dict):
        raise PublishedDataError(f"{where}: a row must be a JSON object")
    missing = [k for k in _ROW_KEYS if k not in data]
    if missing:
        raise PublishedDataError(f"{where}: missing key(s) {', '.join(missing)}")
    unknown = sorted(set(data) - set(_ROW_KEYS) - set(_OPTIONAL_ROW_KEYS))
    if unknown:
        raise PublishedDataError(f"{where}: unknown key(s) {', '.join(unknown)}")
    for key, types in {**_ROW_KEYS, **_OPTIONAL_ROW_KEYS}.items():
        if key in data and not _is(data[key], types):
            raise PublishedDataError(f"{where}: {key}={data[key]!r} has the wrong type")
    if data["metric"] not in METRICS:
        raise PublishedDataError(f"{where}: metric {data['metric']!r} is not one of {', '.join(METRICS)}")
    if data["recompute"] not in RECOMPUTE:
        raise PublishedDataError(f"{where}: recompute {data['recompute']!r} is not one of {', '.join(RECOMPUTE)}")
    conv = data.get("flops_convention")
    if data["metric"] in ("tflops_per_gpu", "mfu") and conv not in FLOPS_CONVENTIONS:
        raise PublishedDataError(f"{where}: metric {data['metric']} needs flops_convention model or hardware")
    bad = [n for n in data["needs"] if n not in NEEDS]
    if bad:
        raise PublishedDataError(f"{where}: unknown need(s) {bad}; known: {', '.join(NEEDS)}")
    if data["metric"] == "out_of_memory" and data["value"] != 1:
        raise PublishedDataError(f"{where}: an out_of_memory row has value 1")
    mem = data.get("memory_gib")
    if mem is not None and not 0 < mem < 1e4:
        raise PublishedDataError(f"{where}: memory_gib={mem!r} is not a device's memory in GiB")
    return Row(**{**data, "value": float(data["value"]), "flops_convention": conv,
                  "needs": tuple(data["needs"]), "memory_gib": None if mem is None else float(mem)})


def load_source(path: Path) -> Source:
    """One file; :class:`PublishedDataError` names the file (and row) of any problem."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise PublishedDataError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PublishedDataError(f"{path}: the top level must be a JSON object")
    for key, typ in _SOURCE_KEYS.items():
        if key not in data:
            raise PublishedDataError(f"{path}: missing key {key}")
        if not isinstance(data[key], typ):
            raise PublishedDataError(f"{path}: {key} has the wrong type")
    unknown = sorted(set(data) - set(_SOURCE_KEYS))
    if unknown:
        raise PublishedDataError(f"{path}: unknown key(s) {', '.join(unknown)}")
    if data["source"] != Path(path).stem:
        raise PublishedDataError(f"{path}: source {data['source']!r} differs from the file stem")
    if data["framework"] not in FRAMEWORKS:
        raise PublishedDataError(f"{path}: framework {data['framework']!r} is not one of {', '.join(FRAMEWORKS)}")
    rows = []
    for i, r in enumerate(data["rows"]):
        rid = r.get("id", f"#{i}") if isinstance(r, dict) else f"#{i}"
        rows.append(_row(r, f"{path}: row {rid}"))
    return Source(source=data["source"], title=data["title"], cite=data["cite"], framework=data["framework"],
                  notes=data["notes"], rows=tuple(rows), path=Path(path))


def load_sources(directory: Path = PUBLISHED_DIR) -> list[Source]:
    """Every ``*.json`` under ``directory``, sorted by file name."""
    return [load_source(p) for p in sorted(Path(directory).glob("*.json"))]


CONTRADICTION_TOL = 0.05
"""How much faster per GPU a run may be than one it should be no faster than before the slower
one counts as contradicted (``contradicted``): about three times the spread of a source's
near-repeated configurations (llm-foundry's 13B on 8-64 H100 at micro-batch 2: 4,767-4,811
tokens/s per GPU; its 125M at micro-batch 32 and 40: 1 %)."""


def _no_faster(b: Row, a: Row) -> bool:
    """Whether physics says ``b`` runs no faster per GPU than ``a``: the same model, device,
    precision and layout but for data parallelism, with at least as many GPUs (no less
    communication per GPU), sequences at least as long (no less attention per token), micro-
    batches of no more tokens (no larger GEMMs) and no more of them per step (no more steps
    over which the optimizer and the gradient reduction are amortised)."""
    return (a.model.split(",seq=")[0] == b.model.split(",seq=")[0] and a.cluster == b.cluster
            and (a.dtype, a.fp8, a.zero, a.tp, a.pp, a.cp, a.ep, a.vpp, a.sequence_parallel, a.recompute,
                 a.recompute_layers, set(a.needs))
            == (b.dtype, b.fp8, b.zero, b.tp, b.pp, b.cp, b.ep, b.vpp, b.sequence_parallel, b.recompute,
                b.recompute_layers, set(b.needs))
            and b.gpus >= a.gpus and b.seq_len >= a.seq_len and b.micro_batch * b.seq_len <= a.micro_batch * a.seq_len
            and b.global_batch // (b.dp * b.micro_batch) <= a.global_batch // (a.dp * a.micro_batch))


def contradicted(source: Source, tol: float = CONTRADICTION_TOL) -> dict[str, str]:
    """The rows of ``source`` that its own other rows contradict, by id, each with the row that
    does: a run of tokens/s per GPU more than ``tol`` below one that physics says it should be
    no faster than (``_no_faster``). Model-free: read from the published values alone, so a
    prediction that misses such a row may be right."""
    rows = [r for r in source.rows if r.metric == "tokens_per_s_per_gpu"]
    out = {}
    for a in rows:
        worst = max((b for b in rows if b is not a and _no_faster(b, a)), key=lambda b: b.value, default=None)
        if worst is not None and worst.value > a.value * (1 + tol):
            out[a.id] = f"{worst.id} ran {worst.value / a.value - 1:+.1%} per GPU"
    return out


if __name__ == "__main__":
    total = supported = 0
    for src in load_sources():
        n_ok = sum(r.supported for r in src.rows)
        total, supported = total + len(src.rows), supported + n_ok
        print(f"{src.source:<22} {len(src.rows):>4} rows, {n_ok:>4} supported  {src.title}")
    print(f"{'total':<22} {total:>4} rows, {supported:>4} supported")
