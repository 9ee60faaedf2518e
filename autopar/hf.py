"""HF transformers models from config classes, with random weights on the meta device.

transformers is an optional dependency (``pip install 'autopar[hf]'``), imported only here and
only when an ``hf:`` or MoE spec is used. Nothing is downloaded: models are built with
``AutoModelForCausalLM.from_config`` inside ``torch.device("meta")``.
"""

from __future__ import annotations

import importlib
from typing import Any

from autopar.errors import UserError
from autopar.spec import ModelSpec, hf_option_values

# Config attribute names across model families, first match wins.
_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab": ("vocab_size",),
    "seq": ("max_position_embeddings", "n_positions", "n_ctx"),
    "experts": ("num_local_experts", "num_experts"),
    "topk": ("num_experts_per_tok",),
}


def transformers_module() -> Any:
    """``import transformers`` or a one-line error naming the install command."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise UserError("HF models need transformers: pip install 'autopar[hf]' "
                        "(or pip install 'transformers>=4.45')") from None


def make_config(cls_name: str, overrides: dict[str, object]) -> Any:
    """An instance of ``transformers.<cls_name>`` with ``overrides``, for training (no KV cache)."""
    tf = transformers_module()
    cls = getattr(tf, cls_name, None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, tf.PretrainedConfig)):
        raise UserError(f"{cls_name!r} is not a transformers config class; use e.g. LlamaConfig, "
                        "GPT2Config or MixtralConfig")
    try:
        config = cls(**overrides)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{cls_name}({', '.join(overrides)}) failed: {str(exc).splitlines()[0]}") from None
    config.use_cache = False
    return config


def _get(config: Any, field: str, default: int = 0) -> int:
    for key in _KEYS[field]:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def spec_from_hf(text: str, cls_name: str, options: tuple[tuple[str, str], ...]) -> ModelSpec:
    """The :class:`ModelSpec` of ``hf:<cls_name>:<options>``, its shape read from the config.
    ``seq=S`` among the options sets the training sequence length (default: the config's
    maximum positions)."""
    if not cls_name:
        raise UserError(f"{text!r} names no config class; write hf:LlamaConfig:key=value,...")
    values = hf_option_values(options)
    seq = values.pop("seq", None)
    config = make_config(cls_name, values)
    shape = {f: _get(config, f) for f in _KEYS}
    if seq is not None:
        if not isinstance(seq, int) or seq <= 0:
            raise UserError(f"seq={seq!r} in {text!r} must be a positive integer")
        shape["seq"] = seq
    missing = [f for f in ("layers", "hidden", "heads", "vocab", "seq") if shape[f] <= 0]
    if missing:
        raise UserError(f"{cls_name} has no {', '.join(missing)} that autopar recognises; "
                        "use path/to/file.py:factory for this model")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return ModelSpec(arch="hf", name=text, source=cls_name, options=options, tied=tied, **shape)


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
    with torch.device("meta"):
        try:
            model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError:  # not a causal LM: the bare model
            model = tf.AutoModel.from_config(config, dtype=dtype)
    return model.train()
