"""The cost model against every published run we hold (benchmarks/published), priced through the
CLI's own path under each framework's execution recipe (benchmarks/validate_rows.py).

Thresholds of the cost-model issue: over all rows median |error| <= 5 % and max <= 15 %;
leave-one-source-out median <= 8 %; every run a source reports must be predicted to fit;
Korthikanti et al. Table 5 from the CLI with ``--recipe megatron-core``: mean <= 2 %, max <= 4 %.
The max threshold is not met yet: ``test_worst_row_within_15_percent`` is a strict xfail that
names the rows over it, so the day they come under it this file says so.
"""

import json
import statistics
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import validate_rows as validate  # noqa: E402

from autopar.cli import app  # noqa: E402
from cost_models.hardware import available_profiles, load_profile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCES = validate.load_sources()
MODELS = validate.Models()


@pytest.fixture(scope="module")
def in_sample():
    return validate.evaluate(SOURCES, {}, MODELS)


def test_every_expressible_row_is_priced_and_the_rest_say_why(in_sample):
    priced = validate.priced(in_sample)
    assert len(priced) >= 250
    assert all(r.why for r in in_sample if r.predicted is None)
    assert not [r for r in in_sample if r.why.startswith("error")]


def test_every_published_run_is_predicted_to_fit(in_sample):
    nofit = [f"{r.source} {r.row.id}" for r in validate.priced(in_sample)
             if not r.fits and not validate.MEMORY_APPROXIMATED & set(r.row.needs)]
    assert nofit == []


def test_median_error_over_all_rows_within_5_percent(in_sample):
    errors = [abs(r.error) for r in validate.priced(in_sample)]
    assert statistics.median(errors) <= 5.0


@pytest.mark.xfail(strict=True, reason="known misses (positive: predicted too fast): llm-foundry "
                   "rows that disagree with their own table's neighbours (A100 80GB MPT-760M at seq "
                   "512/1024 +28/+21 % while seq 2048 and the same shapes on H100 fit; A100 40GB "
                   "MPT-1B on 32 GPUs +24 % between 16 and 64 GPUs at 55 % MFU; MPT-70B on 64 A100 "
                   "40GB +28 %; H100 MPT-760M at seq 2048 on 8 GPUs +16 % where 16 and 32 GPUs are "
                   "+5 %) and MPT-30B at seq 8192 on both A100 and H100 (+24/+24 %: per token "
                   "41 % slower than seq 4096 where attention adds 5 %, at ~71 of 79 GiB priced), "
                   "MT-NLG 420 nodes (-15.0 % in step time), and torchtitan on Meta's 500 W Grand Teton "
                   "H100 (torch's context parallelism for Llama-3 8B at cp 4 and 8 +26/+31 % where cp 2 "
                   "is -6 %, and 405B at cp 8 +19 %), and Megatron-Bridge's GPT-OSS 120B on 64 H100 "
                   "and 64 B200 (+44/+43 %, its 128-token windows run by Transformer Engine: the mixture-of-experts rows autopar can express, checks never "
                   "fitted on); "
                   "NeMo 24.07's FP8 rows are within 12.3 % since Transformer Engine's CP merges are priced")
def test_worst_row_within_15_percent(in_sample):
    worst = max(validate.priced(in_sample), key=lambda r: abs(r.error))
    assert abs(worst.error) <= 15.0, f"{worst.source} {worst.row.id}: {worst.error:+.1f} %"


def test_rows_their_own_source_contradicts_are_named_from_the_published_values_alone():
    """``published_rows.contradicted``: a run more than 5 % slower per GPU than one of its own
    source that physics says is no faster (as many GPUs or more, sequences as long or longer, no
    larger micro-batches, no more of them) is named, whatever any prediction says; the rule
    reads nothing but the published values. Four llm-foundry rows are, all four among the
    worst priced (above); a run faster on fewer GPUs, or faster by the tolerance only, is not."""
    import dataclasses

    from published_rows import contradicted

    named = {(src.source, rid) for src in SOURCES for rid in contradicted(src)}
    assert named == {("llmfoundry", "760m-s2048-g8-h100-bf16-mb24"), ("llmfoundry", "760m-s1024-g8-a100-bf16-mb48"),
                     ("llmfoundry", "760m-s512-g8-a100-bf16-mb96"), ("llmfoundry", "1b-s2048-g32-a100-bf16-mb10")}
    src = next(s for s in SOURCES if s.source == "llmfoundry")
    a = next(r for r in src.rows if r.id == "13b-s2048-g8-h100-bf16-mb2")
    wide = dataclasses.replace(a, id="wide", gpus=16, dp=16, global_batch=a.global_batch * 2)
    for value, flagged in ((a.value * 1.06, True), (a.value * 1.04, False)):
        alone = dataclasses.replace(src, rows=(a, dataclasses.replace(wide, value=value)))
        assert ("13b-s2048-g8-h100-bf16-mb2" in contradicted(alone)) is flagged
    # the run on fewer GPUs being the faster one is what physics expects
    assert contradicted(dataclasses.replace(src, rows=(a, dataclasses.replace(wide, value=a.value * 0.8)))) == {}


@pytest.fixture(scope="module")
def memory():
    import published_memory
    return published_memory.memory_results(SOURCES, MODELS)


def test_every_published_out_of_memory_run_is_predicted_not_to_fit(memory):
    """The runs a source reports ran out of memory (torchtitan: Llama-2 70B at local batch 2
    with per-op AC on 64 A100 80GB; Llama-3.1 405B under FSDP alone on 128 H100) are
    predicted not to fit, and the peaks reported next to them are priced."""
    oom = [m for m in memory if m.row.metric == "out_of_memory"]
    assert len(oom) >= 2 and [f"{m.source} {m.row.id}" for m in oom if m.fits] == []
    assert len([m for m in memory if m.row.memory_gib is not None]) >= 20


def test_a_compiled_loss_keeps_16_bit_logits(memory):
    """torchtitan compiles its loss with its blocks since April 2025 (not at the December 2024
    commit of the Grand Teton tables): Inductor's fused cross-entropy keeps the 16-bit logits,
    not fp32 log-probabilities. Priced so (``torchtitan-compile``), the H200 runs' reported
    peaks (Llama-3 8B, local batch 2, 32 and 64 GPUs) are within 5 %; priced with the eager
    loss (``torchtitan-compile-eager-loss``) they would be 29 % over."""
    h200 = [m for m in memory if m.source == "torchtitan_h200"]
    assert len(h200) == 2 and all(abs(m.error) < 5.0 for m in h200)
    row = h200[0].row
    model = MODELS.get(row.model, row.seq_len)
    eager = validate.row_strategy(row, model.layers, "torchtitan-compile-eager-loss")
    from cost_models import estimate
    peak = max(estimate(model, load_profile(row.cluster), eager, global_batch=row.global_batch).stage_peak_bytes)
    assert peak / 2**30 > row.memory_gib * 1.2


@pytest.mark.xfail(strict=True, reason="torchtitan's reported peaks (max reserved, expandable "
                   "segments) of December 2024 are 2-27 % above the priced peak (allocated): the "
                   "405B pipelines (1F1B -25 %, 4D -18 to -27 %, interleaved -1 %), eager mode "
                   "(8B -13 % where compiled -2 to -8 %), 70B 2D -9 %; the June 2025 H200 runs, "
                   "with the loss compiled, are within 4 %")
def test_every_reported_peak_within_15_percent(memory):
    worst = max((m for m in memory if m.row.memory_gib is not None), key=lambda m: abs(m.error))
    assert abs(worst.error) <= 15.0, f"{worst.source} {worst.row.id}: {worst.error:+.1f} %"


def test_shipped_constants_are_the_fit():
    """``validate_rows.py --fit`` reproduces the profiles' fitted constants (so a change to
    the model or the data that moves the fit fails here until the profiles are refitted)."""
    hws = validate.fit(SOURCES, MODELS)
    for names in validate.FAMILIES.values():
        shipped = validate.constants(validate.load_profile(names[0]))
        refit = validate.constants(hws[names[0]])
        assert refit == pytest.approx(shipped), names[0]


def test_carried_over_constants_are_the_source_profiles():
    """A profile whose note says a constant is carried over from another profile holds that
    profile's value (a refit of dgx-h100 reaches Grand Teton, H200, H800 and B200 with it)."""
    carried = 0
    for name in available_profiles():
        hw = load_profile(name)
        for key, note in hw.notes.items():
            if note.startswith("carried over from "):
                src = load_profile(note.split()[3])
                assert getattr(hw, key) == getattr(src, key), (name, key)
                carried += 1
    assert carried >= 15


def test_dgx_h100_ships_the_laws_its_gpu_measured():
    """The shape, sequence and head-dimension laws and the Float8 ratio in dgx-h100 (not fitted
    to the rows) are what ``gpu_kernels.py --pool`` fits to the stored H100 runs."""
    import gpu_kernels
    hw = load_profile("dgx-h100")
    measured = ROOT / "benchmarks" / "measured"
    runs = [json.loads(p.read_text()) for p in sorted(measured.glob("gpu_kernels_h100_*.json"))]
    assert len(runs) >= 3
    laws = gpu_kernels.fit_laws(runs, hw)
    assert (hw.matmul_half_dim, hw.matmul_half_depth) == (laws["bf16"]["half_dim"], laws["bf16"]["half_depth"])
    assert hw.fp8_matmul_half_depth == laws["fp8"]["half_depth"]
    ratio = validate.TIED["H100"]["fp8_matmul_efficiency"][1]
    assert ratio == round(laws["fp8"]["efficiency"] / laws["bf16"]["efficiency"], 3)
    seq = gpu_kernels.seq_laws(runs)
    for kernel, backend in (("cudnn", "CUDNN_ATTENTION"), ("flash2", "FLASH_ATTENTION")):
        e, half, _, _ = seq[backend]
        assert hw.attention_half_seq[kernel] == half and hw.attention_eff(kernel) == round(e, 2)
    heads = gpu_kernels.head_laws(runs)
    for kernel, backend in (("cudnn", "CUDNN_ATTENTION"), ("flash2", "FLASH_ATTENTION")):
        ratio, half = heads[backend]
        assert hw.attention_half_head_dim[kernel] == round(half, 1)
        assert hw.attention_eff(kernel, 2048, 64) / hw.attention_eff(kernel, 2048) == pytest.approx(ratio, abs=1e-3)


@pytest.fixture(scope="module")
def held_out():
    return validate.loso([s for s in SOURCES if any(not validate.skip_reason(s, r) for r in s.rows)],
                         MODELS)


def test_leave_one_source_out_median_within_8_percent(held_out):
    """Held out, llm-foundry (the only source that ran FlashAttention's Triton kernel) prices it
    at flash2's efficiency over its documented slowdown (``validate_rows.KERNEL_PRIORS``): no
    long-sequence row is off by more than a third (it was 2.4x with flash2's own efficiency)."""
    errors = [abs(r.error) for r in validate.priced(held_out)]
    assert statistics.median(errors) <= 8.0
    assert max(abs(r.error) for r in validate.priced(held_out) if r.source == "llmfoundry") <= 33.0


def test_leave_one_source_out_every_source_but_the_single_h100_one_within_8_percent(held_out):
    """Every source whose chip other sources also measured stays within 8 % (median) held out,
    and the held-out error of the Megatron-era sources stays within their own thresholds."""
    by = {}
    for r in validate.priced(held_out):
        by.setdefault(r.source, []).append(abs(r.error))
    assert statistics.median(by["torchtitan_a100"]) <= 8.0
    assert max(by["korthikanti2022_t5"]) <= 4.0 and max(by["narayanan2021_t1"]) <= 5.0


KORTHIKANTI = [  # Table 3 / Table 5: layers, hidden, heads, tp, pp, batch, mbs, vpp, full s, sel+SP s
    (48, 6144, 64, 8, 1, 4, 4, 1, 1.42, 1.10), (96, 12288, 96, 8, 8, 64, 1, 3, 18.13, 13.75),
    (105, 20480, 128, 8, 35, 280, 1, 3, 49.05, 37.83), (128, 25600, 160, 8, 64, 512, 1, 1, 94.42, 71.49),
]


def test_korthikanti_table5_from_the_cli_with_the_megatron_core_recipe():
    runner, errors = CliRunner(), []
    for layers, h, a, tp, pp, batch, mbs, vpp, full_s, sel_s in KORTHIKANTI:
        for rc, sp, published in (("full", "--no-sp", full_s), ("selective", "--sp", sel_s)):
            args = ["estimate", "--model", f"gpt:layers={layers},hidden={h},heads={a},vocab=51200,seq=2048",
                    "--cluster", "dgx-a100-80g", "--gpus", str(tp * pp), "--global-batch", str(batch),
                    "--tp", str(tp), "--pp", str(pp), "--mbs", str(mbs), "--recompute", rc, sp,
                    "--recipe", "megatron-core", "--json"]
            if vpp > 1:
                args += ["--schedule", "interleaved", "--vpp", str(vpp)]
            out = runner.invoke(app, args)
            assert out.exit_code == 0, out.output
            errors.append(abs(json.loads(out.output)["step_time_s"] / published - 1) * 100)
    assert statistics.fmean(errors) <= 2.0 and max(errors) <= 4.0, errors


def test_llama3_8b_fsdp_on_8_h100_fits_without_recompute_and_the_pick_is_no_slower():
    """torchtitan trains Llama-3 8B at seq 8192 with FSDP over 8 H100 at local batch 1-2 in
    well under 80 GB; autopar's own program (the default recipe) must fit there, and the
    planner must pick pure data parallelism, as every measured peer does."""
    runner = CliRunner()
    out = runner.invoke(app, ["estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                              "--global-batch", "8", "--dp", "8", "--zero", "3", "--mbs", "1",
                              "--recompute", "none", "--json"])
    assert out.exit_code == 0, out.output
    est = json.loads(out.output)
    assert est["fits"] and est["memory"]["peak_bytes"] < 70 * 2**30
    out = runner.invoke(app, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                              "--global-batch", "16", "--seq-len", "8192", "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    plan = result["plan"]
    # No pipeline. Since the loss's backward is priced as an H100 ran it (12 bytes per logit at
    # its peak: 11.7 GiB for 8,192 tokens of a 128K vocabulary), ZeRO 1-2 over dp 8 without
    # recompute no longer fit; ZeRO 3 over dp 8 does (above), and tp 2 x dp 4 ZeRO 2 is priced
    # 3.5 % faster than it. Peers fit dp 8 with per-op selective checkpointing, not expressible here.
    assert plan["mesh"]["pp"] == 1 and plan["mesh"]["dp"] * plan["mesh"]["tp"] == 8 and result["estimate"]["fits"]
    fsdp = runner.invoke(app, ["estimate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8",
                               "--global-batch", "16", "--seq-len", "8192", "--dp", "8", "--tp", "1", "--pp", "1",
                               "--zero", "3", "--mbs", "1", "--recompute", "none", "--json"])
    assert json.loads(fsdp.output)["fits"]
    assert result["estimate"]["step_time_s"] <= json.loads(fsdp.output)["step_time_s"]
    assert plan["recipe"] == "autopar"
