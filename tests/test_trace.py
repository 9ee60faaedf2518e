"""The tracer on the built-in models: exact parameter and FLOP counts, blocks traced once,
activation bytes against Korthikanti et al. 2022, one-line errors."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopar.errors import UserError
from autopar.model import build_model
from autopar.spec import PRESETS, PUBLISHED_PARAMS, parse_model_spec
from autopar.trace import (find_repeated_blocks, korthikanti_bytes_per_token, profile_from_graph, trace_module,
                           trace_spec)

# Narayanan et al. SC'21 Table 1: (name, published params in billions).
TABLE1 = [("1.7b", 1.7), ("3.6b", 3.6), ("7.5b", 7.5), ("18.4b", 18.4), ("39.1b", 39.1),
          ("76.1b", 76.1), ("145.6b", 145.6), ("310.1b", 310.1), ("529.6b", 529.6), ("1t", 1008.0)]


def narayanan_params(l: int, h: int, V: int, s: int) -> int:
    """Narayanan Eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)), expanded to integers."""
    return 12 * l * h * h + 13 * l * h + (V + s) * h


@pytest.mark.parametrize("name, billions", TABLE1)
def test_megatron_params_match_eq2(name, billions):
    spec = PRESETS[f"megatron-{name}"]
    graph = trace_spec(spec)
    # Eq. 2 omits the final LayerNorm (2h) that the model has before the output head.
    assert graph.params == narayanan_params(spec.layers, spec.hidden, spec.vocab, spec.seq) + 2 * spec.hidden
    # The table prints sizes rounded to 0.1B (1.652B is listed as 1.7).
    assert abs(graph.params / 1e9 - billions) <= 0.05


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "gpt2", "gpt2-medium",
                                  "gpt2-large", "gpt2-xl"])
def test_presets_match_published_sizes(name):
    assert trace_spec(PRESETS[name]).params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.005)


def test_repeated_blocks_traced_once():
    graph = trace_spec(PRESETS["llama3-70b"])
    (block,) = graph.blocks
    assert block.count == 80 and block.kind == "Block" and graph.capture == "torch.fx"
    assert block.names[0] == "layers.0" and block.names[-1] == "layers.79"
    assert len(block.nodes) > 20  # one repeat is measured inside ...
    assert all(not n.module.startswith("layers.") for n in graph.nodes)  # ... none at the top
    assert (block.heads, block.kv_heads, block.head_dim) == (64, 8, 128)
    splits = {lin.name.split(".", 2)[2]: lin.split for lin in block.linears}
    assert splits == {"attn.q.weight": "column", "attn.k.weight": "column", "attn.v.weight": "column",
                      "attn.o.weight": "row", "mlp.gate.weight": "column", "mlp.up.weight": "column",
                      "mlp.down.weight": "row"}
    assert graph.vocab_parallel == ("embed.tok", "output")


def test_gpt_model_flops_equal_narayanan():
    spec = PRESETS["gpt3-175b"]
    graph = trace_spec(spec)
    prof = profile_from_graph(graph, spec)
    B, s, L, h, V = 1, spec.seq, spec.layers, spec.hidden, spec.vocab
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert graph.training_flops == pytest.approx(expected, rel=1e-9)
    assert prof.model_flops_per_token() * s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("text", ["gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16,tied=0",
                                  "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,vocab=128,seq=16"])
def test_forward_flops_match_flop_counter(text):
    spec = parse_model_spec(text)
    graph = trace_spec(spec, micro_batch=2)
    model = build_model(spec, "meta")
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(2, spec.seq, dtype=torch.long, device="meta"))
    assert graph.flops == counter.get_total_flops()


def test_gpt_activations_match_korthikanti_table2():
    """Korthikanti Table 2 (no parallelism, 16-bit): sbh(34 + 5as/h) bytes per layer. The Megatron
    recipe run keeps exactly its items: LayerNorm inputs 4h, QKV and MLP inputs 4h, dropout masks
    2h (replicated, 10h); Q, K, V, the output projection's input, GELU in and out (sharded, 24h);
    softmax 2as, its dropout mask as, the dropped probabilities 2as (attention core, 5as). The
    LayerNorms' float32 mean and rstd (16 bytes per token) are the only extra."""
    spec = PRESETS["gpt3-175b"]
    graph = trace_spec(spec)
    (block,) = graph.blocks
    tokens, h, a, s = graph.tokens, spec.hidden, spec.heads, spec.seq
    recipe = block.recipe_activations
    assert (recipe.replicated, recipe.sharded, recipe.attn) == ((10 * h + 16) * tokens, 24 * h * tokens,
                                                                5 * a * s * tokens)
    assert recipe.total / tokens == pytest.approx(korthikanti_bytes_per_token(spec), rel=0.02)
    prof = profile_from_graph(graph, spec)
    assert prof.block_act_bytes_attn_per_token == 5 * a * s
    # As written (SDPA, no dropout) with FlashAttention: no masks (8h), Q, K, V and the output
    # (kept once: the projection's input is a view of it) plus the MLP (24h), and a float32
    # logsumexp per head instead of the s x s core: 32h + 4a (+16) bytes per token.
    measured = block.activations
    assert (measured.replicated, measured.sharded, measured.attn) == ((8 * h + 16) * tokens, 24 * h * tokens,
                                                                      4 * a * tokens)


def test_llama_activations_are_explained():
    """Built-in Llama: RMSNorm keeps its input and a float32 rstd (8h + 8); Q and K after RoPE,
    V, the output (4h + 4 kv) and SwiGLU's gate, SiLU, up and product (8f) are sharded."""
    spec = PRESETS["llama3-8b"]
    graph = trace_spec(spec)
    (block,) = graph.blocks
    h, kv, f, a = spec.hidden, spec.num_kv_heads * spec.head_dim, spec.ffn_hidden, spec.heads
    per_token = block.activations
    assert per_token.replicated == (8 * h + 8) * graph.tokens
    assert per_token.sharded == (4 * h + 4 * kv + 8 * f) * graph.tokens
    assert per_token.attn == 4 * a * graph.tokens
    # The Megatron recipe repeats KV heads for its unfused core (4h instead of 4 kv) and keeps
    # the softmax output (2as; no dropout in Llama's recipe).
    recipe = block.recipe_activations
    assert recipe.sharded == (8 * h + 8 * f) * graph.tokens
    assert recipe.attn == 2 * a * spec.seq * graph.tokens


def test_find_repeated_blocks_groups_identical_siblings():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8)])

        def forward(self, x):
            return self.a[2](self.a[1](self.a[0](x)))

    assert find_repeated_blocks(Net()) == [["a.0", "a.1"]]


def test_one_leading_block_of_another_kind_is_a_kind():
    """GLM-4.5's one dense block before its mixture-of-experts ones is a block kind of its own
    (the leading kind), not a module outside the blocks; a different block after them is not."""
    class Net(nn.Module):
        def __init__(self, lead: bool):
            super().__init__()
            odd, same = nn.Linear(4, 8), [nn.Linear(4, 4) for _ in range(3)]
            self.a = nn.ModuleList([odd, *same] if lead else [*same, odd])

    assert find_repeated_blocks(Net(lead=True)) == [["a.0"], ["a.1", "a.2", "a.3"]]
    assert find_repeated_blocks(Net(lead=False)) == [["a.0", "a.1", "a.2"]]


class Branchy(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_untraceable_module_gives_one_line_error_naming_module_and_op():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.gate = Branchy()

        def forward(self, x):
            return self.gate(self.proj(x))

    with torch.device("meta"), pytest.raises(UserError) as err:
        trace_module(Net(), torch.zeros(2, 4))
    message = str(err.value)
    assert "\n" not in message
    assert "gate (Branchy)" in message and "x.sum() > 0" in message


def test_moe_preset_needs_no_gpt_experts():
    with pytest.raises(UserError, match="moe:"):
        parse_model_spec("gpt:layers=2,hidden=64,heads=4,vocab=128,seq=16,experts=4,topk=2")
