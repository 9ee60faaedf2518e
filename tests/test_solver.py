"""The planner: optimal for the cost model (against exhaustive enumeration), deterministic,
memory-respecting, and clear about what does not fit."""

import dataclasses
import itertools
import random
import time

import pytest

from autopar.errors import UserError
from autopar.solve import Pins, outer_candidates, search
from cost_models import Degrees, ModelProfile, Strategy, estimate, load_profile, memory, stage_costs
from autopar.solve.space import cp_degrees
from cost_models.axes import DEFAULT_ORDER, Axis
from cost_models.recipe import load_recipe


def gpt_profile(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> ModelProfile:
    """A GPT's counts as the tracer reports them (Narayanan Eq. 2 and 3, Korthikanti Table 2)."""
    h = hidden
    return ModelProfile(
        name=f"gpt-{layers}x{hidden}", layers=layers, hidden=h, heads=heads, kv_heads=heads,
        ffn=4 * h, vocab=vocab, seq=seq, tied=True, block_params=12 * h * h + 13 * h,
        embed_params=(vocab + seq) * h, head_params=2 * h + vocab * h,
        block_matmul_flops_per_token=24.0 * h * h, block_attn_flops_per_token=4.0 * seq * h,
        head_flops_per_token=2.0 * vocab * h, block_act_bytes_replicated_per_token=10.0 * h,
        block_act_bytes_sharded_per_token=24.0 * h, block_act_bytes_attn_per_token=5.0 * heads * seq,
        fused_act_bytes_replicated_per_token=10.0 * h, fused_act_bytes_sharded_per_token=24.0 * h,
        fused_act_bytes_attn_per_token=4.0 * heads)


def stage_loads(n: int, modes: tuple[int, ...]):
    """Every split of ``n`` blocks over the allowed recompute modes, as (none, sel, full)."""
    for cut in itertools.combinations_with_replacement(modes, n):
        yield tuple(cut.count(r) for r in range(3))


def brute_force(model, hw, gpus, batch, dtype, pins=Pins()):
    """Minimum step time over the whole space by enumeration: every outer candidate under every
    axis order (the 6 of pp, dp, tp, or the 24 with cp where the space has cp > 1; none
    pruned), with and without offload, every split of the blocks over the stages (at least
    ``min_layers`` each) and every mix of recompute modes on every stage (under a recipe of
    one mode for all blocks, those mixes its block method makes: ``block_method_optimum``),
    within device and host memory."""
    best = None
    with_cp = cp_degrees(model, gpus, pins.recipe or load_recipe(), pins) != [1]
    axes = DEFAULT_ORDER if with_cp else tuple(a for a in DEFAULT_ORDER if a != Axis.CP)
    orders = [pins.axis_order] if pins.axis_order else list(itertools.permutations(axes))
    cands = [cand for order in orders for cand in outer_candidates(
        model, hw, gpus, batch, dtype, dataclasses.replace(pins, axis_order=order))]
    seen, strategies = set(), set()
    for cand in cands:
        if (cand.strategy, cand.modes) in strategies:
            continue  # an order that differs only in where a degree-1 axis sits
        strategies.add((cand.strategy, cand.modes))
        c = stage_costs(model, hw, cand.strategy)
        if (c, cand.modes, cand.min_layers) in seen:
            continue  # an order giving the same groups: the same costs, enumerated already
        seen.add((c, cand.modes, cand.min_layers))
        step = candidate_optimum(model, hw, cand, c)
        if step is not None:
            best = step if best is None else min(best, step)
    return best


def random_instance(rng: random.Random):
    heads = rng.choice([4, 8, 16])
    hidden = heads * rng.choice([64, 128, 256])
    model = gpt_profile(layers=rng.randint(2, 6), hidden=hidden, heads=heads,
                        vocab=rng.choice([1024, 32000, 51200]), seq=rng.choice([512, 2048]))
    gpus = rng.choice([1, 2, 4, 8])
    batch = gpus * rng.choice([1, 2, 4])
    base = load_profile(rng.choice(["dgx-a100-80g", "dgx-h100"]))
    # Device memory from 0.05x to 2x the unsharded training state, so the cap often binds.
    state_gib = model.params * 18 / 2**30
    hw = dataclasses.replace(base, memory_gib=state_gib * rng.uniform(0.05, 2.0) + 0.5,
                             reserve_gib=0.0)
    # Small nodes so that axis orders matter; host memory that sometimes binds offload.
    hw = dataclasses.replace(hw, devices_per_node=rng.choice([2, 4, 8]),
                             host_memory_gib=state_gib * rng.uniform(0.0, 1.0))
    return model, hw, gpus, batch


def test_optimal_against_exhaustive_enumeration_on_200_instances():
    rng = random.Random(2026)
    checked = infeasible = mixed = 0
    while checked + infeasible < 200:
        model, hw, gpus, batch = random_instance(rng)
        expected = brute_force(model, hw, gpus, batch, "bf16")
        if expected is None:
            with pytest.raises(UserError, match="does not fit"):
                search(model, hw, gpus, batch, "bf16")
            infeasible += 1
            continue
        sol = search(model, hw, gpus, batch, "bf16")
        assert sol.optimal
        assert sol.estimate.step_time_s == pytest.approx(expected, rel=1e-9)
        assert sol.estimate.fits
        checked += 1
        used = {i for c in sol.strategy.stage_recompute for i, n in enumerate(c) if n}
        mixed += len(used) > 1
    # most instances are feasible, so the comparison is not vacuous (144 of 200 since what autocast
    # keeps and the loss's backward are priced; 150 or more before)
    assert checked >= 140
    assert mixed >= 1  # some optima mix recompute modes across blocks


def test_stage_tables_are_the_exact_least_block_time_per_count():
    """g_s(N) of ``autopar.solve.tables`` against enumeration of every mix that fits."""
    from autopar.solve.tables import stage_table
    rng = random.Random(7)
    checked = 0
    for _ in range(25):
        model, hw, gpus, batch = random_instance(rng)
        for cand in list(outer_candidates(model, hw, gpus, batch, "bf16"))[:12]:
            c = stage_costs(model, hw, cand.strategy)
            for s in range(c.pp):
                g, mix = stage_table(c, s, cand.modes, hw.memory_bytes, model.layers)
                for n in range(1, model.layers + 1):
                    fits = [c.stage_time_s(s, ld) - c.stage_time_s(s, 0)
                            for ld in stage_loads(n, cand.modes)
                            if c.stage_memory_bytes(s, ld) <= hw.memory_bytes]
                    if not fits:
                        assert g[n] == float("inf")
                        continue
                    assert g[n] == pytest.approx(min(fits), rel=1e-12)
                    assert sum(mix[n]) == n
                    checked += 1
    assert checked > 500


def test_cp_sat_with_table_cuts_is_optimal_without_the_greedy_shortcut(monkeypatch):
    """Every candidate through CP-SAT (no greedy placement to prove or hint, no exact scan):
    the cuts from the stage tables must never remove the optimum."""
    import importlib
    searching = importlib.import_module("autopar.solve.search")
    monkeypatch.setattr(searching, "greedy", lambda *a, **k: None)
    monkeypatch.setattr(searching, "least_step", lambda *a, **k: None)  # the scan gives up
    rng = random.Random(11)
    checked = 0
    while checked < 60:
        model, hw, gpus, batch = random_instance(rng)
        expected = brute_force(model, hw, gpus, batch, "bf16")
        if expected is None:
            continue
        sol = search(model, hw, gpus, batch, "bf16")
        assert sol.optimal
        assert sol.estimate.step_time_s == pytest.approx(expected, rel=1e-9)
        checked += 1


def test_roomy_stages_are_placed_in_their_fastest_mode_without_cp_sat(monkeypatch):
    """96 blocks over 4 stages with room for 41 a stage without recompute and 96 with full:
    memory cuts off only loads no optimum wants, so the fastest mode alone places the
    candidate (``search._alone``), proven optimal without CP-SAT, at the step the exact scan
    and CP-SAT prove when that shortcut is off."""
    import importlib
    from autopar.profiles import profile_spec
    from autopar.workflow import read_job
    searching = importlib.import_module("autopar.solve.search")
    job = read_job("gpt:layers=8,hidden=4096,heads=32,vocab=32000,seq=2048", "dgx-a100-80g", 1024, 1024)
    model = dataclasses.replace(profile_spec(job.spec), layers=96)
    pins = Pins(pp=4, tp=2, zero=1, micro_batch=2, schedule="interleaved", virtual_stages=13)
    solves = []
    solve = searching.solve_placement
    monkeypatch.setattr(searching, "solve_placement", lambda *a, **k: solves.append(1) or solve(*a, **k))
    alone = search(model, job.hw, 1024, 1024, "bf16", pins)
    assert alone.optimal and not solves
    assert set(alone.strategy.stage_layers) == {24}  # balance alone: all in one mode
    assert {i for c in alone.strategy.stage_recompute for i, n in enumerate(c) if n} == {0}
    monkeypatch.setattr(searching, "_alone", lambda *a, **k: None)
    scanned = search(model, job.hw, 1024, 1024, "bf16", pins)  # the exact scan places it
    assert scanned.optimal and not solves
    monkeypatch.setattr(searching, "least_step", lambda *a, **k: None)  # the scan gives up
    proven = search(model, job.hw, 1024, 1024, "bf16", pins)
    assert solves and proven.optimal
    for other in (scanned, proven):
        assert alone.estimate.step_time_s == pytest.approx(other.estimate.step_time_s, rel=1e-12)


def test_time_limit_of_zero_still_returns_a_plan_with_an_honest_gap():
    model = gpt_profile(96, 12288, 96, 51200, 2048)
    hw = load_profile("dgx-a100-80g")
    quick = search(model, hw, 256, 512, "bf16", time_limit_s=0.0)
    best = search(model, hw, 256, 512, "bf16")
    assert quick.estimate.fits and 0.0 <= quick.gap < 1.0
    assert best.optimal
    # the proven bound is below the optimum, and the plan no better than it
    assert quick.estimate.step_time_s * (1 - quick.gap) <= best.estimate.step_time_s * (1 + 1e-9)
    assert quick.estimate.step_time_s >= best.estimate.step_time_s * (1 - 1e-9)


def test_pins_fix_their_dimension_and_stay_optimal():
    model, hw = gpt_profile(8, 1024, 16, 32000, 1024), load_profile("dgx-a100-80g")
    pins = Pins(tp=2, recompute="full")
    sol = search(model, hw, 8, 32, "bf16", pins)
    assert sol.strategy.mesh.tp == 2 and sol.strategy.recompute == "full"
    assert sol.estimate.step_time_s == pytest.approx(brute_force(model, hw, 8, 32, "bf16", pins), rel=1e-9)


def test_same_inputs_give_the_same_plan():
    model, hw = gpt_profile(12, 2048, 16, 51200, 2048), load_profile("dgx-a100-80g")
    runs = {search(model, hw, 32, 256, "bf16").strategy for _ in range(3)}
    assert len(runs) == 1


def test_choice_flips_as_memory_shrinks():
    """Plenty of memory: no recompute and parameters not sharded; squeeze it and the plan must
    shard parameters (ZeRO-3) or recompute."""
    model = gpt_profile(24, 4096, 32, 51200, 2048)
    hw = load_profile("dgx-a100-80g")
    roomy = search(model, dataclasses.replace(hw, memory_gib=1000.0), 8, 64, "bf16",
                   Pins(tp=1, pp=1)).strategy
    tight_hw = dataclasses.replace(hw, memory_gib=24.0)
    tight = search(model, tight_hw, 8, 64, "bf16", Pins(tp=1, pp=1))
    assert roomy.zero < 3 and roomy.recompute == "none"
    assert tight.strategy.zero == 3 or tight.strategy.recompute != "none"
    assert tight.estimate.memory.peak_bytes <= tight_hw.memory_bytes
    # Under the roomy plan's choices the tight device would overflow: the flip was forced.
    forced = estimate(model, tight_hw, dataclasses.replace(roomy, stage_layers=(24,)), global_batch=64)
    assert not forced.fits


def test_model_too_big_says_how_many_devices_would_fit():
    model = gpt_profile(96, 12288, 96, 51200, 2048)  # GPT-3 175B
    with pytest.raises(UserError, match=r"needs >= \d+ devices"):
        search(model, load_profile("dgx-a100-80g"), 8, 64, "bf16")


def test_a_sequence_no_device_holds_names_the_sequence_length():
    """More devices cannot split one micro-batch of one sequence: the message names its length
    and the fix, and where the runtime refuses cp for the model, says so."""
    model = gpt_profile(2, 1024, 8, 32000, 8192)
    hw = dataclasses.replace(load_profile("dgx-a100-80g"), memory_gib=1.0, reserve_gib=0.0)
    with pytest.raises(UserError, match=r"holds one sequence of 8,192 tokens; shorten --seq-len or use"):
        search(model, hw, 8, 8, "bf16")
    with pytest.raises(UserError, match=r"runs context parallelism on the built-in gpt/llama models only"):
        search(model, hw, 8, 8, "bf16", Pins(refused=("cp",)))


def test_time_limit_returns_or_explains_and_never_hangs():
    model = gpt_profile(96, 12288, 96, 51200, 2048)
    hw = load_profile("dgx-a100-80g")
    t = time.perf_counter()
    try:
        sol = search(model, hw, 1024, 1536, "bf16", time_limit_s=0.5)
        assert 0.0 <= sol.gap < 1.0 and sol.estimate.fits
    except UserError as exc:
        assert "time-limit" in str(exc)
    assert time.perf_counter() - t < 30  # the candidate scoring is not under the limit


def test_identical_inputs_give_a_byte_identical_plan():
    from autopar.workflow import make_plan, read_job
    job = read_job("gpt:layers=12,hidden=1024,heads=16,vocab=32000,seq=1024", "dgx-a100-80g", 16, 64)
    a, b = make_plan(job)[0].to_json(), make_plan(job)[0].to_json()
    assert a == b


def test_offload_flips_on_as_device_memory_shrinks():
    """Roomy device: no offload (it only adds PCIe copies and a CPU optimizer step). Shrink the
    device below what ZeRO + full recompute need with states on it: offload is what fits."""
    model = gpt_profile(8, 4096, 32, 51200, 2048)
    hw = load_profile("dgx-a100-80g")
    pins = Pins(tp=1, pp=1)
    roomy = search(model, hw, 8, 16, "bf16", pins)
    assert not roomy.strategy.offload
    tight_hw = dataclasses.replace(hw, memory_gib=4.0, reserve_gib=0.0)
    tight = search(model, tight_hw, 8, 16, "bf16", pins)
    assert tight.strategy.offload and tight.strategy.zero >= 1 and tight.estimate.fits
    assert tight.estimate.memory.host_bytes <= tight_hw.host_memory_bytes
    with pytest.raises(UserError):  # without offload nothing fits
        search(model, tight_hw, 8, 16, "bf16", dataclasses.replace(pins, offload=False))
    assert tight.estimate.step_time_s > roomy.estimate.step_time_s


def test_axis_orders_prune_exactly_and_dp_inside_the_node_can_win():
    """On one node every order gives the same groups: only Megatron's is kept. On two nodes,
    tp=2 x dp=8: Megatron's order (tp innermost) puts dp across nodes at 4 NICs x 24 GB/s;
    dp innermost keeps dp on NVLink (230 GB/s) and sends tp over one NIC. With long gradients
    (h = 4096) and short sequences (s = 128, b = 1: tiny tp messages) the dp all-reduce
    dominates, so dp innermost wins under the cost model."""
    from autopar.solve.space import axis_orders
    hw = load_profile("dgx-a100-80g")
    megatrons = Degrees().default_order()  # pp, dp, tp: cp is listed only when cp > 1
    assert axis_orders(hw, Degrees(dp=2, tp=2, pp=2)) == [megatrons]
    orders = axis_orders(hw, Degrees(dp=8, tp=2, pp=1))
    dp_inner = ("pp", "tp", "dp")
    assert orders[0] == megatrons and dp_inner in orders
    model = gpt_profile(4, 4096, 32, 1024, 128)
    base = Strategy(mesh=Degrees(dp=8, tp=2, pp=1), zero=0, micro_batch=1, num_microbatches=1)
    megatron = estimate(model, hw, base, global_batch=8)
    swapped = estimate(model, hw, dataclasses.replace(base, axis_order=dp_inner), global_batch=8)
    assert swapped.step_time_s < megatron.step_time_s
    assert swapped.time.dp_comm_s < megatron.time.dp_comm_s
    assert swapped.time.tp_comm_s > megatron.time.tp_comm_s
    sol = search(model, hw, 16, 8, "bf16", Pins(tp=2, pp=1, zero=0, axis_order=dp_inner))
    assert sol.strategy.axis_order == dp_inner and sol.optimal
    # Unpinned, the search finds it by itself (the order is searched by default).
    free = search(model, hw, 16, 8, "bf16", Pins(tp=2, pp=1, zero=0))
    pinned = search(model, hw, 16, 8, "bf16", Pins(tp=2, pp=1, zero=0, axis_order=DEFAULT_ORDER))
    assert free.optimal and free.strategy.axis_order == dp_inner
    assert free.estimate.step_time_s == pytest.approx(sol.estimate.step_time_s, rel=1e-12)
    assert free.estimate.step_time_s < pinned.estimate.step_time_s
    assert free.candidates > pinned.candidates
    from autopar.solve.explain import describe
    assert describe(free.strategy).endswith(" order=pp>tp>dp") and "order=" not in describe(pinned.strategy)


def test_ties_between_axis_orders_keep_megatrons():
    """On one node every order gives the same groups: the plan keeps Megatron's order."""
    model, hw = gpt_profile(8, 1024, 16, 32000, 1024), load_profile("dgx-a100-80g")
    assert search(model, hw, 8, 32, "bf16").strategy.axis_order == Degrees().default_order()


def test_schedule_group_memory_relaxation_is_below_every_member():
    """``cost_models.bounds.least_memory_costs``: the memory rows of ``stage_costs`` for the 1F1B
    member, every memory and host row of the relaxation at most the member's, for every stage and every mix of blocks; and a group the search rules
    out (``bounds.group_fits``) has no member with a placement within memory (enumerated)."""
    from autopar.solve.bounds import group_fits
    from cost_models.bounds import least_memory_costs
    rng = random.Random(11)
    checked = ruled_out = 0
    for _ in range(40):
        model, hw, gpus, batch = random_instance(rng)
        cap, L = hw.memory_bytes, model.layers
        for cand in outer_candidates(model, hw, gpus, batch, "bf16"):
            st = cand.strategy
            c = stage_costs(model, hw, st)
            rep = least_memory_costs(model, hw, st)
            own = stage_costs(model, hw, dataclasses.replace(
                st, schedule="1f1b", virtual_stages=1, recompute="none"))
            swapped = {f: rep_f for f, rep_f in ((f.name, getattr(rep, f.name)) for f in dataclasses.fields(rep))
                       if f.endswith("_s") or f.endswith("_grad_bytes")
                       or f in ("sum_weight", "max_weight", "nominal", "grads_absent")}
            if rep.grads_absent:  # torch's zero-bubble member's peak, not its 1F1B member's
                swapped["forward_first"] = rep.forward_first
            # the relaxation leaves out the logits the 1F1B member's last stage keeps (not its zero-bubble one's)
            assert own.last_transient_bytes == pytest.approx(rep.last_transient_bytes + memory.stage_output_bytes(
                model, dataclasses.replace(st, schedule="1f1b", virtual_stages=1, recompute="none")), rel=1e-12)
            swapped["last_transient_bytes"] = rep.last_transient_bytes
            assert dataclasses.replace(own, **swapped) == rep
            for s in range(c.pp):
                for n in range(L + 1):
                    for ld in stage_loads(n, (0, 1, 2)):
                        assert rep.stage_memory_bytes(s, ld) <= c.stage_memory_bytes(s, ld) * (1 + 1e-12)
                        assert rep.stage_host_bytes(s, ld) <= c.stage_host_bytes(s, ld) * (1 + 1e-12)
                        assert rep.host_cap_bytes >= c.host_cap_bytes
            checked += 1
            if group_fits(rep, L, (0, 1, 2), cap):
                continue
            ruled_out += 1
            # blocks per stage with some mix that fits (memory and host), then any split
            fit = [{n for n in range(cand.min_layers, L + 1)
                    if any(c.stage_memory_bytes(s, ld) <= cap
                           and c.stage_host_bytes(s, ld) <= c.host_cap_bytes
                           for ld in stage_loads(n, cand.modes))} for s in range(c.pp)]
            reach = {0}
            for s in range(c.pp):
                reach = {a + n for a in reach for n in fit[s] if a + n <= L}
            assert L not in reach, st
    assert checked > 1000 and ruled_out > 50


def candidate_optimum(model, hw, cand, c=None):
    """Least step of one outer candidate over every placement within memory (None if none);
    ``c``: its ``stage_costs`` when the caller has them."""
    c, best = c or stage_costs(model, hw, cand.strategy), None
    p, L = cand.strategy.mesh.pp, model.layers
    if cand.strategy.recipe.uniform_recompute and len(cand.modes) > 1:
        return block_method_optimum(hw, cand, c, L)
    options = [{n: [(c.stage_time_s(s, ld), c.stage_dp_time_s(s, ld))
                     for ld in stage_loads(n, cand.modes)
                     if c.stage_memory_bytes(s, ld) <= hw.memory_bytes
                     and c.stage_host_bytes(s, ld) <= c.host_cap_bytes]
                for n in range(cand.min_layers, L + 1)} for s in range(p)]
    for cuts in itertools.combinations(range(1, L), p - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, L))]
        if min(sizes) < cand.min_layers:
            continue
        for combo in itertools.product(*(options[s][n] for s, n in enumerate(sizes))):
            ts = [t for t, _ in combo]
            step = c.sum_weight * sum(ts) + c.max_weight * max(ts) + max(d for _, d in combo)
            best = step if best is None else min(best, step)
    return best


def block_method_optimum(hw, cand, c, layers):
    """Least step of a candidate of Megatron's block method (``recipe.recompute_block``): the
    blocks split evenly over the stages (the first taking the remainder), each stage's chunks
    as evenly (the first taking the remainder), the first k blocks of every chunk recomputed in
    full and the rest not, over every k within memory."""
    from cost_models.strategy import RECOMPUTE
    st, best = cand.strategy, None
    v = st.virtual_stages if st.schedule == "interleaved" else 1
    p = st.mesh.pp
    sizes = [layers // p + (1 if s < layers % p else 0) for s in range(p)]
    if min(sizes) < cand.min_layers:
        return None
    for k in range(layers + 1):
        loads = []
        for n in sizes:
            full = sum(min(k, n // v + (1 if j < n % v else 0)) for j in range(v))
            loads.append(tuple({"none": n - full, "full": full}.get(m, 0) for m in RECOMPUTE))
        if all(c.stage_memory_bytes(s, ld) <= hw.memory_bytes and c.stage_host_bytes(s, ld) <= c.host_cap_bytes
               for s, ld in enumerate(loads)):
            step = c.step_time_s(tuple(loads))
            best = step if best is None else min(best, step)
    return best


def test_single_mode_least_step_is_the_candidates_optimum():
    """``tables.single_mode_least_step`` (the refined bound of a one-mode candidate) against
    enumeration of the candidate's placements: never above its optimum, and equal to it."""
    from autopar.solve.core import stage_upper_bounds
    from autopar.solve.tables import bottleneck, single_mode_least_step, stage_tables
    rng = random.Random(3)
    checked = 0
    for _ in range(60):
        model, hw, gpus, batch = random_instance(rng)
        pins = Pins(recompute=rng.choice(["none", "selective", "full"])) if rng.random() < 0.5 \
            else Pins()
        for cand in outer_candidates(model, hw, gpus, batch, "bf16", pins):
            if len(cand.modes) != 1:
                continue
            c, L = stage_costs(model, hw, cand.strategy), model.layers
            upper = stage_upper_bounds(c, L, hw.memory_bytes, cand.modes)
            expected = candidate_optimum(model, hw, cand)
            if min(upper) < cand.min_layers or sum(upper) < L:
                assert expected is None
                continue
            t = stage_tables(c, cand.modes, hw.memory_bytes, upper)
            tau = bottleneck(t, L, cand.min_layers)
            got = single_mode_least_step(c, t, L, cand.min_layers, cand.modes[0], tau)
            if expected is None:
                assert got == float("inf")
                continue
            assert got <= expected * (1 + 1e-12)
            assert got == pytest.approx(expected, rel=1e-9)
            checked += 1
    assert checked > 200


def test_exact_scan_is_each_candidates_optimum():
    """``exact.least_step`` (the placement of a candidate whose greedy one misses its bound)
    against enumeration of the candidate's placements, with every recompute mode allowed:
    its least step is the optimum, from no incumbent and from greedy's, and the placement it
    returns attains it."""
    from autopar.solve.core import stage_upper_bounds
    from autopar.solve.exact import least_step
    from autopar.solve.tables import bottleneck, greedy, stage_tables
    rng = random.Random(5)
    checked = improved = 0
    for _ in range(60):
        model, hw, gpus, batch = random_instance(rng)
        model = dataclasses.replace(model, layers=rng.randint(4, 9))
        for cand in outer_candidates(model, hw, gpus, batch, "bf16"):
            if len(cand.modes) == 1 or cand.strategy.mesh.pp > 4:
                continue
            c, L, cap = stage_costs(model, hw, cand.strategy), model.layers, hw.memory_bytes
            upper = stage_upper_bounds(c, L, cap, cand.modes)
            if min(upper) < cand.min_layers or sum(upper) < L:
                continue
            expected = candidate_optimum(model, hw, cand, c)
            t = stage_tables(c, cand.modes, cap, upper)
            tau = bottleneck(t, L, cand.min_layers)
            start = greedy(c, t, L, cand.min_layers, cap, tau)
            incumbents = [float("inf")] + ([c.step_time_s(start)] if start is not None else [])
            for best in incumbents:
                got, loads = least_step(c, t, cand.modes, cap, L, cand.min_layers, tau, best)
                if expected is None:
                    assert got == float("inf") and loads is None
                    continue
                assert got == pytest.approx(expected, rel=1e-9)
                if loads is None:
                    assert best <= expected * (1 + 1e-9)
                    continue
                assert sum(map(sum, loads)) == L and min(map(sum, loads)) >= cand.min_layers
                assert all(c.stage_memory_bytes(s, ld) <= cap for s, ld in enumerate(loads))
                assert c.step_time_s(loads) == pytest.approx(expected, rel=1e-9)
                improved += best < float("inf") and best > expected * (1 + 1e-9)
            checked += expected is not None
    assert checked > 100 and improved > 0


def test_long_sequences_get_cp_where_the_program_has_it():
    """Context parallelism is searched only where the recipe's program has it: a 32K-token job
    plans cp > 1 under Megatron-Core (and the plan's axis order lists cp inside dp); under
    autopar's own recipe cp is searched without pipelining (its runtime does not compose them)
    and not for a model whose attention it cannot replace (``Pins.refused``); not at all below
    ``CP_MIN_SEQ``, nor under a recipe without it."""
    model = gpt_profile(layers=8, hidden=2048, heads=16, vocab=32000, seq=32768)
    hw = load_profile("dgx-h100")
    mc = load_recipe("megatron-core-te")
    # Two sequences on 16 GPUs: data parallelism alone cannot spread them. (At four, TP 4 x DP 4
    # prices 1.7 % faster than CP 2 x TP 2 x DP 4 once Transformer Engine's ring merges count.)
    sol = search(model, hw, 16, 2, "bf16", Pins(recipe=mc))
    assert sol.optimal and sol.strategy.mesh.cp > 1 and sol.estimate.fits
    order = sol.strategy.axis_order
    assert Axis.CP in order and model.seq % (2 * sol.strategy.mesh.cp) == 0
    own = [c.strategy.mesh for c in outer_candidates(model, hw, 16, 4, "bf16")]
    assert any(m.cp > 1 for m in own) and all(m.pp == 1 for m in own if m.cp > 1)
    assert all(c.strategy.mesh.cp == 1 for c in outer_candidates(model, hw, 16, 4, "bf16", Pins(refused=("cp",))))
    short = dataclasses.replace(model, seq=2048)
    assert all(c.strategy.mesh.cp == 1 for c in outer_candidates(short, hw, 16, 4, "bf16", Pins(recipe=mc)))
    assert search(model, hw, 16, 4, "bf16", Pins(cp=2)).strategy.mesh.cp == 2
    with pytest.raises(UserError, match="no context parallelism"):
        search(model, hw, 16, 4, "bf16", Pins(cp=2, recipe=load_recipe("deepspeed")))
    with pytest.raises(UserError, match="built-in gpt/llama models only"):
        search(model, hw, 16, 4, "bf16", Pins(cp=2, refused=("cp",)))


def test_optimal_against_exhaustive_enumeration_with_cp():
    """The brute force covers the cp axis: every order of the four axes, every cp degree of
    the space, under a recipe with context parallelism."""
    rng = random.Random(16)
    mc = load_recipe("megatron-core-te")
    checked = 0
    for _ in range(6):
        heads = rng.choice([4, 8])
        model = gpt_profile(layers=rng.randint(2, 4), hidden=heads * 64, heads=heads, vocab=1024,
                            seq=rng.choice([8192, 16384]))
        gpus = rng.choice([4, 8])
        base = load_profile(rng.choice(["dgx-a100-80g", "dgx-h100"]))
        state_gib = model.params * 18 / 2**30
        hw = dataclasses.replace(base, memory_gib=state_gib * rng.uniform(0.2, 2.0) + 0.5, reserve_gib=0.0,
                                 devices_per_node=rng.choice([2, 4]), host_memory_gib=0.0)
        batch = rng.choice([1, 2])
        expected = brute_force(model, hw, gpus, batch, "bf16", Pins(recipe=mc))
        if expected is None:
            continue
        sol = search(model, hw, gpus, batch, "bf16", Pins(recipe=mc))
        assert sol.optimal and sol.estimate.step_time_s == pytest.approx(expected, rel=1e-9)
        checked += 1
    assert checked >= 3


def moe_profile(layers: int, hidden: int, heads: int, experts: int, topk: int, seq: int,
                vocab: int = 1024) -> ModelProfile:
    """A Mixtral-style MoE's counts: the GPT's attention, ``experts`` SwiGLU experts of width
    2h (3 x h x 2h weights each), top-k routed: their FLOPs those of the routed copies."""
    h, f = hidden, 2 * hidden
    base = gpt_profile(layers, hidden, heads, vocab, seq)
    expert_params = experts * 3 * h * f
    expert_flops = topk * 2.0 * 3 * h * f
    return dataclasses.replace(
        base, name=f"moe-{layers}x{hidden}x{experts}", block_params=4 * h * h + h * experts + expert_params,
        block_matmul_flops_per_token=8.0 * h * h + 2.0 * h * experts + expert_flops,
        block_act_bytes_sharded_per_token=8.0 * h + topk * 6.0 * f,
        fused_act_bytes_sharded_per_token=8.0 * h + topk * 6.0 * f,
        experts=experts, topk=topk, expert_ffn=f, expert_params=expert_params,
        expert_flops_per_token=expert_flops)


def test_optimal_against_exhaustive_enumeration_with_ep():
    """The brute force covers the ep axis: every ep dividing the experts and dp x cp, in every
    axis order (the ep group's tier reads the replicas' place), memory often binding."""
    rng = random.Random(61)
    checked = with_ep = 0
    for _ in range(16):
        heads = rng.choice([4, 8])
        model = moe_profile(layers=rng.randint(2, 4), hidden=heads * 256, heads=heads,
                            experts=rng.choice([4, 8]), topk=rng.choice([1, 2]), seq=rng.choice([512, 2048]))
        gpus = rng.choice([4, 8])
        base = load_profile(rng.choice(["dgx-a100-80g", "dgx-h100"]))
        state_gib = model.params * 18 / 2**30
        hw = dataclasses.replace(base, memory_gib=state_gib * rng.uniform(0.05, 0.6) + 0.5, reserve_gib=0.0,
                                 devices_per_node=rng.choice([2, 4]), host_memory_gib=0.0)
        batch = gpus * rng.choice([1, 2])
        assert {c.strategy.mesh.ep for c in outer_candidates(model, hw, gpus, batch, "bf16")} > {1}
        expected = brute_force(model, hw, gpus, batch, "bf16")
        if expected is None:
            continue
        sol = search(model, hw, gpus, batch, "bf16")
        assert sol.optimal and sol.estimate.step_time_s == pytest.approx(expected, rel=1e-9)
        checked += 1
        with_ep += sol.strategy.mesh.ep > 1
    assert checked >= 6 and with_ep >= 1


def test_ep_with_pipelining_is_searched_as_the_runtime_runs_it():
    """Under autopar's recipe the search emits ep x pp (its runtime composes them under every
    schedule: ``tests/test_runtime_ep.py``), and only what that runtime's predicate lets run."""
    from autopar.plan import runtime_unsupported
    model = moe_profile(layers=4, hidden=512, heads=8, experts=4, topk=2, seq=512)
    hw = load_profile("dgx-h100")
    cands = [c.strategy for c in outer_candidates(model, hw, 8, 16, "bf16")]
    both = {c.schedule for c in cands if c.mesh.ep > 1 and c.mesh.pp > 1}
    assert both >= {"1f1b", "interleaved", "zero-bubble"}
    for c in cands:
        m = c.mesh
        assert runtime_unsupported(dp=m.dp * m.cp, pp=m.pp, zero=c.zero, schedule=c.schedule,
                                   virtual_stages=c.virtual_stages, cp=m.cp, ep=m.ep, offload=c.offload,
                                   moe=True, sequence_parallel=c.sequence_parallel) is None, c


def with_lead(model: ModelProfile, k: int, scale: float) -> ModelProfile:
    """``model`` led by ``k`` dense blocks of ``scale`` times its block's counts (DeepSeek's
    first dense blocks: wider MLPs than the repeated ones' dense part)."""
    per = {f.name: getattr(model, f.name) * scale for f in dataclasses.fields(model)
           if f.name.startswith(("block_", "fused_act_"))}
    per["block_params"] = int(per["block_params"])
    lead = dataclasses.replace(model, name="lead", layers=k, embed_params=0, head_params=0,
                               head_flops_per_token=0.0, tied=False, **per)
    return dataclasses.replace(model, lead=lead)


def test_optimal_against_exhaustive_enumeration_with_leading_blocks():
    """The brute force over models with leading blocks of another kind on the first stage:
    every outer candidate (one recompute mode for the leading blocks, each the candidate
    allows), every placement of the repeated blocks; the memory relaxation of each schedule
    group stays below every member, whatever the leading blocks' mode."""
    from cost_models.bounds import least_memory_costs
    rng = random.Random(16)
    checked, modes = 0, set()
    for _ in range(30):
        model, hw, gpus, batch = random_instance(rng)
        model = with_lead(model, rng.randint(1, 3), rng.uniform(0.5, 3.0))
        for cand in outer_candidates(model, hw, gpus, batch, "bf16"):
            modes.add(cand.strategy.lead_recompute)
            c = stage_costs(model, hw, cand.strategy)
            rep = least_memory_costs(model, hw, cand.strategy)
            for s in range(c.pp):
                for n in range(model.layers + 1):
                    for ld in stage_loads(n, cand.modes):
                        assert rep.stage_memory_bytes(s, ld) <= c.stage_memory_bytes(s, ld) * (1 + 1e-12)
        expected = brute_force(model, hw, gpus, batch, "bf16")
        if expected is None:
            with pytest.raises(UserError, match="does not fit"):
                search(model, hw, gpus, batch, "bf16")
            continue
        sol = search(model, hw, gpus, batch, "bf16")
        assert sol.optimal and sol.estimate.fits
        assert sol.estimate.step_time_s == pytest.approx(expected, rel=1e-9)
        checked += 1
    assert checked >= 15  # most instances are feasible, so the comparison is not vacuous
    assert modes == {"none", "selective", "full"}  # the leading blocks' mode is searched


def test_a_familys_schedule_relaxation_is_below_each_member():
    """``cost_models.bounds.schedule_memory_costs``: for every family of the search (interleaved
    over its chunk range, zero-bubble with its deferred weight passes, GPipe, 1F1B; autopar's
    and Megatron-Core's programs; with leading blocks), every memory and host row is at most
    each member's, for every stage and every mix of blocks; and it is no looser than its schedule
    group's relaxation on any stage, strictly tighter on some stage of most non-1F1B families."""
    import importlib
    from cost_models.bounds import least_memory_costs, schedule_memory_costs
    srch = importlib.import_module("autopar.solve.search")
    rng = random.Random(31)
    checked, tighter, kinds = 0, 0, set()
    for i in range(16):
        model, hw, gpus, batch = random_instance(rng)
        if i % 3 == 1:
            model = with_lead(model, rng.randint(1, 2), rng.uniform(0.5, 3.0))
        model = dataclasses.replace(model, layers=rng.choice([4, 8]))
        pins = Pins(recipe=load_recipe("megatron-core")) if i % 2 else Pins()
        blocks, _, space = srch._ordered(model, hw, gpus, batch, "bf16", pins, hw.memory_bytes)
        for _, order, block, pending in blocks:
            families: list = []
            srch._expand_block(model, hw, block, pending, 0.0, order, space, families, [])
            for _, _, fam, _ in families:
                for off in {off for _, _, off in fam.members}:
                    vs = [v for v, _, o in fam.members if o == off]
                    rep = schedule_memory_costs(model, hw, fam.strategy(vs[0], "", off), (min(vs), max(vs)))
                    group = least_memory_costs(model, hw, fam.strategy(vs[0], "", off))
                    kinds.add((fam.schedule, min(vs) < max(vs)))
                    gain = False
                    for s in range(rep.pp):
                        for ld in stage_loads(model.layers // rep.pp, (0, 1, 2)):
                            assert rep.stage_memory_bytes(s, ld) >= group.stage_memory_bytes(s, ld) * (1 - 1e-12)
                            gain |= rep.stage_memory_bytes(s, ld) > group.stage_memory_bytes(s, ld) * (1 + 1e-9)
                    tighter += gain
                    for v, lead, o in fam.members:
                        if o != off:
                            continue
                        c = stage_costs(model, hw, fam.strategy(v, lead, o))
                        for s in range(c.pp):
                            for n in range(model.layers + 1):
                                for ld in stage_loads(n, fam.modes):
                                    assert rep.stage_memory_bytes(s, ld) <= c.stage_memory_bytes(s, ld) * (1 + 1e-12), \
                                        (fam, v, s, ld)
                                    assert rep.stage_host_bytes(s, ld) <= c.stage_host_bytes(s, ld) * (1 + 1e-12)
                        checked += 1
    assert checked > 300 and tighter > 50
    assert {("interleaved", True), ("zero-bubble", False), ("gpipe", False)} <= kinds


def test_the_state_floor_is_below_every_strategys_memory_rows():
    """``cost_models.bounds.state_floor_bytes`` (weights and optimizer states alone, keyed by
    degrees, ZeRO and offload: ``autopar.solve.bounds._states_hold``) is at most every
    candidate's stage memory for every stage and mix of blocks, whatever its micro-batches,
    SP, schedule, chunks and recompute; dense, MoE and leading-block models, autopar's and
    Megatron-Core's programs; and it rules some candidates out."""
    from cost_models.bounds import state_floor_bytes
    rng = random.Random(47)
    checked = ruled_out = 0
    for i in range(12):
        if i % 4 == 3:
            heads = rng.choice([4, 8])
            model = moe_profile(layers=rng.randint(2, 4), hidden=heads * 256, heads=heads,
                                experts=rng.choice([4, 8]), topk=rng.choice([1, 2]), seq=rng.choice([512, 2048]))
            _, hw, gpus, batch = random_instance(rng)
        else:
            model, hw, gpus, batch = random_instance(rng)
        if i % 3 == 1:
            model = with_lead(model, rng.randint(1, 2), rng.uniform(0.5, 3.0))
        pins = Pins(recipe=load_recipe("megatron-core")) if i % 2 else Pins()
        for cand in outer_candidates(model, hw, gpus, batch, "bf16", pins):
            st = cand.strategy
            first, last, per = state_floor_bytes(model, st)
            c = stage_costs(model, hw, st)
            floor_fits = True
            for s in range(c.pp):
                fixed = (first if s == 0 else 0.0) + (last if s == c.pp - 1 else 0.0)
                floor_fits &= fixed + per <= hw.memory_bytes
                for n in range(model.layers + 1):
                    for ld in stage_loads(n, cand.modes):
                        assert fixed + n * per <= c.stage_memory_bytes(s, ld) * (1 + 1e-12), (st, s, ld)
                checked += 1
            ruled_out += not floor_fits
    assert checked > 1000 and ruled_out > 10


def test_family_bounds_are_below_every_members_optimum_in_every_order():
    """The search's bounds on a block and on a family of candidates (``search._ordered``'s and
    ``_expand_block``'s pass floors, then ``bounds.bound_family``: time floors over the
    leading blocks' modes, the least schedule weights, the least-memory relaxation within device memory, order-free coefficients where
    other axis orders are kept) are never above the optimum of any of its members in any
    axis order, found by enumerating placements; a family bounded at inf has no member that
    fits. Models with and without leading blocks of another kind."""
    import importlib
    from autopar.solve.bounds import bound_family
    srch = importlib.import_module("autopar.solve.search")
    rng = random.Random(23)
    checked = tight = 0
    for i in range(24):
        model, hw, gpus, batch = random_instance(rng)
        if i % 2:
            model = with_lead(model, rng.randint(1, 2), rng.uniform(0.5, 3.0))
        model = dataclasses.replace(model, layers=min(model.layers, 4))
        blocks, _, space = srch._ordered(model, hw, gpus, batch, "bf16", Pins(), hw.memory_bytes)
        for first, order, block, pending in blocks:
            families: list = []
            srch._expand_block(model, hw, block, pending, 0.0, order, space, families, [])
            for floor, _, fam, item in families:
                bound = bound_family(model, hw, fam, bool(item.orders), space)
                for cand in fam.candidates():
                    for axes in (cand.strategy.axis_order, *item.orders):
                        member = dataclasses.replace(cand, strategy=dataclasses.replace(cand.strategy, axis_order=axes))
                        best = candidate_optimum(model, hw, member)
                        if best is None:
                            continue
                        assert max(first, floor, bound) <= best * (1 + 1e-12), (fam, axes)
                        checked += 1
                        tight += bound >= 0.9 * best
    assert checked > 500 and tight > checked // 4  # not vacuous, and the bounds bite


def test_block_floors_are_each_blocks_own_pass_floor():
    """``search._ordered`` computes ``estimate.pass_floor`` once per what it reads (tp, cp, ep,
    their order-free groups, the micro-batch, SP) and hands it to every block with that key:
    each block's floor equals its own, computed alone (dense with cp, MoE with ep, leading blocks)."""
    import importlib
    from autopar.solve.bounds import free_hw
    from cost_models.estimate import pass_floor
    srch = importlib.import_module("autopar.solve.search")
    rng = random.Random(5)
    shared = 0
    for i in range(6):
        if i % 2:
            model = moe_profile(layers=4, hidden=1024, heads=4, experts=8, topk=2, seq=2048)
            hw, gpus, batch = dataclasses.replace(load_profile("dgx-h100"), devices_per_node=4), 32, 64
        else:
            model, hw, gpus, batch = random_instance(rng)
            model = with_lead(dataclasses.replace(model, seq=16384), 1, 2.0)
        blocks, _, space = srch._ordered(model, hw, gpus, batch, "bf16", Pins(), hw.memory_bytes)
        seen = set()
        for _, _, block, pending in blocks:
            hw_b, order = free_hw(space, hw, block.mesh)
            for sp, floor in pending.floors:
                alone = pass_floor(model, hw_b, Strategy(
                    mesh=block.mesh, micro_batch=block.micro_batch, num_microbatches=block.num_microbatches,
                    sequence_parallel=sp, dtype="bf16", axis_order=order, recipe=load_recipe()))
                assert floor == alone, (block, sp)
                shared += (block.mesh.tp, block.mesh.cp, block.mesh.ep, block.micro_batch, sp) in seen
                seen.add((block.mesh.tp, block.mesh.cp, block.mesh.ep, block.micro_batch, sp))
    assert shared > 50  # floors were handed on, not only computed


def test_a_strategy_summary_counts_every_recompute_mode():
    """``describe`` names the blocks of each mode, per-op recompute included (n, s, f, o)."""
    from autopar.solve.explain import describe
    s = Strategy(mesh=Degrees(pp=2), stage_layers=(3, 3), stage_recompute=((1, 1, 0, 1), (0, 0, 2, 1)))
    assert " rc=1n/1s/2f/2o" in describe(s)


def test_per_op_recompute_is_never_planned_under_the_zero_bubble_schedule():
    """The zero-bubble schedule backpropagates through a block twice, which torch's selective
    checkpointing refuses: its families never hold per-op blocks, and pinning both says why."""
    from autopar.spec import parse_model_spec
    from autopar.trace import profile_spec
    model = profile_spec(parse_model_spec("llama:layers=8,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000,seq=4096"))
    hw = load_profile("dgx-a100-40g")
    sol = search(model, hw, 8, 32, "bf16", Pins(pp=4, schedule="zero-bubble"))
    assert not any(c[3] for c in sol.strategy.stage_recompute) and sol.strategy.recompute != "op"
    with pytest.raises(UserError, match="zero-bubble schedule"):
        search(model, hw, 8, 32, "bf16", Pins(pp=4, schedule="zero-bubble", recompute="op"))


def test_zero_bubble_is_not_planned_with_full_recompute():
    """torch's split backward (``stage_backward_input``, then ``stage_backward_weight`` per
    parameter group) recomputes a non-reentrant checkpointed block once in the input pass and
    again for each of its parameter groups in the weight pass: three forwards of a block of two
    linear layers where one is priced (measured 1.5-2.9 x the priced step on the CPU ranks of
    ``benchmarks/plan_quality.py --spread``). The search plans no such candidate and says why
    when both are pinned."""
    import torch
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from autopar.solve.infeasible import ZB_FULL

    calls = []

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            calls.append(1)
            return x + self.b(torch.relu(self.a(x)))

    blocks = nn.Sequential(*[checkpoint_wrapper(Block(), checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                             for _ in range(2)])
    x = torch.randn(4, 8, requires_grad=True)
    out = blocks(x)
    calls.clear()
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], blocks.parameters())
    assert len(calls) == 2  # the input pass: one recompute a block
    stage_backward_weight(blocks.parameters(), groups)
    assert len(calls) > 2 * 2  # the weight pass recomputes again, per parameter group

    model, hw = gpt_profile(8, 1024, 16, 32000, 2048), load_profile("dgx-a100-80g")
    hw = dataclasses.replace(hw, memory_gib=6.0, reserve_gib=0.0)  # tight: recompute pays
    zb = [c.strategy.recompute for c in outer_candidates(model, hw, 8, 16, "bf16")
          if c.strategy.schedule == "zero-bubble"]
    assert zb and "full" not in zb  # zero-bubble is planned, in its other modes
    with pytest.raises(UserError) as err:
        search(model, hw, 8, 16, "bf16", Pins(pp=2, schedule="zero-bubble", recompute="full"))
    assert str(err.value) == ZB_FULL


def test_memory_rows_are_the_stage_methods_to_the_bit():
    """``StageCosts.memory_rows`` (the solver's one-pass memory rows) equals
    ``stage_fixed_bytes`` and ``block_bytes`` exactly, for every schedule the candidates of
    random instances have (1F1B, interleaved, GPipe, zero-bubble: pending passes, forward-first
    stages, gradient-free peaks)."""
    rng = random.Random(11)
    seen = {"pending": 0, "forward_first": 0, "grads_absent": 0}
    for _ in range(25):
        model, hw, gpus, batch = random_instance(rng)
        for cand in outer_candidates(model, hw, gpus, batch, "bf16"):
            c = stage_costs(model, hw, cand.strategy)
            for key in seen:
                seen[key] += bool(getattr(c, key))
            for modes in (cand.modes, (0, 1, 2, 3)):
                assert c.memory_rows(modes) == [
                    (c.stage_fixed_bytes(s), tuple(c.block_bytes(s, r) for r in modes)) for s in range(c.pp)]
    assert min(seen.values()) > 0, seen


def test_the_exact_scan_enumerates_only_the_mixes_a_stage_can_hold():
    """A stage's mixes are the C(u + k, k) count vectors summing to at most u, in the order the
    (u + 1)^k grid lists them, so ``MIXES`` counts what the scan builds."""
    import numpy as np
    from autopar.solve.exact import _mixes
    for u, k in ((0, 1), (7, 1), (3, 2), (5, 3), (12, 4)):
        grid = np.indices((u + 1,) * k).reshape(k, -1).T
        assert np.array_equal(_mixes(u, k), grid[grid.sum(axis=1) <= u])
