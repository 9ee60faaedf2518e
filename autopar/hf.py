"""HF transformers models from config classes, with random weights on the meta device.

transformers is an optional dependency (``pip install 'autopar[hf]'``), imported only here and
only when an ``hf:`` or MoE spec is used. Nothing is downloaded: models are built with
``AutoModelForCausalLM.from_config`` inside ``torch.device("meta")``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import warnings
from collections.abc import Iterator
from typing import Any

from autopar.errors import UserError
from autopar.limits import SPEC_LIMITS, is_int, shown
from autopar.spec import ModelSpec, hf_option_values

# Config attribute names across model families, first match wins (Falcon's and other
# multi-query configs' kv heads are derived: see _kv_heads). No MLP width means 4 x hidden
# (GPT-2's n_inner=None, Bloom, MPT: transformers' MptMLP ignores expansion_ratio).
_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab": ("vocab_size",),
    "seq": ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "topk": ("num_experts_per_tok",),
}
_REQUIRED = ("layers", "hidden", "heads", "vocab", "seq")
LEARNED_POSITIONS = ("gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt", "xglm", "ctrl")
"""``model_type`` of the families whose position table has max-positions rows whatever the
sequence (absolute embeddings): they cannot train past it."""
_SILENT = 100
"""A logging level above CRITICAL: nothing transformers logs gets through."""
_MAX_MESSAGE = 200
"""Characters of a transformers error kept in the one-line message."""


def transformers_module() -> Any:
    """``import transformers`` or a one-line error naming the install command."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise UserError("HF models need transformers: pip install 'autopar[hf]' "
                        "(or pip install 'transformers>=4.45')") from None


@contextlib.contextmanager
def _quiet(tf: Any) -> Iterator[None]:
    """transformers' logs and Python warnings off (its config checks log several lines per bad
    value, even at error level, and warn of deprecated keys; autopar reports bad input on one
    line, and what it cannot build raises)."""
    level = tf.logging.get_verbosity()
    tf.logging.set_verbosity(_SILENT)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tf.logging.set_verbosity(level)


def _one_line(exc: BaseException) -> str:
    """``exc`` on one line: its type and first meaningful line, with the next one when the first
    only introduces it (huggingface_hub's "Validation error for field 'x':" + the cause)."""
    lines = [line.strip() for line in str(exc).splitlines() if any(c.isalnum() for c in line)]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    text = text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _culprit(exc: BaseException, overrides: dict[str, object]) -> str:
    """``"; check key=value"`` for the override(s) the error names by key or by value, else ''."""
    text = str(exc)
    named = [k for k, v in overrides.items()
             if re.search(rf"\b{re.escape(k)}\b", text) or (isinstance(v, str) and v
                                                             and re.search(rf"\b{re.escape(v)}\b", text))]
    return f"; check {', '.join(f'{k}={shown(overrides[k])}' for k in named)}" if named else ""


def make_config(cls_name: str, overrides: dict[str, object]) -> Any:
    """An instance of ``transformers.<cls_name>`` with ``overrides``, for training (no KV cache).
    Whatever the config class rejects (transformers 5 raises TypeError, ValueError or
    huggingface_hub's strict-dataclass errors) is one line naming the class and the key."""
    tf = transformers_module()
    cls = getattr(tf, cls_name, None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, tf.PretrainedConfig)):
        raise UserError(f"{shown(cls_name)} is not a transformers config class; use e.g. LlamaConfig, "
                        "GPT2Config or MixtralConfig")
    try:
        with _quiet(tf):
            config = cls(**overrides)
    except Exception as exc:  # noqa: BLE001 - any rejection of user values is bad input
        raise UserError(f"{cls_name}({', '.join(overrides)}) failed: {_one_line(exc)}") from None
    config.use_cache = False
    vocab, pad = getattr(config, "vocab_size", None), getattr(config, "pad_token_id", None)
    if isinstance(vocab, int) and isinstance(pad, int) and not 0 <= pad < vocab:
        raise UserError(f"{cls_name}: pad_token_id={pad} is not a token id of vocab_size={vocab}; "
                        f"add pad_token_id=None (or an id below {vocab}) to the spec")
    return config


def _get(config: Any, field: str, default: int = 0) -> tuple[str, int]:
    """The first of ``field``'s keys that ``config`` has as an int, and its value."""
    for key in _KEYS[field]:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return "", default


def _kv_heads(config: Any, heads: int) -> int:
    """Key/value heads as the attention layer builds them (0: as many as ``heads``). Falcon
    (transformers' FalconAttention): ``num_kv_heads`` with the new decoder architecture, else one
    shared head when ``multi_query`` (its default), else ``heads``; other multi-query configs
    (GPTBigCode) have one."""
    if getattr(config, "model_type", "") == "falcon":
        if config.new_decoder_architecture:
            return _get(config, "kv_heads", heads)[1]
        return 1 if config.multi_query else heads
    if getattr(config, "multi_query", None) is True:
        return 1
    return _get(config, "kv_heads")[1]


def check_causal_lm(config: Any) -> None:
    """Refuse what is not a decoder-only causal LM, before any tracing: encoder-decoder models
    (T5, BART, ...) and configs ``AutoModelForCausalLM`` has no model for."""
    tf = transformers_module()
    name = type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"not supported: {name} is an encoder-decoder model; autopar plans decoder-only causal LMs")
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"not supported: {name} is not a causal LM (AutoModelForCausalLM has no model for it); "
                        "autopar plans decoder-only causal LMs")


def spec_from_hf(text: str, cls_name: str, options: tuple[tuple[str, str], ...]) -> ModelSpec:
    """The :class:`ModelSpec` of ``hf:<cls_name>:<options>``, its shape read from the config.
    ``seq=S`` among the options sets the training sequence length (default: the config's
    maximum positions). Kept in ``$AUTOPAR_CACHE/spec`` by the spec, transformers' version and
    this parser's source, so a spec read before imports neither transformers nor torch (about
    3 s); a bad spec is never kept."""
    from autopar.plan import rebuild
    from autopar.profiles import _version, kept, source_digest
    key = f"{text}|{_version('transformers')}|{source_digest('hf.py', 'spec.py', 'limits.py')}"
    return kept("spec", key, lambda: _read_spec(text, cls_name, options), dataclasses.asdict,
                lambda data: rebuild(ModelSpec, data, "cached spec"))


def _read_spec(text: str, cls_name: str, options: tuple[tuple[str, str], ...]) -> ModelSpec:
    """``spec_from_hf`` from transformers' config class."""
    if not cls_name:
        raise UserError(f"{shown(text)} names no config class; write hf:LlamaConfig:key=value,...")
    if not cls_name.isidentifier():
        raise UserError(f"{shown(cls_name)} is not a transformers config class; use e.g. LlamaConfig, "
                        "GPT2Config or MixtralConfig")
    values = hf_option_values(options)
    seq = values.pop("seq", None)
    _check_sizes(cls_name, values)
    config = make_config(cls_name, values)
    check_causal_lm(config)
    found = {f: _get(config, f) for f in _KEYS}
    shape = {f: value for f, (_, value) in found.items()}
    shape["kv_heads"] = _kv_heads(config, shape["heads"])
    if seq is not None:
        if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0:
            raise UserError(f"seq={shown(seq)} in {shown(text)} must be a positive integer")
        shape["seq"] = seq
    for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
        key, value = found[field]
        if key and value <= 0 and not (field == "seq" and seq is not None):
            raise UserError(f"{cls_name}: {key}={value} must be a positive integer")
    if shape["seq"] <= 0:
        raise UserError(f"{cls_name} has no maximum sequence length that autopar recognises "
                        f"({', '.join(_KEYS['seq'])}); add seq=S to the spec, e.g. hf:{cls_name}:...,seq=2048")
    missing = [f for f in _REQUIRED if shape[f] <= 0]
    if missing:
        raise UserError(f"{cls_name} has no {', '.join(missing)} that autopar recognises; "
                        "use path/to/file.py:factory for this model")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    learned = found["seq"][1] if getattr(config, "model_type", "") in LEARNED_POSITIONS else 0
    capacity = getattr(config, "capacity_factor", 0.0)
    capacity = float(capacity) if isinstance(capacity, (int, float)) and capacity > 0 and shape["experts"] else 0.0
    return ModelSpec(arch="hf", name=text, source=cls_name, options=options, tied=tied,
                     max_positions=max(learned, 0), capacity_factor=capacity, **shape)


def attention_windows(config: Any) -> list[int]:
    """Each layer's local attention window in tokens (0: none), as HF builds its masks: a
    sliding window (``sliding_window``) on the layers ``layer_types`` names
    ``sliding_attention``, on every layer where the config has no ``layer_types`` (Mistral); a
    chunk (``attention_chunk_size``) on ``chunked_attention`` layers (Llama 4)."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    sliding = getattr(config, "sliding_window", None) or 0
    chunk = getattr(config, "attention_chunk_size", None) or 0
    kinds = getattr(config, "layer_types", None)
    if kinds:
        windows = [sliding if k == "sliding_attention" else chunk if k == "chunked_attention" else 0 for k in kinds]
    else:
        windows = [sliding if getattr(config, "use_sliding_window", True) else 0] * layers
    return [w if isinstance(w, int) and w > 0 else 0 for w in windows]


def masked_attention_layers(config: Any, seq: int) -> int:
    """Blocks whose attention HF's SDPA path runs with an explicit mask at ``seq`` tokens (a
    training forward: no padding, no cache): those with a window (``attention_windows``) no
    longer than the sequence. transformers' ``masking_utils._ignore_causal_mask_sdpa`` lets
    SDPA's ``is_causal`` stand in for the mask only where ``kv_length < local_attention_size``;
    elsewhere torch turns the boolean mask into an additive bias in the queries' dtype
    (``convert_boolean_attn_mask``) that the kernel reads over every s x s block (no causal
    blocks skipped) and that autograd keeps for the backward, one per layer."""
    return sum(1 for w in attention_windows(config) if w and seq >= w)


def _check_sizes(cls_name: str, values: dict[str, object]) -> None:
    """Refuse a shape override above autopar's limits before the config class sees it
    (transformers builds per-layer lists of ``num_hidden_layers`` entries)."""
    for field, keys in _KEYS.items():
        for key in keys:
            value = values.get(key)
            if is_int(value) and value > SPEC_LIMITS[field]:  # type: ignore[operator]
                raise UserError(f"{cls_name}: {key}={shown(value)} is above autopar's limit of "
                                f"{SPEC_LIMITS[field]:,} for the model's {field}; use a smaller value")


def mixtral_config(spec: ModelSpec) -> Any:
    """The HF ``MixtralConfig`` of a Llama-style MoE spec (``moe:...`` or ``mixtral-8x7b``)."""
    return make_config("MixtralConfig", dict(
        num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        num_key_value_heads=spec.num_kv_heads, intermediate_size=spec.ffn_hidden,
        vocab_size=spec.vocab, max_position_embeddings=spec.seq, num_local_experts=spec.experts,
        num_experts_per_tok=spec.topk, tie_word_embeddings=spec.tied, rms_norm_eps=1e-5))


def build_hf(spec: ModelSpec, dtype: Any) -> Any:
    """The HF causal LM of ``spec`` on the meta device, in training mode."""
    import torch
    tf = transformers_module()
    if spec.arch == "hf":
        values = hf_option_values(spec.options)
        values.pop("seq", None)
        config = make_config(spec.source, values)
    else:
        config = mixtral_config(spec)
    check_causal_lm(config)
    with torch.device("meta"), _quiet(tf):
        try:
            model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - the config's values are the user's
            given = hf_option_values(spec.options) if spec.arch == "hf" else {}
            raise UserError(f"building {type(config).__name__}'s model failed: {_one_line(exc)}"
                            f"{_culprit(exc, given)}") from None
    return model.train()
