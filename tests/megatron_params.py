"""Parameters of megatron-core's GPT model for exported Megatron scripts, built with its local
(non-Transformer-Engine) layer specs on the meta device in one gloo process.

    python tests/megatron_params.py STORE_FILE SCRIPT...   # prints one count per script

Each script's ``pretrain_gpt.py`` arguments become ``TransformerConfig`` fields the way
Megatron-LM's ``core_transformer_config_from_args`` maps them (a flag names its field, but for
the renames in ``RENAMED``); the RoPE base and fraction go to ``GPTModel``. Run as a separate
process: it initialises torch.distributed and megatron's parallel state.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

RENAMED = {"num_experts": "num_moe_experts", "swiglu": "gated_linear_unit", "norm_epsilon": "layernorm_epsilon"}
MODEL_ARGS = {"rotary_base", "rotary_percent", "seq_length", "max_position_embeddings",
              "position_embedding_type", "untie_embeddings_and_output_weights"}
SKIPPED = {"group_query_attention", "sequence_parallel", "global_batch_size", "micro_batch_size"}


def config_kwargs(tokens: list[str]) -> tuple[dict, dict]:
    """(TransformerConfig fields, GPTModel-level settings) of ``pretrain_gpt.py``'s arguments."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    kw: dict = {}
    model: dict = {}
    gqa = "--group-query-attention" in tokens
    i = 0
    while i < len(tokens):
        name = tokens[i][2:].replace("-", "_")
        value: object = True
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value, i = tokens[i + 1], i + 1
        i += 1
        if name == "disable_bias_linear":
            kw["add_bias_linear"] = False
        elif name in MODEL_ARGS:
            model[name] = value
        elif name == "num_query_groups" and not gqa or name in SKIPPED:
            continue
        elif RENAMED.get(name, name) in fields:
            key = RENAMED.get(name, name)
            if name == "moe_layer_freq":
                value = eval(str(value), {"__builtins__": {}})  # Megatron-LM's moe_freq_type evaluates it so
            elif value is not True:
                default = fields[key].default
                value = float(value) if isinstance(default, float) else int(value) if str(value).lstrip("-").isdigit() else value
            kw[key] = value
    return kw, model


def count(text: str) -> int:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from autopar.export.megatron import launch_tokens
    kw, model = config_kwargs(launch_tokens(text)[1])
    vocab = int(text.split("with a vocabulary of ")[1].split(":")[0])
    cfg = TransformerConfig(**kw, use_cpu_initialization=True, perform_initialization=False)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    with torch.device("meta"):
        gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab,
                       max_sequence_length=int(model["max_position_embeddings"]), position_embedding_type="rope",
                       rotary_percent=float(model.get("rotary_percent", 1.0)),
                       rotary_base=int(model.get("rotary_base", 10000)),
                       share_embeddings_and_output_weights="untie_embeddings_and_output_weights" not in model)
    return sum(p.numel() for p in gpt.parameters())


def main() -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's RoPE asks for a device this CPU torch lacks
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    for path in sys.argv[2:]:
        print(count(Path(path).read_text()))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
