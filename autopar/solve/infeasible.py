"""What to tell the user when no plan exists: which pin or input to change, and what would fit."""

from __future__ import annotations

import dataclasses
from typing import Any

from autopar.solve.core import stage_upper_bounds
from autopar.solve.space import Pins, outer_candidates, splits_heads
from cost_models import HardwareProfile, ModelProfile, stage_costs
from cost_models.recipe import load_recipe

_FLAGS = {"dp": "--dp", "tp": "--tp", "pp": "--pp", "cp": "--cp", "zero": "--zero", "micro_batch": "--mbs",
          "schedule": "--schedule", "virtual_stages": "--vpp", "sequence_parallel": "--sp",
          "recompute": "--recompute"}


ZB_FULL = ("--recompute full is not planned under the zero-bubble schedule: torch's split backward "
           "recomputes a checkpointed block again for each parameter group in its weight pass (a block "
           "of two linear layers runs its forward three times, not once); use --recompute selective or "
           "none, or another --schedule")
"""Why the search plans no zero-bubble candidate with full recompute."""


def op_unpriced(model: ModelProfile) -> str | None:
    """What keeps per-op recompute from being priced for ``model``, or None where it is."""
    if model.op_priced:
        return None
    return "a mixture of experts" if model.moe else "no weight GEMMs traced in its blocks"


def op_refusal(name: str, unpriced: str | None, cp: int | None, schedule: str | None = None) -> str | None:
    """Why ``--recompute op`` cannot be pinned, one line naming the fix, or None: not priced for
    model ``name`` (``unpriced`` says what it is), or not run by the runtime under the
    zero-bubble schedule or context parallelism (``autopar.plan.op_unsupported``)."""
    if unpriced:
        return (f"--recompute op is priced for dense transformer blocks only ({name}: {unpriced}); "
                "use --recompute none, selective or full")
    if schedule == "zero-bubble":
        return ("--recompute op does not run under the zero-bubble schedule, which backpropagates through a block "
                "twice (torch's selective checkpointing allows once): use --recompute full or another --schedule")
    if cp and cp > 1:
        return f"--recompute op does not run with context parallelism: drop --cp {cp} or use --recompute full"
    return None


def no_candidate_reason(model: ModelProfile, hw: HardwareProfile, gpus: int,
                        global_batch: int, pins: Pins) -> str:
    """Why no outer candidate exists at all (divisibility, refusals; not memory)."""
    used = {"tp": (pins.tp or 1) > 1, "pp": (pins.pp or 1) > 1, "sp": bool(pins.sequence_parallel),
            "dp": (pins.zero or 0) > 0, "selective": pins.recompute == "selective", "op": pins.recompute == "op"}
    used.update({f"{a}+{b}": bool(used[a] and pins.recompute == b) for a, b in (("tp", "selective"), ("sp", "full"),
                                                                                 ("sp", "op"))})
    refusal = op_refusal(model.name, op_unpriced(model), pins.cp, pins.schedule) if pins.recompute == "op" else None
    if refusal:
        return refusal
    if pins.schedule == "zero-bubble" and pins.recompute == "full":
        return ZB_FULL
    if pins.cp and pins.cp > 1 and "cp" in pins.refused:
        return (f"--cp {pins.cp}: autopar's runtime runs context parallelism on the built-in gpt/llama models "
                "only; drop --cp, or plan with --recipe megatron-core and run it through `autopar export`")
    for check in pins.refused:
        if used.get(check):
            return (f"{model.name} failed autopar verify's {check} check (see `autopar verify --model ...`); "
                    f"plan without pinning it")
    if pins.cp and pins.cp > 1:
        recipe = pins.recipe or load_recipe()
        if not recipe.has_context_parallel:
            return (f"--cp {pins.cp}: the {recipe.name} recipe has no context parallelism; plan with "
                    "--recipe autopar or megatron-core, or drop --cp")
        if model.seq % (2 * pins.cp):
            return f"--cp {pins.cp} needs --seq-len a multiple of 2 x cp = {2 * pins.cp}, got {model.seq}"
    if pins.tp and not splits_heads(model, pins.tp, pins.recipe or load_recipe()):
        return f"--tp {pins.tp} does not divide the {model.heads} heads / {model.kv_heads} kv heads"
    if pins.tp and hw.devices_per_node % pins.tp:
        return (f"--tp {pins.tp} does not divide the {hw.devices_per_node} devices per node of "
                f"{hw.name}; tensor parallelism stays inside a node")
    if pins.virtual_stages and pins.virtual_stages > 1 and pins.schedule not in (None, "interleaved"):
        return f"--vpp {pins.virtual_stages} needs --schedule interleaved"
    if pins != pins.base():
        return (f"no strategy with the pinned options splits {gpus} devices, {model.layers} layers "
                f"and global batch {global_batch}; check that dp x tp x pp x cp = --gpus, that dp x mbs "
                f"divides the batch, and that pipelined schedules have pp > 1 (interleaved: "
                f"micro-batches a multiple of pp, pp x vpp <= layers)")
    return (f"no way to split global batch {global_batch} over {gpus} devices; use a global "
            f"batch divisible by the data-parallel degree (e.g. a multiple of {gpus})")


def _describe_fix(model, hw, gpus, global_batch, dtype, pins: Pins) -> str | None:
    """The first single pin whose removal makes something fit, and what then fits."""
    for name, flag in _FLAGS.items():
        if getattr(pins, name) is None:
            continue
        unpinned: dict[str, Any] = {name: None}
        relaxed = dataclasses.replace(pins, **unpinned)
        if fits_anywhere(model, hw, gpus, global_batch, dtype, relaxed):
            return f"drop {flag} (the pinned {getattr(pins, name)} leaves no placement within memory)"
    return None


def does_not_fit(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                 dtype: str, pins: Pins) -> str:
    """Why nothing fits in device memory, and what would: a pin to drop, the ZeRO-3 + full
    recompute escape when those were pinned away, or the device count that fits."""
    head = (f"{model.name} does not fit on {gpus} x {hw.device} ({hw.memory_gib:g} GiB) at "
            f"global batch {global_batch}")
    if pins != pins.base():
        fix = _describe_fix(model, hw, gpus, global_batch, dtype, pins)
        if fix is None and fits_anywhere(model, hw, gpus, global_batch, dtype,
                                         Pins(zero=3, recompute="full", recipe=pins.recipe)):
            fix = "fits with ZeRO-3 + full recompute: drop the pins (--zero 3 --recompute full)"
        if fix is None and fits_anywhere(model, hw, gpus, global_batch, dtype, pins.base()):
            fix = "drop the pins (--tp/--pp/--zero/--recompute/...) to let the planner choose"
        if fix:
            return f"{head} with the pinned options; {fix}"
    lo, hi = gpus, None
    for _ in range(24):
        more = lo * 2
        if fits_anywhere(model, hw, more, global_batch, dtype, pins.base()):
            hi = more
            break
        lo = more
    if hi is None:  # what more devices cannot split: one micro-batch of one sequence per device
        cp = (" (autopar's runtime runs context parallelism on the built-in gpt/llama models only)"
              if "cp" in pins.refused else "")
        return (f"{head}: no device count up to 2^24 holds one sequence of {model.seq:,} tokens; "
                f"shorten --seq-len{cp} or use a device with more memory")
    step = max(hw.devices_per_node, (hi - lo) // 16)
    for n in range(lo + step, hi, step):
        if fits_anywhere(model, hw, n, global_batch, dtype, pins.base()):
            hi = n
            break
    return head + (f": needs >= {hi} devices of {hw.memory_gib:g} GiB at this batch "
                   f"(with ZeRO-3 and full recompute as needed)")


def fits_anywhere(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                  dtype: str, pins: Pins) -> bool:
    """Some outer candidate has a placement within device memory (bounds only, no CP-SAT)."""
    for cand in outer_candidates(model, hw, gpus, global_batch, dtype, pins):
        c = stage_costs(model, hw, cand.strategy)
        upper = stage_upper_bounds(c, model.layers, hw.memory_bytes, cand.modes)
        if min(upper) >= cand.min_layers and sum(upper) >= model.layers:
            return True
    return False
