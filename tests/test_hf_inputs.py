"""``hf:`` specs: the shape read from each family's config, and bad configs as one line, exit 2."""

import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from autopar.cli import app  # noqa: E402
from autopar.hf import build_hf  # noqa: E402
from autopar.spec import parse_model_spec  # noqa: E402

runner = CliRunner()
BASE = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,vocab_size=128"

# Tiny configs of each family; the MLP width (96 where set) is unlike every other dimension.
# (layers, hidden, heads, kv_heads, ffn, vocab, seq, tied) as the family's modelling code builds it.
FAMILIES = {
    # FalconAttention: one shared K/V head with the old architecture and multi_query (defaults);
    # ffn_hidden_size defaults to 4 x hidden.
    "falcon-multi-query": (f"hf:FalconConfig:{BASE},seq=16", (2, 64, 4, 1, 256, 128, 16, True)),
    "falcon-multi-head": (f"hf:FalconConfig:{BASE},multi_query=False,num_kv_heads=4,ffn_hidden_size=96,seq=16",
                          (2, 64, 4, 4, 96, 128, 16, True)),
    "falcon-new-architecture": (f"hf:FalconConfig:{BASE},new_decoder_architecture=True,num_kv_heads=2,seq=16",
                                (2, 64, 4, 2, 256, 128, 16, True)),
    # Bloom: n_layer/n_head, a 4h MLP, ALiBi (no maximum positions: seq= is required).
    "bloom": ("hf:BloomConfig:n_layer=2,hidden_size=64,n_head=4,vocab_size=128,seq=16",
              (2, 64, 4, 4, 256, 128, 16, True)),
    "opt": ("hf:OPTConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,ffn_dim=96,vocab_size=128,"
            "word_embed_proj_dim=64,max_position_embeddings=16", (2, 64, 4, 4, 96, 128, 16, True)),
    "stablelm": (f"hf:StableLmConfig:{BASE},num_key_value_heads=2,intermediate_size=96,max_position_embeddings=16",
                 (2, 64, 4, 2, 96, 128, 16, False)),
    "phi3": (f"hf:Phi3Config:{BASE},num_key_value_heads=2,intermediate_size=96,pad_token_id=None,"
             "max_position_embeddings=16", (2, 64, 4, 2, 96, 128, 16, False)),
    "gemma2": (f"hf:Gemma2Config:{BASE},num_key_value_heads=2,head_dim=16,intermediate_size=96,"
               "max_position_embeddings=16", (2, 64, 4, 2, 96, 128, 16, True)),
    "gpt-neox": (f"hf:GPTNeoXConfig:{BASE},intermediate_size=96,max_position_embeddings=16",
                 (2, 64, 4, 4, 96, 128, 16, False)),
    # MPT: n_layers/d_model/n_heads/max_seq_len; MptMLP is 4 x d_model whatever expansion_ratio says.
    "mpt": ("hf:MptConfig:n_layers=2,d_model=64,n_heads=4,vocab_size=128,max_seq_len=16,expansion_ratio=3",
            (2, 64, 4, 4, 256, 128, 16, True)),
    "gpt-bigcode": ("hf:GPTBigCodeConfig:n_layer=2,n_embd=64,n_head=4,vocab_size=128,n_positions=16",
                    (2, 64, 4, 1, 256, 128, 16, True)),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_spec_reads_each_family(name):
    """The spec's fields are what the family's model builds: the attention's weights are
    hidden x head_dim x (2 heads + 2 kv_heads) (Q and output, K and V), a block weight has the
    MLP width, and the head is the embedding exactly when ``tied``."""
    text, want = FAMILIES[name]
    spec = parse_model_spec(text)
    got = (spec.layers, spec.hidden, spec.heads, spec.num_kv_heads, spec.ffn_hidden, spec.vocab, spec.seq,
           spec.tied)
    assert got == want
    model = build_hf(spec, torch.float32)
    [blocks] = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == spec.layers]
    attention = next(m for m in blocks[0].modules() if "Attention" in type(m).__name__)
    attn_weights = sum(p.numel() for p in attention.parameters() if p.dim() == 2)
    assert attn_weights == spec.hidden * spec.head_dim * 2 * (spec.heads + spec.num_kv_heads)
    assert any(spec.ffn_hidden in p.shape for p in blocks[0].parameters() if p.dim() == 2)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == spec.tied


LLAMA = f"hf:LlamaConfig:{BASE},seq=16"
BAD = [
    ("hf:LlamaConfig:num_hidden_layers=abc", "LlamaConfig(num_hidden_layers) failed: "),
    ("hf:LlamaConfig:num_hidden_layers=-1", "num_hidden_layers=-1 must be a positive integer"),
    ("hf:GPT2Config:n_layer=0", "num_hidden_layers=0 must be a positive integer"),
    ("hf:LlamaConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=5", "not a multiple"),
    (f"{LLAMA},rms_norm_eps=abc", "field 'rms_norm_eps'"),
    ("hf:LlamaConfig:rope_scaling=3", "rope_parameters"),
    (f"{LLAMA},hidden_act=nope", "check hidden_act='nope'"),
    (f"hf:FalconConfig:{BASE},activation=bogus,seq=16", "check activation='bogus'"),
    (f"hf:Phi3Config:{BASE},intermediate_size=96", "pad_token_id=32000 is not a token id of vocab_size=128"),
    ("hf:BloomConfig:n_layer=2,hidden_size=64,n_head=4,vocab_size=128", "add seq=S"),
    ("hf:LlamaConfig:seq=abc", "must be a positive integer"),
    ("hf:T5Config:num_layers=2,d_model=64,num_heads=4,vocab_size=128,seq=16",
     "not supported: T5Config is an encoder-decoder model; autopar plans decoder-only causal LMs"),
    ("hf:BartConfig:seq=16", "not supported: BartConfig is an encoder-decoder model"),
    ("hf:ViTConfig:seq=16", "not supported: ViTConfig is not a causal LM"),
    ("hf:NoSuchConfig", "is not a transformers config class"),
]
COMMANDS = {
    "inspect": ["inspect"],
    "plan": ["plan", "--cluster", "cpu-local", "--gpus", "2", "--global-batch", "4"],
    "estimate": ["estimate", "--cluster", "cpu-local", "--gpus", "2", "--global-batch", "4", "--tp", "1"],
}


@pytest.mark.parametrize("model, fragment", BAD)
@pytest.mark.parametrize("command", COMMANDS)
def test_bad_hf_config_is_one_line_and_exit_2(command, model, fragment):
    res = runner.invoke(app, [*COMMANDS[command], "--model", model])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("autopar: error: ") and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.output


def test_bad_hf_config_through_the_console_script_is_one_line():
    """transformers logs its own warnings on a bad value (here: pad and eos ids outside the
    vocabulary); the command still prints only its one line."""
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "inspect", "--model",
                           f"hf:Phi3Config:{BASE},intermediate_size=96"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("autopar: error: Phi3Config: pad_token_id=32000") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
