"""The tracer: exact parameter and FLOP counts of the built-in models, traced on meta."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopar.errors import UserError
from autopar.model import build_model
from autopar.spec import PRESETS, parse_model_spec
from autopar.trace import find_repeated_blocks, profile_from_graph, trace_module, trace_spec

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


def test_llama3_sizes():
    for name, billions in [("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9)]:
        assert trace_spec(PRESETS[name]).params / 1e9 == pytest.approx(billions, rel=0.005)


def test_repeated_blocks_traced_once():
    graph = trace_spec(PRESETS["llama3-70b"])
    (block,) = graph.blocks
    assert block.count == 80 and block.kind == "Block"
    calls = [n for n in graph.nodes if n.target in block.names]
    assert len(calls) == 80  # the blocks are leaves of the top graph ...
    assert len(block.nodes) > 20  # ... and one repeat is traced inside


def test_gpt_model_flops_equal_narayanan():
    spec = PRESETS["gpt3-175b"]
    prof = profile_from_graph(trace_spec(spec), spec)
    B, s, L, h, V = 1, spec.seq, spec.layers, spec.hidden, spec.vocab
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
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


def test_find_repeated_blocks_groups_identical_siblings():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8)])

        def forward(self, x):
            return self.a[2](self.a[1](self.a[0](x)))

    assert find_repeated_blocks(Net()) == [["a.0", "a.1"]]


def test_untraceable_module_gives_one_line_error():
    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(UserError, match="torch.fx could not trace the model \\(Branchy\\)") as err:
        trace_module(Branchy(), torch.zeros(2, device="meta"))
    assert "\n" not in str(err.value)
