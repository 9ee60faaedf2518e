"""solve: the best plan the cost model knows, for a model, a cluster and a global batch.

Search = an outer enumeration of the discrete strategy (``space.outer_candidates``) visited in
order of a lower bound, and for each visited candidate an exact placement of the blocks on the
pipeline stages with per-block recompute: greedy when it meets the candidate's bound, else an
exact scan (``exact.least_step``), else (the scan gives up) a CP-SAT model
(``core.solve_placement``).

Outer space (``space``): tp | gpus with tp dividing the devices per node (a tp group never
straddles nodes) and the attention and kv heads; cp | gpus/tp (context parallelism: only
under a recipe that has it, for seq ≥ 8192 with seq % 2cp = 0 and ≥ 4096 tokens per rank,
``space.cp_degrees``); pp | gpus/(tp·cp) with pp ≤ layers; dp = gpus/(tp·cp·pp) dividing the
global batch B; micro-batch b | B/dp, m = B/(dp·b) micro-batches
(m ≥ pp when pp > 1); ZeRO 0-3 (0 when dp = 1); schedule 1F1B, GPipe, interleaved with
v = 2 … L/pp chunks (m a multiple of pp) and zero-bubble (pp > 1); sequence parallelism
(tp > 1); CPU offload (ZeRO ≥ 1); the rank order of the mesh axes (``Strategy.axis_order``, a
permutation of pp, dp, tp, and cp when cp > 1, outermost first), every order not dominated group by group by one
kept before it (``space.axis_orders``: exact; Megatron's first, and the only one on one node).
Combinations ``autopar.plan.runtime_unsupported`` refuses are skipped. Any dimension
may be pinned (``Pins``). Recompute is chosen per block by the inner model, except under
zero-bubble (its fill fraction depends on the mode, ``cost_models.pipeline``): there the outer
loop enumerates one mode for every block. A pinned ``recompute`` applies to every block.

Inner model (``core``; coefficients from ``cost_models.stage_costs``, formulas in
``cost_models.stages``), with R the allowed recompute modes:

    variables   n[s][r] ∈ [0, U_s]   blocks of stage s in mode r          (_add_count_vars)
                u[s][r] ∈ {0, 1}     stage s uses mode r (r with workspace) (_add_memory)
                T ≥ T_s, D ≥ D_s     slowest stage, worst gradient tail   (_add_time_terms)
    constraints Σ_s Σ_r n[s][r] = L;  v ≤ Σ_r n[s][r] ≤ U_s                (_add_count_vars)
                  (v: one block per interleaved chunk; U_s: ``stage_upper_bounds``, the most
                  blocks stage s holds in its leanest mode alone, a valid cut)
                M_s(n[s]) + W_r u[s][r] ≤ memory, n[s][r] = 0 unless u[s][r]   (_add_memory)
                middle stages ordered when interchangeable                (_add_symmetry_breaking)
                cuts from the stage tables (below): T ≥ τ*, and per stage
                Σ_r t_r n[s][r] ≥ g_s(Σ_r n[s][r]) as an element constraint   (_add_table_cuts)
                  (both lowered by the nanosecond rounding, so valid for the integer model)
    objective   min  sum_weight · Σ_s T_s + max_weight · T + D              (solve_placement)

Working with counts of identical blocks per stage and mode, not one variable per block, is
what makes the model small (3p integers for L blocks) and fast to prove optimal.
Times are integer nanoseconds, bytes rounded conservatively; the chosen placement is
re-evaluated in float with ``StageCosts.step_time_s``.

Stage tables (``tables``): g_s(N), the least block time of N blocks on stage s within its
memory row, exact for every N (two modes in closed form, the third enumerated, per subset of
modes for the workspace term). They give τ*, the exact least bottleneck max_s T_s (a search over
the table values), and a greedy placement attaining it (fill every stage to its most blocks
within τ*, take blocks off where the marginal time is largest, fastest mix per stage).

Pruning (``search``): before any candidate is costed, a schedule group (the candidates that
differ only in schedule, chunks and recompute) whose least-memory relaxation cannot hold the
model (``cost_models.bounds.least_memory_costs``: 1F1B's in-flight micro-batches, the fewest of
any schedule, and every recompute mode; ``core.stage_upper_bounds``) is dropped whole, in every
axis order: exact, since memory reads no order and grows with the in-flight count. A family
of candidates (one schedule, its chunk counts) whose group bound comes up is bounded again with
its own schedule's rows (``cost_models.bounds.schedule_memory_costs``: interleaved in flight at
its least over the chunks, torch zero-bubble's deferred weight passes), far tighter than 1F1B's.
``lower_bound`` (every block at its fastest allowed mode, slowest stage ≥ mean) orders the
candidates; a candidate is then refined with its memory-aware bound:
sum_weight · max(LP bound on Σ T_s, least Σ T_s of the tables (a min-plus convolution))
+ max_weight · max(mean, τ*) + max(mean D, every stage's fixed tail plus its fewest blocks);
for a candidate with one recompute mode (zero-bubble, a pinned mode) Σ T_s is fixed and the
bound is its exact optimum (``tables.single_mode_least_step``: for each slowest-stage time
τ ≥ τ*, the least worst tail D by a bottleneck search), so its greedy placement, when optimal,
is proven without CP-SAT. A candidate with several modes is solved as one in its fastest mode
f (no slower in T nor in D) where memory cannot make the modes trade (``search._alone``): every
placement moved to f fits and costs no more unless a stage holds more blocks than f allows,
and the bound on such placements (that stage's table time raising τ) is no lower than a
placement in f alone. Roomy stages, the usual case, are so placed by balance alone.
Offload candidates borrow the bound of their twin without offload (never faster) until popped.
The other kept axis orders of a candidate wait behind one heap item keyed by an order-free
bound: its costs with every axis in the best group any order gives it (adjacent ranks:
``space.order_free_hardware``; every cost is monotone in the groups), refined with its memory
rows (memory reads no order: no order fits when Megatron's does not); only when that LP bound
is below the incumbent are the orders costed and pushed one by one. Once the bound reaches
the incumbent (or the ``keep``-th best, for alternatives) the rest are pruned. A candidate whose
greedy placement meets its bound is optimal as it stands; otherwise the exact scan
(``exact``: for each slowest-stage time τ ≥ τ* and worst tail δ, the least Σ T_s of the
stages' (block time, tail) Pareto mixes within τ and δ, a min-plus convolution; stopped where
a bound on the rest reaches the best step) proves greedy's or finds the optimum, usually in
milliseconds; where it gives up (``exact.BUDGET``, ``exact.MIXES``), CP-SAT, seeded with the
greedy placement (``AddHint``), proves or improves it within ``search.EFFORT`` deterministic
seconds, after which the candidate keeps its best placement and its proven bound (the greedy
one is also the fallback when CP-SAT finds nothing). The plan's gap is measured against the
least bound left open. A time limit stops the loop and returns the best plan with its proven
gap. CP-SAT runs with one worker and a fixed seed and is capped in deterministic time, and ties
keep the first candidate in the fixed order (every candidate in Megatron's axis order before
any in another), so identical inputs give an identical plan. ``infeasible`` explains a search with no plan; ``explain`` a plan's choices.
"""

from autopar.solve.core import Placement, solve_placement
from autopar.solve.explain import Explanation, describe, explain, explanation_dict
from autopar.solve.bounds import lower_bound
from autopar.solve.search import Alternative, Solution, placed_strategy, search
from autopar.solve.space import Candidate, Pins, candidates, outer_candidates

__all__ = ["Alternative", "Candidate", "Explanation", "Pins", "describe", "explain",
           "explanation_dict", "Placement", "Solution", "candidates",
           "lower_bound", "outer_candidates", "placed_strategy", "search", "solve_placement"]
