"""Prove each parallel dimension on a tiny twin of the model before any plan uses it.

A *twin* is the same architecture (the same config class and options: norms, activations,
biases, packed projections, MQA/GQA ratio, tied head) at toy size: 2 blocks, 4 query heads of
16 features, ffn 128, vocabulary 128, no dropout. Each :class:`Check` is a 2-rank plan of the
twin on gloo, trained for ``STEPS`` plain SGD steps beside one process on the same global
batch: the losses and every updated weight must agree. SGD makes a weight's change exactly
``-lr·g``, so equal weights mean equal gradients (AdamW's ``g/(|g|+ε)`` turns entries whose
true gradient is zero into noise-sized steps of size lr).

A user module (``path/to/file.py:factory``) cannot be resized: its twin is the factory itself,
at its own size and number of blocks, trained on sequences of ``TWIN_SEQ`` tokens (fewer if
the factory's are shorter); its cache key also covers the Python files under the factory's
directory.

Three checks prove a pair of features together (``COMPOSED``: TP with selective recompute, SP
with full and with per-op recompute), each found failing where both features alone passed.

A dimension that crashes or differs is refused: :func:`verify` says which and why in one line,
the planner leaves it out of the search (``Verification.pins``) and ``explain`` shows the
reason. Verdicts are cached per architecture (the twin's spec, autopar's and torch's versions)
under ``$AUTOPAR_CACHE`` (default ``~/.cache/autopar``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from autopar.errors import UserError
from autopar.limits import shown
from autopar.spec import ModelSpec, parse_model_spec

TWIN_LAYERS = 2
TWIN_HEADS = 4
TWIN_HEAD_DIM = 16
TWIN_FFN = 128
TWIN_VOCAB = 128
TWIN_SEQ = 16
TWIN_MAX_EXPERTS = 32
"""Routed experts of a twin at most (halved from the real count)."""
MLA_KEYS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank")
"""Widths of DeepSeek's multi-head latent attention, scaled with the twin's head."""
LEAD_KEYS = ("first_k_dense_replace", "moe_layer_start_index")
"""HF config fields counting a model's leading dense blocks before its mixture-of-experts ones
(DeepSeek-V3, GLM-4.5; Ernie 4.5): the twin keeps one."""
TWIN_BATCH = 4
"""Global batch of every check (sequences of ``TWIN_SEQ`` tokens)."""
STEPS = 2
LR = 0.1
"""SGD learning rate of the checks: large enough that ``lr·g`` stands well above float32
rounding of the weights."""
LOSS_TOL = 1e-5
"""Absolute loss tolerance (fp32; a wrong layout is off by 1e-3 to 1e-1)."""
GRAD_REL_TOL = 1e-3
"""Per weight tensor: max |w - w_ref| <= GRAD_REL_TOL * max |w_ref - w_0| + GRAD_ABS_TOL."""
GRAD_ABS_TOL = 1e-6


class Check(StrEnum):
    """A parallel dimension (or runtime feature) the twin proves."""

    DP = "dp"
    """FSDP2 (ZeRO-3) over 2 ranks."""
    TP = "tp"
    """Tensor parallelism over 2 ranks."""
    SP = "sp"
    """Tensor parallelism with sequence parallelism."""
    PP = "pp"
    """Two pipeline stages (1F1B)."""
    SELECTIVE = "selective"
    """Selective recompute of the attention core."""
    OP = "op"
    """Per-op selective recompute (every second GEMM's output kept)."""
    TP_SELECTIVE = "tp+selective"
    """Tensor parallelism with selective recompute: the attention core's recompute reads what
    TP shows the forward (GPT-OSS's sinks: the rank's heads)."""
    SP_FULL = "sp+full"
    """Sequence parallelism with full recompute over 2 micro-batches: a recompute stopped early
    must leave the next micro-batch the weights SP shows (a mixture of experts' local views)."""
    SP_OP = "sp+op"
    """Sequence parallelism with per-op recompute (its policy over TP's DTensor ops and SP's
    collectives)."""


COMPOSED = {Check.TP_SELECTIVE: ("tp", "selective"), Check.SP_FULL: ("sp", "full"), Check.SP_OP: ("sp", "op")}
"""Each pair of features a check proves together (``Plan.features``: a plan using both needs it),
found failing where each feature alone passed (``benchmarks/hf_compositions.py``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    check: Check
    ok: bool
    reason: str = ""
    """Why it failed (one line), empty when it passed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verification:
    """The verdicts of one architecture's twin."""

    model: str
    """The model's spec as the user wrote it."""
    twin: str
    """The twin's spec (what ran)."""
    verdicts: tuple[Verdict, ...]

    def allows(self, check: Check) -> bool:
        return all(v.ok for v in self.verdicts if v.check == check)

    def refusals(self) -> dict[str, str]:
        """``{check: one-line reason}`` of each failed check."""
        return {v.check.value: v.reason for v in self.verdicts if not v.ok}


def _hf_keys(config: object) -> dict[str, str]:
    """The config's own attribute name for each shape field (``hf._KEYS``, first present)."""
    from autopar.hf import _KEYS
    present = config.to_dict()  # type: ignore[attr-defined]
    return {field: next(k for k in keys if k in present) for field, keys in _KEYS.items()
            if any(k in present for k in keys)}


def twin_kv_heads(spec: ModelSpec) -> int:
    """The twin's key/value heads: MHA stays MHA, MQA stays MQA, GQA becomes 2 groups of 2."""
    if spec.num_kv_heads == spec.heads:
        return TWIN_HEADS
    return 1 if spec.num_kv_heads == 1 else 2


def _twin_widths(size: dict[str, int]) -> set[int]:
    """Output widths of the twin's dense GEMMs (hidden, FFN, vocabulary, K/V)."""
    return {size["hidden"], size["ffn"], size["vocab"], size["kv_heads"] * TWIN_HEAD_DIM}


def _hf_twin(spec: ModelSpec) -> str:
    from autopar.hf import _KEYS, make_config
    from autopar.spec import hf_option_values
    values = hf_option_values(spec.options)
    values.pop("seq", None)
    real = make_config(spec.source, values)
    keys = _hf_keys(real)
    hidden = TWIN_HEADS * TWIN_HEAD_DIM
    size = {"layers": TWIN_LAYERS, "hidden": hidden, "heads": TWIN_HEADS, "kv_heads": twin_kv_heads(spec),
            "ffn": TWIN_FFN, "vocab": TWIN_VOCAB}
    real_dict = real.to_dict()
    lead = next((real_dict[k] for k in LEAD_KEYS if isinstance(real_dict.get(k), int) and real_dict[k] > 0), 0)
    kinds = real_dict.get("mlp_layer_types")  # GLM-4.7-Flash: ["dense", "sparse", ...], one dense by default
    if not lead and isinstance(kinds, list) and kinds and kinds[0] == "dense" and "sparse" in kinds:
        lead = kinds.index("sparse")
    if lead:  # one leading dense block, then the twin's repeated ones
        size["layers"] = TWIN_LAYERS + 1
    twin: dict[str, object] = {keys[f]: v for f, v in size.items() if f in keys}
    for key in LEAD_KEYS:
        if key in real_dict and lead:
            twin[key] = 1
    if "moe_layer_end_index" in real_dict and lead:
        twin["moe_layer_end_index"] = TWIN_LAYERS  # Ernie 4.5: the last block's index
    for key, value in real_dict.items():
        if key in twin or isinstance(value, bool):
            continue
        if isinstance(value, float) and ("drop" in key or "jitter" in key) and value:
            twin[key] = 0.0  # random in training (dropout, PhiMoE's router jitter): no layout can match it
        elif isinstance(value, int) and "kv_lora_rank" in real_dict and (key in MLA_KEYS or key == "head_dim"):
            # multi-head latent attention (DeepSeek-V2/V3): its head parts and low ranks at
            # the twin's head size over the real value head's; its head_dim is the RoPE part
            # (the ranks at the twin's width over the real one's: below it, as low ranks are)
            real_v = int(real_dict.get("v_head_dim") or value)
            part = real_dict["qk_rope_head_dim"] if key == "head_dim" else value
            share = int(part) * TWIN_HEAD_DIM // real_v if "rank" not in key else int(part) * hidden // spec.hidden
            twin[key] = max(8 if "rank" in key else 2, share - share % 2)
        elif isinstance(value, int) and key == "head_dim":
            twin[key] = TWIN_HEAD_DIM
        elif isinstance(value, int) and key.endswith("rotary_dim") and spec.hidden % spec.heads == 0:
            # the rotated part of a head (GPT-J's, CodeGen's 64 of 256): the same share of the twin's
            share = value * TWIN_HEAD_DIM // (spec.hidden // spec.heads)
            twin[key] = max(2, share - share % 2)
        elif isinstance(value, int) and value == spec.hidden and key not in ("max_position_embeddings",):
            twin[key] = hidden  # another width tied to the hidden size (OPT's word_embed_proj_dim)
        elif isinstance(value, int) and key in _KEYS["experts"] and \
                (value in _twin_widths(size) or value > TWIN_MAX_EXPERTS):
            # as many experts as a twin GEMM has outputs (Ernie 4.5's 64, the twin's width):
            # the tracer would take that GEMM for a router; more than TWIN_MAX_EXPERTS (DeepSeek-
            # V3's 256): fewer, as many to a routing group (n_group) and at least top-k
            topk, groups = (int(real_dict.get(k) or 1) for k in ("num_experts_per_tok", "n_group"))
            while (value in _twin_widths(size) or value > TWIN_MAX_EXPERTS) and value // 2 >= topk \
                    and (value // 2) % groups == 0:
                value //= 2
            twin[key] = value
        elif isinstance(value, int) and key.endswith("token_id") and value >= TWIN_VOCAB:
            twin[key] = TWIN_VOCAB - 1
    shaped = {k for f in size if f in keys for k in _KEYS[f]}  # every alias of a field set above
    for key, value in values.items():  # the user's other options, as written
        if key not in shaped:
            twin.setdefault(key, value)
    items = ",".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in sorted(twin.items()))
    return f"hf:{spec.source}:{items},seq={TWIN_SEQ}"


def twin_spec_text(spec: ModelSpec) -> str:
    """The ``--model`` spec of ``spec``'s twin (a user module's: itself)."""
    if spec.arch == "hf":  # kept: deriving it imports transformers (and torch)
        from autopar.profiles import _version, kept, source_digest
        key = f"{spec!r}|{_version('transformers')}|{source_digest('verify.py', 'hf.py', 'spec.py')}"
        return kept("twin", key, lambda: _hf_twin(spec), lambda t: t, _text)
    if spec.arch == "module":
        return spec.name
    if spec.builtin:
        base = (f"layers={TWIN_LAYERS},hidden={TWIN_HEADS * TWIN_HEAD_DIM},heads={TWIN_HEADS},"
                f"vocab={TWIN_VOCAB},seq={TWIN_SEQ}")
        if spec.arch == "llama":
            return f"llama:{base},kv_heads={twin_kv_heads(spec)},ffn={TWIN_FFN}"
        return f"gpt:{base},tied={int(spec.tied)}"
    raise UserError(f"autopar verify checks HF, built-in and user models, not {spec.arch} models ({spec.name})")


def _text(value: object) -> str:
    """A kept twin spec, checked."""
    if not isinstance(value, str) or not value.startswith("hf:"):
        raise ValueError("not a twin spec")
    return value


def twin_shape(twin: str) -> tuple[int, int]:
    """(blocks, sequence length) the twin's checks train: its spec's (``TWIN_LAYERS``, one more
    with a leading dense block) and ``TWIN_SEQ``, or a user module's own blocks and at most
    ``TWIN_SEQ`` of its tokens."""
    spec = parse_model_spec(twin)
    if spec.arch != "module":
        return spec.layers or TWIN_LAYERS, TWIN_SEQ
    from autopar.runtime.usermodule import traced_file
    own = traced_file(twin, 0).spec  # at the factory's own sequence length
    return own.layers, min(TWIN_SEQ, own.seq) if own.seq else TWIN_SEQ


def check_plan(twin: str, check: Check | None):
    """The 2-rank plan of ``check`` on the twin; ``None``: the one-process reference."""
    from autopar.plan import Mesh, Plan
    layers, seq = twin_shape(twin)
    kw: dict = dict(model=twin, cluster="cpu-local", global_batch=TWIN_BATCH, seq_len=seq, dtype="fp32",
                    stage_layers=(layers,), recompute=("none",) * layers)
    if check is None:
        return Plan(gpus=1, mesh=Mesh(), micro_batch_size=TWIN_BATCH, num_microbatches=1, **kw)
    if check == Check.DP:
        return Plan(gpus=2, mesh=Mesh(dp=2), zero_stage=3, micro_batch_size=1, num_microbatches=2, **kw)
    if check in (Check.SELECTIVE, Check.OP):
        kw["recompute"] = (check.value,) * layers
        return Plan(gpus=2, mesh=Mesh(dp=2), micro_batch_size=1, num_microbatches=2, **kw)
    if check in (Check.TP, Check.SP, *COMPOSED):
        if check in COMPOSED:
            kw["recompute"] = (COMPOSED[check][1],) * layers
        return Plan(gpus=2, mesh=Mesh(tp=2), sequence_parallel=check in (Check.SP, Check.SP_FULL, Check.SP_OP),
                    micro_batch_size=2, num_microbatches=2, **kw)
    if layers < 2:
        raise UserError(f"{twin} has one block: nothing to pipeline")
    kw["stage_layers"] = (layers - layers // 2, layers // 2)
    return Plan(gpus=2, mesh=Mesh(pp=2), micro_batch_size=1, num_microbatches=4, **kw)


def _reference(twin: str):
    """(losses, initial weights, final weights) of one process."""
    import torch

    from autopar.runtime.context import ParallelContext
    from autopar.runtime.state import full_state
    from autopar.runtime.train import build_program, train
    plan = check_plan(twin, None)
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    prog = build_program(plan, ctx, _config())
    start = full_state(prog)
    result = train(plan, STEPS, ctx, _config(), program=prog)
    return result.losses, start, full_state(prog)


def _config():
    from autopar.runtime.train import TrainConfig
    return TrainConfig(lr=LR, optimizer="sgd")


def _compare(losses: list[float], state: dict, ref) -> str:
    """Why a run differs from the reference (one line), or ""."""
    ref_losses, start, final = ref
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        if abs(got - want) > LOSS_TOL:
            return f"loss at step {step} is {got:.6f}, one process gives {want:.6f}"
    if state.keys() != final.keys():
        return f"weights differ in names: {sorted(set(state) ^ set(final))[:3]}"
    for key, want in final.items():
        moved = (want - start[key]).abs().max().item()
        err = (state[key] - want).abs().max().item()
        if err > GRAD_REL_TOL * moved + GRAD_ABS_TOL:
            return f"the gradient of {key} differs (weight off by {err:.2g} after steps of {moved:.2g})"
    return ""


def _run(twin: str, checks: list[Check], ref) -> dict[Check, Verdict]:
    """All ``checks`` in one torchrun job; if it fails, each on its own to tell which."""
    import torch

    from autopar.runtime import RunSpec, run_job
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as tmp:
        wd = Path(tmp)
        try:
            results = run_job([RunSpec(plan=check_plan(twin, c), steps=STEPS, dump=True) for c in checks],
                              workdir=wd, cfg=_config(), timeout_s=300)
        except UserError as exc:
            if len(checks) == 1:
                return {checks[0]: Verdict(check=checks[0], ok=False, reason=_crash(str(exc)))}
            out: dict[Check, Verdict] = {}
            for c in checks:
                out.update(_run(twin, [c], ref))
            return out
        verdicts = {}
        for i, (c, result) in enumerate(zip(checks, results)):
            state: dict = {}
            for f in sorted(wd.glob(f"run{i}.final.rank*.pt")):
                state.update(torch.load(f))
            reason = _compare(result.losses, state, ref)
            verdicts[c] = Verdict(check=c, ok=not reason, reason=reason)
        return verdicts


def _crash(message: str) -> str:
    """A failed run's line without the launcher's prefix and log location, at most 240
    characters."""
    line = message.removeprefix("the run failed: ").split("; rank logs")[0].split("; full log")[0]
    return line if len(line) <= 240 else line[:239] + "…"


def _cache_file(twin: str) -> Path:
    """The verdicts' file: keyed by the twin, torch's and transformers' versions and the source
    of the code that runs it: the runtime and the tracer whose layout it shards (changed code proves
    itself again)."""
    from autopar.profiles import _version  # installed versions, read without importing them
    digest = hashlib.sha256(f"{twin}|{_version('torch')}|{_version('transformers')}".encode())
    here = Path(__file__).parent
    for f in sorted([*here.glob("runtime/*.py"), *here.glob("trace/*.py"), here / "layout.py", here / "model.py",
                     here / "hf.py", Path(__file__)]):
        digest.update(f.read_bytes())
    spec = parse_model_spec(twin)
    if spec.arch == "module":  # the user's code: the factory's directory
        for f in sorted(Path(spec.source.rpartition(":")[0]).resolve().parent.rglob("*.py")):
            digest.update(f.read_bytes())
    root = Path(os.environ.get("AUTOPAR_CACHE") or Path.home() / ".cache" / "autopar")
    return root / "verify" / f"{digest.hexdigest()[:24]}.json"


def _load(path: Path, model: str) -> Verification | None:
    try:
        data = json.loads(path.read_text())
        return Verification(model=model, twin=data["twin"], verdicts=tuple(
            Verdict(check=Check(v["check"]), ok=bool(v["ok"]), reason=str(v["reason"])) for v in data["verdicts"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify(model: str, *, checks: tuple[Check, ...] = tuple(Check), use_cache: bool = True) -> Verification:
    """Run (or read from the cache) the twin checks of ``model`` (a ``--model`` spec)."""
    spec = parse_model_spec(model)
    twin = twin_spec_text(spec)
    path = _cache_file(twin)
    cached = _load(path, model) if use_cache else None
    have = {v.check: v for v in cached.verdicts} if cached else {}
    todo = [c for c in checks if c not in have]
    if todo:
        try:
            ref = _reference(twin)
        except UserError:
            raise
        except Exception as exc:  # the model itself fails under autopar's runtime: one line, not a traceback
            first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")[:200]
            raise UserError(f"autopar's runtime cannot train the twin of {shown(model)} in one process "
                            f"({type(exc).__name__}: {first}); this model is not supported yet") from None
        have.update(_run(twin, todo, ref))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"twin": twin, "verdicts": [
                {**asdict(v), "check": v.check.value} for v in sorted(have.values(), key=lambda v: v.check.value)]},
                indent=1))
        except OSError:
            pass  # an unwritable cache only costs the next run its time
    return Verification(model=model, twin=twin, verdicts=tuple(have[c] for c in checks))
