"""Property-based inputs for every parser and loader, and what each must do with them.

Each parser has a hypothesis strategy and a check. The check feeds one input to the parser: it
must accept it or refuse it with a user error (``UserError``/``ProfileError``/``RecipeError``,
one line, exit 2 through the CLI); any other exception, or an accepted input that breaks the
parser's promise, is a ``Finding``. Promises of accepted inputs:

- model spec, hf spec: every shape field positive and within ``autopar.limits``;
- profile: a finite, positive step time for a small fixed model and strategy;
- plan: ``to_json`` -> load -> ``to_json`` is byte-identical, and ``Plan.strategy()`` +
  ``cost_models.estimate`` price it (finite, positive step time);
- CLI integer options: exit 0 (with valid JSON, a finite step time) or 2 with one line.

Used by ``tests/test_fuzz.py`` (200 cases per parser by default, 10,000 under ``-m fuzz``) and
``benchmarks/fuzz.py`` (counts findings instead of stopping at the first). Only public entry
points are called, so the same cases run against older autopar versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from hypothesis import strategies as st

from autopar.errors import UserError
from cost_models import ProfileError

ROOT = Path(__file__).resolve().parent.parent
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ProfileError)
"""What a parser may raise for bad input (``RecipeError`` surfaces as ``UserError``)."""
try:  # limits of accepted shapes (absent in autopar versions before input validation)
    from autopar.limits import SPEC_LIMITS
except ImportError:  # pragma: no cover - baseline runs of benchmarks/fuzz.py
    SPEC_LIMITS = {}


class Finding(AssertionError):
    """A parser broke its promise on one input: ``kind`` is ``exception`` (it raised something
    other than a user error) or ``promise`` (it accepted an input that breaks its promise)."""

    def __init__(self, message: str, kind: str = "promise") -> None:
        super().__init__(message)
        self.kind = kind


def _user_error_or_finding(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, result) if ``fn`` accepted, (False, error) if it refused with a user error; any
    other exception is a ``Finding``."""
    try:
        return True, fn()
    except USER_ERRORS as exc:
        text = str(exc)
        if "\n" in text:
            raise Finding(f"user error of more than one line: {text[:200]!r}", "exception") from None
        return False, exc
    except Finding:
        raise
    except (Exception, RecursionError, MemoryError) as exc:  # noqa: BLE001 - exactly what we hunt
        raise Finding(f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}", "exception") from exc


# -- shared value strategies ---------------------------------------------------------------------
EDGE_INTS = [0, -1, 1, 2, 3, 4, 7, 8, 1023, 1024, 1025, 2**20, 2**20 + 1, 2**24, 2**31, 2**63,
             10**8, 10**12, 10**30]
ints = st.one_of(st.integers(-3, 12), st.sampled_from(EDGE_INTS), st.integers())
floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=12),
                    st.sampled_from(["", "bf16", "1f1b", "none", "nan", "1e400", "0x10"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, allow_nan=True)


def raw_document(draw: st.DrawFn, make: Callable[[st.DrawFn], Any]) -> bytes:
    """Bytes of a file: mostly JSON of ``make(draw)`` (a mutated valid object), also any JSON,
    any bytes, and the hard cases (not UTF-8, deep nesting, an integer over 4,300 digits, an
    empty or truncated file, a byte-order mark)."""
    kind = draw(st.sampled_from(["mutated"] * 6 + ["json", "bytes", "hard"]))
    if kind == "mutated":
        return _dumps(make(draw)).encode()
    if kind == "json":
        return _dumps(draw(json_values)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    base = _dumps(make(draw))
    hard = draw(st.sampled_from(["latin1", "deep", "bigint", "empty", "truncate", "bom"]))
    if hard == "latin1":
        return base.encode()[:-1] + b"\xff}"
    if hard == "deep":
        n = draw(st.sampled_from([50, 2000, 100_000]))
        return ("[" * n + "]" * n).encode()
    if hard == "bigint":
        return base.replace(": 1", ": 1" + "0" * draw(st.sampled_from([300, 4299, 5000])), 1).encode()
    if hard == "empty":
        return b""
    if hard == "truncate":
        return base.encode()[: draw(st.integers(0, max(0, len(base) - 1)))]
    return b"\xef\xbb\xbf" + base.encode()


def _mutate(draw: st.DrawFn, base: dict, near: dict[str, st.SearchStrategy[Any]]) -> dict:
    """``base`` with 0-3 edits: a field set to a near-valid or arbitrary value, deleted, or
    added; nested objects edited the same way (``near['mesh.tp']``)."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(0, 3))):
        objects = [("", doc)] + [(f"{k}.", v) for k, v in doc.items() if isinstance(v, dict)]
        prefix, target = draw(st.sampled_from(objects))
        op = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
        if op == "add":
            target[draw(st.text(max_size=8))] = draw(json_values)
        elif target:
            key = draw(st.sampled_from(sorted(target)))
            if op == "delete":
                del target[key]
            else:
                strategy = near.get(prefix + key)
                use_near = strategy is not None and draw(st.booleans())
                target[key] = draw(strategy) if use_near else draw(json_values)  # type: ignore[arg-type]
    return doc


def _write(data: bytes, suffix: str) -> str:
    fd, path = tempfile.mkstemp(suffix=suffix, prefix="autopar-fuzz-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


# -- model specs ---------------------------------------------------------------------------------
SPEC_KEYS = ["layers", "hidden", "heads", "vocab", "seq", "kv_heads", "ffn", "tied", "experts", "topk"]
SPEC_VALUES = st.one_of(ints.map(str), st.integers(1, 4096).map(str), st.sampled_from(["1", "2", "4", "0"]),
                        st.sampled_from(["", "abc", " 4", "4 ", "+8", "1_024", "0x10", "1e3",
                                                       "٤", "-0", "1" * 5000]), st.text(max_size=6))


@st.composite
def model_specs(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["structured"] * 4 + ["preset", "text"]))
    if kind == "preset":
        from autopar.spec import PRESETS
        return draw(st.sampled_from(sorted(PRESETS))) + draw(st.sampled_from(["", " ", ":", "x", "\n"]))
    if kind == "text":
        return draw(st.text(max_size=60))
    arch = draw(st.sampled_from(["gpt", "llama", "moe", "gpt", "llama", "bert", "", "GPT"]))
    valid = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 16}
    items = [f"{k}={v}" for k, v in valid.items() if draw(st.integers(0, 9)) > 0]
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3, 4]))):
        key = draw(st.one_of(st.sampled_from(SPEC_KEYS), st.text(max_size=5)))
        items.insert(draw(st.integers(0, len(items))), f"{key}={draw(SPEC_VALUES)}")
    sep = draw(st.sampled_from([",", ",", ", ", ",,"]))
    return f"{arch}:{sep.join(items)}"


def _check_shape(spec: Any) -> None:
    """An accepted spec's shape: positive, within the limits, consistent."""
    if spec.arch == "module":
        return
    for field in ("layers", "hidden", "heads", "vocab", "seq"):
        value = getattr(spec, field)
        if not (isinstance(value, int) and value >= 1):
            raise Finding(f"accepted {spec.name!r} with {field}={value!r}")
        if SPEC_LIMITS and value > SPEC_LIMITS[field]:
            raise Finding(f"accepted {spec.name!r} with {field}={value}, above the limit")
    if spec.ffn_hidden <= 0 or spec.num_kv_heads <= 0 or spec.heads % spec.num_kv_heads \
            or (SPEC_LIMITS and spec.ffn_hidden > 4 * SPEC_LIMITS["hidden"]):
        raise Finding(f"accepted {spec.name!r} with ffn={spec.ffn_hidden}, kv_heads={spec.num_kv_heads}")
    if spec.arch != "hf" and spec.hidden % spec.heads:
        raise Finding(f"accepted {spec.name!r} with hidden % heads != 0")


def check_model_spec(text: str) -> bool:
    """Whether ``text`` was accepted (a ``Finding`` if it broke a promise)."""
    from autopar.spec import parse_model_spec
    ok, spec = _user_error_or_finding(lambda: parse_model_spec(text))
    if ok:
        _check_shape(spec)
    return ok


# -- hf specs ------------------------------------------------------------------------------------
HF_CLASSES = ["LlamaConfig", "GPT2Config", "OPTConfig", "FalconConfig", "MistralConfig", "BloomConfig",
              "Qwen2Config", "GemmaConfig", "PhiConfig", "GPTNeoXConfig", "T5Config", "ViTConfig",
              "NoSuchConfig", "PretrainedConfig", ""]
HF_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
           "intermediate_size", "vocab_size", "max_position_embeddings", "n_layer", "n_embd", "n_head",
           "n_positions", "n_inner", "ffn_dim", "num_kv_heads", "head_dim", "rms_norm_eps", "hidden_act",
           "activation_function", "rope_theta", "tie_word_embeddings", "pad_token_id", "eos_token_id",
           "multi_query", "new_decoder_architecture", "sliding_window", "attention_dropout", "seq",
           "rope_scaling", "num_local_experts", "num_experts_per_tok", "layer_norm_epsilon"]
HF_VALUES = st.one_of(ints.map(str), st.sampled_from(["True", "False", "None", "'silu'", "silu", "gelu_new",
                                                     "1e-5", "1e999", "-1e-5", "nan", "[]", "{}", "(1, 2)",
                                                     "{'rope_type': 'linear'}", "'x'" * 3, "-" * 10_000 + "1",
                                                     "(" * 300, "1" * 5000]),
                      st.floats(allow_nan=False).map(repr), st.text(max_size=8))


@st.composite
def hf_specs(draw: st.DrawFn) -> str:
    cls = draw(st.one_of(st.sampled_from(HF_CLASSES[:10]), st.sampled_from(HF_CLASSES[:10]),
                         st.sampled_from(HF_CLASSES), st.text(max_size=8)))
    items = []
    if draw(st.booleans()):  # a small model, so most specs are near the valid ones
        items += ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "n_layer=2", "n_embd=64",
                  "n_head=4"] if draw(st.booleans()) else ["num_hidden_layers=2"]
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.one_of(st.sampled_from(HF_KEYS), st.text(max_size=6)))
        items.append(f"{key}={draw(HF_VALUES)}")
    return f"hf:{cls}:{','.join(draw(st.permutations(items)))}"


@contextlib.contextmanager
def _stderr_fd(out: list[bytes]) -> Iterator[None]:
    """Collect what is written to file descriptor 2 meanwhile (logging handlers hold the real
    stream, so redirecting ``sys.stderr`` would miss them)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read())


def check_hf_spec(text: str) -> bool:
    """Accepted or refused as ``check_model_spec``, and transformers prints nothing (the CLI's
    error must stay one line)."""
    from autopar.spec import parse_model_spec
    printed: list[bytes] = []
    with _stderr_fd(printed):
        ok, spec = _user_error_or_finding(lambda: parse_model_spec(text))
    if printed[0].strip():
        raise Finding(f"printed to stderr: {printed[0][:200]!r}")
    if ok:
        _check_shape(spec)
    return ok


# -- hardware profiles ---------------------------------------------------------------------------
def _shipped_profile(name: str) -> dict:
    return json.loads((ROOT / "hardware_profiles" / f"{name}.json").read_text())


NEAR_PROFILE: dict[str, st.SearchStrategy[Any]] = {
    key: st.one_of(st.floats(1e-6, 1e6), st.floats(1e-3, 1.0), floats, ints,
                   st.sampled_from([0, 0.0, -1.0, 1e-9, 1e-3, 0.5, 1.0, 1.5, 1e6, 1e7, "80"]))
    for key in ("memory_gib", "hbm_bw_gbps", "matmul_efficiency", "memory_efficiency", "reserve_gib",
                "nccl_gib_per_group", "allocator_headroom", "overlap_penalty", "kernel_dispatch_us",
                "matmul_half_dim", "matmul_half_depth", "fp8_matmul_half_depth", "host_memory_gib",
                "host_link_bw_gbps", "host_optimizer_gbps",
                "fp8_matmul_efficiency", "optimizer_memory_efficiency", "intra_node.bw_gbps",
                "intra_node.latency_us", "intra_node.efficiency", "inter_node.bw_gbps", "inter_node.latency_us",
                "inter_node.p2p_bw_gbps", "peak_tflops.fp32", "peak_tflops.bf16", "attention_efficiency.flash2",
                "attention_half_seq.cudnn")}
NEAR_PROFILE["devices_per_node"] = st.one_of(ints, st.sampled_from([True, 8.0, "8"]))
NEAR_PROFILE["launcher"] = st.sampled_from(["nccl", "gloo", "mpi", "", None])
NEAR_PROFILE["peak_tflops"] = st.dictionaries(st.sampled_from(["bf16", "fp16", "fp32", "fp8", "int8"]),
                                              st.one_of(floats, ints), max_size=3)


@st.composite
def profile_documents(draw: st.DrawFn) -> bytes:
    base = _shipped_profile(draw(st.sampled_from(["cpu-local", "dgx-h100", "dgx-a100-40g"])))
    return raw_document(draw, lambda d: _mutate(d, base, NEAR_PROFILE))


@functools.cache
def _tiny_profile() -> Any:
    """The fixed small model every accepted hardware profile prices."""
    from autopar.spec import parse_model_spec
    from autopar.trace import profile_spec
    return profile_spec(parse_model_spec("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16,tied=0"))


def check_profile(data: bytes) -> bool:
    from cost_models import Strategy, estimate, load_profile
    path = _write(data, ".json")
    try:
        ok, hw = _user_error_or_finding(lambda: load_profile(path))
    finally:
        os.unlink(path)
    if not ok:
        return False
    dtype = next((d for d in ("bf16", "fp16", "fp32") if d in hw.peak_tflops), None)
    if dtype is None:
        return False  # read_job refuses a profile without a training dtype
    ok, est = _user_error_or_finding(lambda: estimate(_tiny_profile(), hw, Strategy(dtype=dtype), global_batch=1))
    if ok and not (math.isfinite(est.step_time_s) and est.step_time_s > 0):
        raise Finding(f"accepted profile prices the fixed strategy at {est.step_time_s!r} s")
    return ok


# -- plans ---------------------------------------------------------------------------------------
LLAMA_TINY = "llama:layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=128,seq=32"
PLAN_MODELS = ["gpt-tiny", LLAMA_TINY]
CLUSTERS = ["cpu-local", "dgx-h100", "dgx-a100-80g"]
SCHEDULE_NAMES = ["gpipe", "1f1b", "interleaved", "zero-bubble"]
MODES = ["none", "selective", "full"]


@functools.cache
def base_plans() -> tuple[dict, ...]:
    """Valid plans to mutate: a pipeline of 4 CPU ranks, a 3-D interleaved plan with SP and
    offload and its estimate, one device with verdicts."""
    from autopar.plan import Mesh, Plan
    a = Plan(model="gpt-tiny", cluster="cpu-local", gpus=4, global_batch=8, seq_len=32, dtype="fp32",
             mesh=Mesh(dp=2, pp=2), micro_batch_size=2, num_microbatches=2, stage_layers=(1, 3),
             recompute=("none", "full", "none", "selective"))
    b = Plan(model=LLAMA_TINY, cluster="dgx-h100", gpus=8, global_batch=8, seq_len=32, dtype="bf16",
             mesh=Mesh(dp=2, tp=2, pp=2), zero_stage=1, micro_batch_size=1, num_microbatches=4,
             schedule="interleaved", virtual_stages=2, sequence_parallel=True, stage_layers=(1, 1, 1, 1),
             recompute=("full",) * 4, offload=True, axis_order=("tp", "dp", "pp"), recipe="megatron-core")
    c = Plan(model="gpt-tiny", cluster="dgx-a100-80g", gpus=1, global_batch=4, seq_len=16, mesh=Mesh(),
             micro_batch_size=4, num_microbatches=1, stage_layers=(4,), recompute=("selective",) * 4,
             verified=(("tp", ""), ("sp", "rank 0: boom")))
    out = [json.loads(p.to_json()) for p in (a, b, c)]
    from cost_models import estimate, load_profile
    from autopar.trace import profile_spec
    from autopar.spec import parse_model_spec
    est = estimate(profile_spec(parse_model_spec(LLAMA_TINY)), load_profile("dgx-h100"), b.strategy(), global_batch=8)
    out[1]["estimate"] = json.loads(json.dumps(dataclasses.asdict(est)))
    return tuple(out)


small = st.one_of(st.integers(-1, 8), st.sampled_from([0, 2**20, 2**24, 10**12, 2**63]))
NEAR_PLAN: dict[str, st.SearchStrategy[Any]] = {
    **{k: small for k in ("gpus", "global_batch", "seq_len", "zero_stage", "micro_batch_size",
                           "num_microbatches", "virtual_stages", "version", "mesh.dp", "mesh.tp", "mesh.pp",
                           "mesh.cp", "mesh.ep")},
    "schedule": st.sampled_from(SCHEDULE_NAMES + ["pipedream", ""]),
    "dtype": st.sampled_from(["bf16", "fp16", "fp32", "fp8", "fp64"]),
    "recompute": st.lists(st.sampled_from(MODES + ["half"]), max_size=8),
    "stage_layers": st.lists(st.integers(-1, 5), max_size=8),
    "axis_order": st.one_of(st.permutations(["pp", "dp", "tp"]), st.lists(st.sampled_from(["pp", "dp", "tp", "cp"]),
                                                                         max_size=4)),
    "sequence_parallel": st.one_of(st.booleans(), small),
    "offload": st.one_of(st.booleans(), small),
    "model": st.sampled_from(PLAN_MODELS + ["gpt2", "gpt5", "", "hf:GPT2Config:n_layer=4,n_positions=16,seq=16"]),
    "cluster": st.sampled_from(CLUSTERS + ["tpu", ""]),
    "recipe": st.sampled_from(["autopar", "megatron-core", "torchtitan", "deepspeed", "nope", ""]),
    "verified": st.lists(st.tuples(st.sampled_from(["dp", "tp", "sp", "pp", "selective", "x"]),
                                   st.sampled_from(["", "rank 0: boom"])).map(list), max_size=3),
    "estimate": st.one_of(st.none(), json_values),
    **{f"estimate.{k}": st.one_of(floats, ints) for k in ("step_time_s", "mfu", "tokens_per_s")},
}


@st.composite
def structured_plans(draw: st.DrawFn) -> dict:
    """A plan built from consistent degrees (often accepted), with the placement drawn."""
    dp, tp, pp = (draw(st.sampled_from([1, 2, 4])) for _ in range(3))
    v = draw(st.sampled_from([1, 1, 2]))
    b, m = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    layers = 4
    cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=pp * v - 1, max_size=pp * v - 1,
                                unique=True))) if pp * v <= layers else []
    bounds = [0] + cuts + [layers]
    stage_layers = [hi - lo for lo, hi in zip(bounds, bounds[1:])] if pp * v <= layers else [1] * (pp * v)
    zero = draw(st.integers(0, 3))
    return {"version": 1, "model": draw(st.sampled_from(PLAN_MODELS)), "cluster": draw(st.sampled_from(CLUSTERS)),
            "gpus": dp * tp * pp, "global_batch": dp * b * m, "seq_len": draw(st.sampled_from([16, 32])),
            "dtype": draw(st.sampled_from(["bf16", "fp32", "fp16"])),
            "mesh": {"dp": dp, "tp": tp, "pp": pp, "cp": 1, "ep": 1}, "zero_stage": zero,
            "micro_batch_size": b, "num_microbatches": m,
            "schedule": draw(st.sampled_from(SCHEDULE_NAMES)), "virtual_stages": v,
            "sequence_parallel": tp > 1 and draw(st.booleans()), "stage_layers": stage_layers,
            "recompute": draw(st.lists(st.sampled_from(MODES), min_size=sum(stage_layers), max_size=sum(stage_layers))),
            "offload": zero > 0 and draw(st.booleans()), "axis_order": draw(st.permutations(["pp", "dp", "tp"])),
            "recipe": draw(st.sampled_from(["autopar", "megatron-core", "torchtitan"])),
            "verified": [], "estimate": None}


def _plan_object(draw: st.DrawFn) -> dict:
    if draw(st.booleans()):
        return draw(structured_plans())
    return _mutate(draw, draw(st.sampled_from(base_plans())), NEAR_PLAN)


@st.composite
def plan_documents(draw: st.DrawFn) -> bytes:
    return raw_document(draw, _plan_object)


@functools.lru_cache(maxsize=64)
def _plan_profile(model: str, seq: int) -> Any:
    """The cost model's view of a plan's model at its sequence length (traced for the usual
    lengths; the 16-token profile with its ``seq`` replaced for others, to trace each model once)."""
    from autopar.spec import parse_model_spec, with_seq
    from autopar.trace import profile_spec
    spec = parse_model_spec(model)
    if seq in (16, 32):
        return profile_spec(with_seq(spec, seq))
    return dataclasses.replace(profile_spec(with_seq(spec, 16)), seq=seq)


def check_plan(data: bytes) -> bool:
    from autopar.plan import load_plan, plan_from_dict
    path = _write(data, ".json")
    try:
        ok, plan = _user_error_or_finding(lambda: load_plan(path))
    finally:
        os.unlink(path)
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        obj = None
    if obj is not None:  # the dict loader agrees with the file loader
        ok_dict, _ = _user_error_or_finding(lambda: plan_from_dict(obj))
        if ok_dict != ok:
            raise Finding(f"load_plan {'accepts' if ok else 'refuses'} what plan_from_dict "
                          f"{'accepts' if ok_dict else 'refuses'}")
    if not ok:
        return False
    text = plan.to_json()
    again = _user_error_or_finding(lambda: plan_from_dict(json.loads(text)))
    if not again[0] or again[1].to_json() != text:
        raise Finding("an accepted plan does not round-trip byte-identically through to_json and load")
    from cost_models import estimate, load_profile

    def price() -> Any:
        hw = load_profile(plan.cluster)
        return estimate(_plan_profile(plan.model, plan.seq_len), hw, plan.strategy(), global_batch=plan.global_batch)
    ok, est = _user_error_or_finding(price)
    if ok and not (math.isfinite(est.step_time_s) and est.step_time_s > 0):
        raise Finding(f"an accepted plan is priced at {est.step_time_s!r} s")
    return True


# -- CLI integer options -------------------------------------------------------------------------
CLI_TINY = "gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16,tied=0"
CLI_VALUES = st.one_of(ints.map(str), st.sampled_from(["", "1.5", "0x10", "١٢", " 8", "+4", "1_000", "-0",
                                                      "1" * 5000, "nan", "four"]))


def _not_a_length(value: str) -> bool:
    """Not a valid sequence length (valid ones are drawn from a few, each traced once)."""
    text = value.strip()
    return not (text.isdigit() and len(text) <= 6) or int(text) == 0


@st.composite
def cli_calls(draw: st.DrawFn) -> list[str]:
    """``estimate``, ``plan`` (pins, time limit 1 s) or ``inspect`` with drawn integer options;
    most options valid so that the others decide."""
    command = draw(st.sampled_from(["estimate", "estimate", "plan", "inspect"]))
    if command == "inspect":
        return ["inspect", "--model", CLI_TINY, "--json", "--seq-len",
                draw(st.one_of(st.sampled_from(["8", "16"]), CLI_VALUES.filter(_not_a_length)))]
    cluster = draw(st.sampled_from(["cpu-local", "dgx-h100"]))
    args = [command, "--model", CLI_TINY, "--cluster", cluster, "--json"]
    options = {"--gpus": st.sampled_from(["1", "2", "4", "8", "16"]),
               "--global-batch": st.sampled_from(["1", "4", "8", "12", "32"])}
    pins = ["--tp", "--pp", "--dp", "--mbs", "--vpp", "--zero", "--seq-len"]
    for name in ("--gpus", "--global-batch"):
        value = draw(CLI_VALUES) if draw(st.integers(0, 3)) == 0 else draw(options[name])
        args += [name, value]
    for name in draw(st.lists(st.sampled_from(pins), max_size=3, unique=True)):
        if name == "--seq-len" and draw(st.booleans()):
            args += [name, draw(st.sampled_from(["8", "16"]))]  # valid lengths: traced once each
        elif name == "--seq-len":
            args += [name, draw(CLI_VALUES.filter(_not_a_length))]
        else:
            args += [name, draw(CLI_VALUES)]
    if command == "plan":
        args += ["--time-limit", "1", "--no-verify"]
    return args


def check_cli(args: list[str]) -> bool:
    from typer.testing import CliRunner

    from autopar.cli import app
    res = CliRunner().invoke(app, args)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        exc = res.exception
        raise Finding(f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}", "exception")
    if res.exit_code == 2:
        lines = res.stderr.splitlines()
        if len(lines) != 1 or not lines[0].startswith("autopar: error: "):
            raise Finding(f"exit 2 without one error line: {res.stderr[:300]!r}")
        return False
    if res.exit_code != 0:
        raise Finding(f"exit {res.exit_code}: {res.output[-300:]!r}")
    data = json.loads(res.stdout)
    step = data.get("step_time_s", data.get("estimate", {}).get("step_time_s", 1.0))
    if not (isinstance(step, float) and math.isfinite(step) and step > 0):
        raise Finding(f"exit 0 with step time {step!r}")
    return True


PARSERS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], bool]]] = {
    "model_spec": (model_specs(), check_model_spec),
    "hf_spec": (hf_specs(), check_hf_spec),
    "profile": (profile_documents(), check_profile),
    "plan": (plan_documents(), check_plan),
    "cli_ints": (cli_calls(), check_cli),
}
"""Every parser and loader: (its inputs, the check of one input: True if accepted)."""
