"""The outer strategy space: every (dp, tp, pp, cp, micro-batch, ZeRO, schedule, v, SP, offload,
axis order) the runtime can run, with the recompute modes the inner placement may mix (see
``autopar.solve``).

Axis orders (``axis_orders``): of the permutations of the axes, the cost model reads an
order only through the tier of each axis's group (``comm.axis_groups``), and every cost is
non-increasing in a group's bandwidths and non-decreasing in its latency. So an order whose
groups of degree > 1 are each no better than those of an order already kept (Megatron's first)
is dropped: exact, and on one node every order collapses to Megatron's. ``outer_candidates``
yields each candidate in Megatron's order (or the pinned one); the search adds the other kept
orders of a candidate lazily, behind ``order_free_hardware``'s bound (``search``).
Offload (CPU, ``Strategy.offload``) is tried with ZeRO >= 1 and dp > 1 where the profile gives
host figures; it is never faster, so the bound ordering prunes it unless memory binds.

Context parallelism (``cp_degrees``) is searched only under a recipe whose program has it
(``ExecutionRecipe.context_parallel``; under ``autopar``, whose runtime runs it without
pipelining, on the built-in models only: ``runtime_unsupported``, ``Pins.refused``), and
only where it can pay: sequences of at least ``CP_MIN_SEQ`` tokens, cut into 2 cp
load-balanced chunks (seq % 2cp == 0) of at least ``CP_MIN_CHUNK`` tokens per rank. A pinned
``--cp`` is taken as given (recipe and divisibility still checked)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator

from autopar.layout import tp_splits_heads
from autopar.plan import runtime_unsupported
from cost_models import HardwareProfile, ModelProfile, Strategy
from cost_models.axes import DEFAULT_ORDER, Axis, Degrees
from cost_models.comm import (Group, mesh_expert_data_group, mesh_expert_group, mesh_groups,
                              mesh_replica_group)
from cost_models.recipe import DEFAULT_RECIPE, ExecutionRecipe, load_recipe
from cost_models.strategy import RECOMPUTE


CP_MIN_SEQ = 8192
"""Shortest sequence for which the search tries cp > 1. CP buys activation memory and splits
the attention's quadratic term; below 8K tokens the quadratic term is a small share of a
block's FLOPs (s / 6h of it: 1/3 at h = 4096) and one micro-batch's activations fit under
TP + SP and recompute, while CP cuts every rank's GEMMs to seq/cp rows and adds K,V
exchanges. Published CP recipes start here (NVIDIA's Llama-3.1 8B/70B: CP 2 at seq 8192;
Llama-3 405B's long-context stage: CP 16 at 131072)."""
CP_MIN_CHUNK = 4096
"""Fewest tokens per cp rank (a restriction of the space, not a proof). A ring step overlaps
the send of a K,V block (∝ s/c tokens) with attention on one block pair (∝ (s/c)²): FLOPs per
byte sent ≈ (s/c) x heads/kv_heads, which must exceed peak FLOP/s over link bandwidth (H100:
~400 TFLOP/s of attention over ~45 GB/s of NIC per GPU, ~10⁴) to hide it: s/c above ~1-3K
tokens across nodes at GQA's 8-16 query heads per kv head, more without GQA; below it CP's
exchanges and its shorter GEMMs cost more than the memory it frees. The published CP runs
sit at or above 4096 (NVIDIA's Llama-3.1: 8192 / CP 2; Llama-3 405B: 131072 / CP 16 = 8192)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pins:
    """Strategy dimensions fixed by the user; ``None`` means searched."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    """Context-parallel degree (``cp_degrees``)."""
    ep: int | None = None
    """Expert-parallel degree (``ep_degrees``)."""
    zero: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    """Model chunks per pipeline rank (interleaved schedule)."""
    sequence_parallel: bool | None = None
    recompute: str | None = None
    """One recompute mode for every block; unpinned, the solver picks a mode per block."""
    offload: bool | None = None
    """CPU offload of ZeRO's shards and the optimizer step."""
    axis_order: tuple[Axis, ...] | None = None
    """Mesh axes outermost first (``Strategy.axis_order``)."""
    recipe: ExecutionRecipe | None = None
    """The execution recipe every candidate is priced under (an input, never searched);
    None: ``autopar``, the program autopar's runtime generates."""
    refused: tuple[str, ...] = ()
    """Runtime features the model's twin failed (``autopar.verify.Check`` values: dp = ZeRO
    1-3 on FSDP2, tp, sp, pp, selective): never searched, like the recipe an input."""

    def base(self) -> "Pins":
        """No dimension pinned, the same recipe and refusals."""
        return Pins(recipe=self.recipe, refused=self.refused)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One outer strategy and what its inner placement may choose."""

    strategy: Strategy
    """Everything but the placement (``stage_layers``/``stage_recompute`` empty)."""
    modes: tuple[int, ...]
    """Indices in ``RECOMPUTE`` of the modes blocks may use."""
    min_layers: int
    """Fewest blocks per stage (v under the interleaved schedule: one per chunk)."""


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(√n)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _choices(pinned, default: list) -> list:
    return default if pinned is None else [pinned]


def _schedules(pins: Pins, pp: int, m: int, layers: int) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages): gpipe, 1f1b, interleaved with 2 ≤ v ≤ layers/pp
    (Megatron: m a multiple of pp), zero-bubble (ZB-H1, v = 1)."""
    if pp == 1:
        options = [("1f1b", 1)]
    else:
        options = [("1f1b", 1), ("gpipe", 1)]
        if m % pp == 0:
            options += [("interleaved", v) for v in range(2, layers // pp + 1)]
        options.append(("zero-bubble", 1))
    for sched, v in options:
        if pins.schedule is not None and sched != pins.schedule:
            continue
        if pins.virtual_stages is not None and v != pins.virtual_stages:
            continue
        yield sched, v


def recompute_modes(pins: Pins) -> tuple[int, ...]:
    """The recompute modes (``RECOMPUTE`` indices) the blocks may take: the pinned one, else
    those the recipe's program has (``ExecutionRecipe.recompute_modes``)."""
    recipe = pins.recipe or load_recipe()
    if pins.recompute is not None:
        return (RECOMPUTE.index(pins.recompute),) if pins.recompute in recipe.recompute_modes else ()
    return tuple(i for i, mode in enumerate(RECOMPUTE) if mode in recipe.recompute_modes)


def recipe_refusal(pins: Pins) -> str | None:
    """Why the recipe's program cannot run what ``pins`` fix, in one line naming the fix, or None
    (what it runs: ``ExecutionRecipe.schedules``, ``zero_stages``, ``sequence_parallel``,
    ``recompute_modes``, ``axis_orders``)."""
    r = pins.recipe or load_recipe()
    if pins.recompute is not None and pins.recompute not in r.recompute_modes:
        return (f"--recompute {pins.recompute}: the {r.name} recipe's program recomputes "
                f"{' or '.join(r.recompute_modes)}; use one of them")
    if pins.schedule is not None and pins.schedule not in r.schedules:
        return f"--schedule {pins.schedule}: the {r.name} recipe's program runs {' or '.join(r.schedules)}; use one of them"
    zeros = sorted(set(r.zero_stages) | set(r.pipeline_zero_stages))
    if pins.zero is not None and pins.zero not in zeros:
        return f"--zero {pins.zero}: the {r.name} recipe's program runs ZeRO {', '.join(map(str, zeros))}; use one of them"
    if pins.sequence_parallel and not r.sequence_parallel:
        return f"--sp: the {r.name} recipe's program has no sequence parallelism; use --no-sp"
    if pins.axis_order is not None:
        named = tuple(str(a) for a in pins.axis_order)
        if not r.runs_order(named, frozenset(named)):
            return (f"--axis-order {','.join(named)}: the {r.name} recipe's program lays its mesh out as "
                    f"{' or '.join(r.axis_orders)} (outermost first); use one of them")
    return None


def _mode_sets(pins: Pins, schedule: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(nominal mode, modes the blocks may mix). Zero-bubble's fill fraction depends on the
    recompute mode (``cost_models.pipeline``), so it is planned with one mode on every block
    (not full: ``block_families``), as is every plan of a program with one policy for all
    blocks (``ExecutionRecipe.uniform_recompute``); such a program with Megatron's block
    method (``ExecutionRecipe.recompute_block``) also mixes none and full, in its pattern
    (``search._place``)."""
    modes = recompute_modes(pins)
    recipe = pins.recipe or load_recipe()
    if pins.recompute is not None or schedule == "zero-bubble" or recipe.uniform_recompute:
        for i in modes:
            yield RECOMPUTE[i], (i,)
        pair = (RECOMPUTE.index("none"), RECOMPUTE.index("full"))
        if pins.recompute is None and schedule != "zero-bubble" and recipe.recompute_block \
                and set(pair) <= set(modes):
            yield "none", pair
    elif modes:
        yield "none", modes


def _lead_modes(model: ModelProfile, modes: tuple[int, ...]) -> tuple[str, ...]:
    """Recompute modes of the model's leading blocks of another kind (``ModelProfile.lead``),
    one for all of them: each mode the candidate's blocks may use ("" without them: the
    strategy's own)."""
    if model.lead is None:
        return ("",)
    return tuple(RECOMPUTE[i] for i in modes)


def _no_better(a: Group, b: Group) -> bool:
    """Group ``a`` is nowhere faster than ``b`` (every collective takes at least as long)."""
    return a.bw_bytes_s <= b.bw_bytes_s and a.p2p_bytes_s <= b.p2p_bytes_s \
        and a.latency_s >= b.latency_s and a.call_s >= b.call_s


def runs_order(recipe: ExecutionRecipe, order: tuple[Axis, ...], degrees: Degrees) -> bool:
    """Whether ``recipe``'s program lays the mesh of ``degrees`` out in ``order``
    (``ExecutionRecipe.runs_order``, on the axes of degree > 1)."""
    return recipe.runs_order(tuple(str(a) for a in order), frozenset(str(a) for a in degrees.active()))


def axis_orders(hw: HardwareProfile, degrees: Degrees,
                pins: Pins = Pins()) -> list[tuple[Axis, ...]]:
    """The axis orders worth costing for these degrees, Megatron's first: an order is dropped
    when an order kept earlier has every group of degree > 1 at least as fast (see module), or
    when the recipe's program does not lay its mesh out so (``runs_order``)."""
    if pins.axis_order is not None:
        return [tuple(pins.axis_order)]
    recipe = pins.recipe or load_recipe()
    kept: list[tuple[tuple[Axis, ...], dict]] = []
    default = degrees.default_order()
    perms = [default] + [o for o in itertools.permutations(default) if o != default]
    for order in perms:
        g = mesh_groups(hw, degrees, order)
        groups: dict = {ax: g[ax] for ax in degrees.active()}
        if degrees.cp > 1:  # the dp x cp gradient group reads both axes' places
            groups["dp-cp"] = mesh_replica_group(hw, degrees, order)
        if degrees.ep > 1:  # the ep and edp groups: the innermost replicas, and the rest
            groups["ep"] = mesh_expert_group(hw, degrees, order)
            groups["edp"] = mesh_expert_data_group(hw, degrees, order)
        if any(all(_no_better(groups[ax], other[ax]) for ax in groups) for _, other in kept):
            continue
        kept.append((order, groups))
    return [order for i, (order, _) in enumerate(kept) if i == 0 or runs_order(recipe, order, degrees)]


def order_free_hardware(hw: HardwareProfile, degrees: Degrees) -> tuple[HardwareProfile, tuple[Axis, ...]]:
    """(profile, order) under which every axis of degree > 1 gets the best group any order
    gives it on ``hw``, so costs under them bound those of every order from below.

    The best group of an axis is its group with ranks adjacent (``comm.group`` is monotone in
    the stride): on NVLink when its degree n ≤ devices_per_node (D), else across nodes with
    D members per node, bus bandwidth min(intra, D · inter). The order puts the axes with
    n ≤ D innermost and the profile has nodes of S devices, S the product of their degrees,
    so they stay on NVLink; each larger axis (stride ≥ S) crosses nodes with 1 member per
    node, and its bus bandwidth is D times the NIC's, its p2p and latency the NIC's."""
    small = [ax for ax in degrees.active() if degrees[ax] <= hw.devices_per_node]
    order = tuple([ax for ax in DEFAULT_ORDER if ax not in small] + small)
    inter = hw.inter_node
    wide = replace(inter, bw_gbps=hw.devices_per_node * inter.bw_gbps,
                   p2p_bw_gbps=inter.p2p_bw_gbps or inter.bw_gbps)
    if degrees.ep > 1:
        # The ep and edp groups take the replicas' stride, which no place of one axis bounds:
        # the crossing tier gets the node's links at their best, so the bound holds for them.
        intra = hw.intra_node
        best = max(wide.bw_gbps * wide.efficiency, intra.bw_gbps * intra.efficiency) / wide.efficiency
        best_p2p = max(wide.p2p_bw_gbps * wide.efficiency,
                       (intra.p2p_bw_gbps or intra.bw_gbps) * intra.efficiency) / wide.efficiency
        wide = replace(wide, bw_gbps=best, p2p_bw_gbps=best_p2p,
                       latency_us=min(wide.latency_us, intra.latency_us),
                       call_latency_us=min(wide.call_latency_us, intra.call_latency_us))
    nodes = math.prod(degrees[ax] for ax in small)
    return replace(hw, devices_per_node=nodes, inter_node=wide), order


def cp_degrees(model: ModelProfile, devices: int, recipe: ExecutionRecipe, pins: Pins = Pins()) -> list[int]:
    """Context-parallel degrees to try on ``devices`` (the devices left after tp): 1, and
    where the recipe has context parallelism and the sequence is long (``CP_MIN_SEQ``), each
    divisor c of ``devices`` with seq % 2c == 0 and seq / c >= ``CP_MIN_CHUNK``; a pinned
    degree alone, if the recipe and the sequence allow it."""
    seq = model.seq
    if "cp" in pins.refused:  # the runtime cannot run cp on this model (``workflow.make_plan``)
        return [1] if pins.cp in (None, 1) else []
    if pins.cp is not None:
        ok = pins.cp == 1 or (recipe.has_context_parallel and seq % (2 * pins.cp) == 0
                              and devices % pins.cp == 0)
        return [pins.cp] if ok else []
    if not recipe.has_context_parallel or seq < CP_MIN_SEQ:
        return [1]
    return [c for c in _divisors(devices) if c == 1 or (seq % (2 * c) == 0 and seq // c >= CP_MIN_CHUNK)]


def ep_degrees(model: ModelProfile, replicas: int, pins: Pins = Pins()) -> list[int]:
    """Expert-parallel degrees to try with ``replicas`` = dp x cp ranks: 1 for a dense model,
    else every common divisor of the routed experts and ``replicas`` (ep regroups those ranks);
    a pinned degree alone, where it divides both."""
    if pins.ep is not None:
        ok = pins.ep == 1 or (model.moe and model.experts % pins.ep == 0 and replicas % pins.ep == 0)
        return [pins.ep] if ok else []
    if not model.moe:
        return [1]
    return _divisors(math.gcd(model.experts, replicas))


def _offloads(pins: Pins, hw: HardwareProfile) -> list[bool]:
    return _choices(pins.offload, [False, True] if hw.supports_offload else [False])


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """Outer candidates that share every cost coefficient but the pipeline's (chunks), the
    leading blocks' recompute mode and offload (``cost_models.estimate.TimeFloor``): one
    ``parts_key`` up to offload, one schedule and nominal mode. The search bounds them together
    and makes their strategies only when that bound comes up (``search``)."""

    mesh: Degrees
    zero: int
    micro_batch: int
    num_microbatches: int
    schedule: str
    sequence_parallel: bool
    recompute: str
    """The nominal recompute mode (``Strategy.recompute``)."""
    dtype: str
    recipe: ExecutionRecipe
    axis_order: tuple[Axis, ...]
    modes: tuple[int, ...]
    members: tuple[tuple[int, str, bool], ...]
    """(virtual stages, lead recompute, offload) of each member, in the fixed order."""

    def strategy(self, v: int, lead: str, offload: bool) -> Strategy:
        """The member with ``v`` virtual stages, leading-block mode ``lead`` and ``offload``."""
        return Strategy(mesh=self.mesh, zero=self.zero, micro_batch=self.micro_batch,
                        num_microbatches=self.num_microbatches, schedule=self.schedule, virtual_stages=v,
                        sequence_parallel=self.sequence_parallel, recompute=self.recompute, dtype=self.dtype,
                        offload=offload, axis_order=self.axis_order, recipe=self.recipe, lead_recompute=lead)

    @property
    def base(self) -> Strategy:
        """The first member."""
        return self.strategy(*self.members[0])

    def candidates(self) -> Iterator[Candidate]:
        """The members, in order."""
        for v, lead, off in self.members:
            yield Candidate(strategy=self.strategy(v, lead, off), modes=self.modes, min_layers=v)


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """The outer candidates of one degrees and micro-batch: their families
    (``block_families``) differ in ZeRO, schedule, SP and recompute modes."""

    mesh: Degrees
    micro_batch: int
    num_microbatches: int


def splits_heads(model: ModelProfile, tp: int, recipe: ExecutionRecipe) -> bool:
    """Whether the recipe's program splits the model's attention over ``tp`` ranks: tp divides
    the query and K,V heads; autopar's runtime also keeps one K,V head whole on every rank
    (``autopar.layout.tp_splits_heads``)."""
    if recipe.name == DEFAULT_RECIPE:
        return tp_splits_heads(model.heads, model.kv_heads, tp)
    return model.heads % tp == 0 and model.kv_heads % tp == 0


def outer_blocks(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                 pins: Pins = Pins()) -> Iterator[Block]:
    """Every (degrees, micro-batch) with outer candidates the runtime can run, in a fixed order
    (some may have none: ``block_families``)."""
    recipe = pins.recipe or load_recipe()
    refused = set(pins.refused)
    for tp in _choices(pins.tp, _divisors(gpus)):
        if hw.devices_per_node % tp or not splits_heads(model, tp, recipe) or gpus % tp \
                or (tp > 1 and "tp" in refused):
            continue
        for cp, pp in ((c, p) for c in cp_degrees(model, gpus // tp, recipe, pins)
                       for p in _choices(pins.pp, _divisors(gpus // (tp * c)))):
            if pp > model.layers or (gpus // (tp * cp)) % pp or (pp > 1 and "pp" in refused):
                continue
            dp = gpus // (tp * cp * pp)
            if (pins.dp is not None and dp != pins.dp) or global_batch % dp:
                continue
            for ep, b in ((e, b) for e in ep_degrees(model, dp * cp, pins)
                          for b in _choices(pins.micro_batch, _divisors(global_batch // dp))):
                m, rem = divmod(global_batch // dp, b)
                if rem or (pp > 1 and m < pp):
                    continue
                yield Block(mesh=Degrees(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep), micro_batch=b, num_microbatches=m)


def block_families(model: ModelProfile, hw: HardwareProfile, block: Block, dtype: str,
                   pins: Pins = Pins(), memo: dict | None = None) -> Iterator[Family]:
    """The families of ``block`` the runtime can run, in a fixed order. ``memo`` (a dict the
    caller owns) keeps the runtime predicate's answers across blocks: it is pure. What they
    hold reads the block's micro-batch only through the micro-batch count's divisibility by pp
    (``family_signature``)."""
    recipe = pins.recipe or load_recipe()
    refused = set(pins.refused)
    order = tuple(pins.axis_order or DEFAULT_ORDER)
    if not runs_order(recipe, order, block.mesh):
        return  # a mesh order the recipe's program does not lay out
    offloads = _offloads(pins, hw)
    memo = {} if memo is None else memo
    mesh, b, m = block.mesh, block.micro_batch, block.num_microbatches
    dp, cp, tp, pp, ep = mesh.dp, mesh.cp, mesh.tp, mesh.pp, mesh.ep
    op_runs = model.op_priced and cp == 1  # per-op recompute: dense blocks, no context parallelism

    def refuses(dp: int, pp: int, zero: int, schedule: str, v: int, cp: int, ep: int = 1,
                offload: bool = False, moe: bool = False, sp: bool = False) -> bool:
        """``runtime_unsupported`` under ``recipe``, once per distinct question."""
        key = (dp, pp, zero, schedule, v, cp, ep, offload, moe, sp)
        if key not in memo:
            memo[key] = runtime_unsupported(dp=dp, pp=pp, zero=zero, schedule=schedule, virtual_stages=v,
                                            cp=cp, ep=ep, offload=offload, recipe=recipe, moe=moe,
                                            sequence_parallel=sp) is not None
        return memo[key]

    for zero in _choices(pins.zero, [0, 1, 2, 3] if dp * cp > 1 else [0]):
        if zero and "dp" in refused:
            continue
        schedules: dict[str, list[int]] = {}
        for sched, v in _schedules(pins, pp, m, model.layers):
            if not refuses(dp * cp, pp, zero, sched, v, cp):
                schedules.setdefault(sched, []).append(v)
        for sched, chunk_counts in schedules.items():
            # the offloads the runtime runs at each v
            offs = {v: tuple(off for off in offloads
                             if not (off and refuses(dp * cp, pp, zero, sched, v, cp, offload=True)))
                    for v in chunk_counts}
            for sp in _choices(pins.sequence_parallel, [False, True] if tp > 1 else [False]):
                if sp and (tp == 1 or "sp" in refused or not recipe.sequence_parallel):
                    continue  # SP splits what TP replicates: nothing at tp = 1
                vs = [v for v in chunk_counts if not ((ep > 1 or model.moe) and refuses(
                    dp * cp, pp, zero, sched, v, cp, ep=ep, moe=model.moe, sp=sp))]
                for nominal, modes in _mode_sets(pins, sched):
                    if sched == "zero-bubble" and nominal == "full":
                        continue  # ``infeasible.ZB_FULL``: the weight pass recomputes per parameter group
                    for mode in ("selective", "op", "full"):
                        # torch's selective checkpointing allows one backward through a block;
                        # the zero-bubble schedule runs two (input, then weight gradients); a pair
                        # of features the twin failed together (``verify.COMPOSED``)
                        if mode in refused or (mode == "op" and (not op_runs or sched == "zero-bubble")) \
                                or (tp > 1 and f"tp+{mode}" in refused) or (sp and f"sp+{mode}" in refused):
                            modes = tuple(i for i in modes if RECOMPUTE[i] != mode)
                            if nominal == mode:
                                modes = ()
                    if not modes:
                        continue
                    members = tuple((v, lead, off) for v in vs for lead in _lead_modes(model, modes)
                                    for off in offs[v])
                    if members:
                        yield Family(mesh=mesh, zero=zero, micro_batch=b, num_microbatches=m,
                                     schedule=sched, sequence_parallel=sp, recompute=nominal,
                                     dtype=dtype, recipe=recipe, axis_order=order, modes=modes,
                                     members=members)


def family_signature(block: Block) -> tuple:
    """What ``block_families`` reads of a block besides its degrees' and micro-batch's own
    values in the Family fields: blocks with one signature have families of the same
    members (so the same candidate count)."""
    pp = block.mesh.pp
    return block.mesh, pp > 1 and block.num_microbatches % pp == 0


def outer_families(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                   dtype: str, pins: Pins = Pins()) -> Iterator[Family]:
    """Every outer candidate the runtime can run, in families (``Family``), in a fixed order."""
    memo: dict = {}
    for block in outer_blocks(model, hw, gpus, global_batch, pins):
        yield from block_families(model, hw, block, dtype, pins, memo)


def outer_candidates(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
                     dtype: str, pins: Pins = Pins()) -> Iterator[Candidate]:
    """Every outer candidate the runtime can run, in a fixed order (``outer_families``'
    members)."""
    for fam in outer_families(model, hw, gpus, global_batch, dtype, pins):
        yield from fam.candidates()


def candidates(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int,
               dtype: str, pins: Pins = Pins()) -> Iterator[Strategy]:
    """The outer strategies of ``outer_candidates`` (placement left empty)."""
    for cand in outer_candidates(model, hw, gpus, global_batch, dtype, pins):
        yield cand.strategy
