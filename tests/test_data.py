"""Token files (``autopar.data``): tokenize round trips, the uint16/uint32 convention, the
batches of each step, the vocabulary check, and the data position a checkpoint keeps."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from autopar.cli import DEMO_TEXT, app
from autopar.data import batch_tokens, open_corpus, sample_windows, token_dtype, tokenize_file
from autopar.errors import UserError
from autopar.plan import Mesh, Plan
from autopar.runtime import checkpoint
from autopar.runtime.context import ParallelContext
from autopar.runtime.train import TrainConfig, build_program, corpus_batch, train

runner = CliRunner()
TINY = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16,tied=0"


def one_process(model: str = TINY, batch: int = 8) -> Plan:
    return Plan(model=model, cluster="cpu-local", gpus=1, global_batch=batch, seq_len=16, dtype="fp32", mesh=Mesh(),
                micro_batch_size=batch, num_microbatches=1, stage_layers=(2,), recompute=("none",) * 2)


def one_line_error(res, fragment: str) -> None:
    assert res.exit_code == 2, res.output
    assert fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_byte_level_round_trip(tmp_path):
    """Every byte (UTF-8 of non-ASCII text, NUL, 0xff) comes back as itself, as uint16 ids."""
    text = tmp_path / "t.txt"
    raw = "naïve café — ∑\n".encode() + bytes([0, 255, 10])
    text.write_bytes(raw)
    res = runner.invoke(app, ["tokenize", str(text), "--out", str(tmp_path / "t.bin")])
    assert res.exit_code == 0, res.output
    assert f"wrote {len(raw)} tokens (uint16, vocabulary 256)" in res.stdout
    assert (tmp_path / "t.bin").stat().st_size == 2 * len(raw)
    corpus = open_corpus(tmp_path / "t.bin")
    assert corpus.tokens.dtype == np.dtype("<u2") and bytes(corpus.tokens.astype(np.uint8)) == raw
    # The same bytes named *.u32 are written 4 bytes an id, and read back so.
    tokenize_file(text, tmp_path / "t.u32.bin")
    wide = open_corpus(tmp_path / "t.u32.bin")
    assert wide.tokens.dtype == np.dtype("<u4") and (tmp_path / "t.u32.bin").stat().st_size == 4 * len(raw)
    assert np.array_equal(wide.tokens, corpus.tokens)
    assert token_dtype("train.bin") == np.dtype("<u2") and token_dtype("x/train.u32") == np.dtype("<u4")


def test_hf_tokenizer_round_trip_and_uint32(tmp_path):
    """A tokenizers BPE (byte-level) round-trips the demo text; a vocabulary over 65,536 ids
    needs a *.u32 file (one-line error otherwise) and keeps its large ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(DEMO_TEXT)], trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    tok.save(str(tmp_path / "bpe.json"))
    res = runner.invoke(app, ["tokenize", str(DEMO_TEXT), "--out", str(tmp_path / "d.bin"),
                              "--tokenizer", str(tmp_path / "bpe.json")])
    assert res.exit_code == 0, res.output
    ids = open_corpus(tmp_path / "d.bin").tokens
    assert 0 < len(ids) < DEMO_TEXT.stat().st_size and ids.max() < 400
    assert tok.decode(ids.tolist()) == DEMO_TEXT.read_text()

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    big = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "w.txt").write_text("w69999 w1 w65536 nope")
    res = runner.invoke(app, ["tokenize", str(tmp_path / "w.txt"), "--out", str(tmp_path / "w.bin"),
                              "--tokenizer", str(tmp_path / "big.json")])
    one_line_error(res, "70,000 ids, more than a uint16 file holds; name the output w.bin.u32")
    assert not (tmp_path / "w.bin").exists()
    done = tokenize_file(tmp_path / "w.txt", tmp_path / "w.u32", tmp_path / "big.json")
    assert done.dtype == "uint32" and done.vocab == 70_000
    assert open_corpus(tmp_path / "w.u32").tokens.tolist() == [69999, 1, 65536, 0]


@pytest.mark.parametrize("content, name, fragment", [
    (None, "missing.bin", "does not exist; write one with `autopar tokenize"),
    (b"abc", "odd.bin", "not a whole number of 2-byte ids"),
    (bytes(6), "odd.u32", "not a whole number of 4-byte ids"),
    (bytes(2 * 16), "short.bin", "16 tokens, fewer than one training sequence of 16"),
], ids=["missing", "odd uint16", "odd uint32", "short"])
def test_bad_token_files_are_one_line(tmp_path, content, name, fragment):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(fragment)):
        open_corpus(path, seq_len=16)
    plan = tmp_path / "plan.json"
    one_process().save(plan)
    one_line_error(runner.invoke(app, ["run", str(plan), "--data", str(path)]), fragment)


def test_batches_are_a_function_of_the_sample(tmp_path):
    """Each epoch visits every window once; the batch at sample s is the same whatever the
    plan (only global batch and sequence length matter); targets are inputs shifted by one."""
    for windows in (1, 2, 7, 10, 125, 128):
        order = sample_windows(0, 3 * windows, windows)
        for epoch in range(3):
            assert sorted(order[epoch * windows:(epoch + 1) * windows]) == list(range(windows))
    ids = np.arange(1000, dtype=np.uint16) % 251
    ids.tofile(tmp_path / "c.bin")
    corpus = open_corpus(tmp_path / "c.bin", 16)
    rows = batch_tokens(corpus, 40, 8, 16, 256)
    assert rows.shape == (8, 17) and rows.dtype == np.int64
    for row, window in zip(rows, sample_windows(40, 8, corpus.windows(16))):
        assert row.tolist() == ids[window * 16:window * 16 + 17].tolist()
    plan_a, plan_b = one_process(batch=8), one_process(batch=8)
    x, y = corpus_batch(corpus, plan_a, 40, 256)
    assert torch.equal(x, torch.from_numpy(rows[:, :-1])) and torch.equal(y, torch.from_numpy(rows[:, 1:]))
    assert torch.equal(corpus_batch(corpus, plan_b, 40, 256)[0], x)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    ids = np.full(200, 7, dtype=np.uint16)
    ids[150] = 300
    ids.tofile(tmp_path / "wide.bin")
    corpus = open_corpus(tmp_path / "wide.bin", 16)
    with pytest.raises(UserError, match=r"has id 300 \(token 150\), not below the model's vocabulary of 256") as err:
        batch_tokens(corpus, 0, 12, 16, 256)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_run_refuses_ids_beyond_the_vocabulary_in_one_line(tmp_path):
    """Through `autopar run`: the worker's check reaches the command line as one line, exit 2."""
    ids = np.full(100, 300, dtype=np.uint16)
    ids.tofile(tmp_path / "wide.bin")
    one_process().save(tmp_path / "plan.json")
    res = runner.invoke(app, ["run", str(tmp_path / "plan.json"), "--data", str(tmp_path / "wide.bin"), "--steps", "1"])
    one_line_error(res, "has id 300 (token 0), not below the model's vocabulary of 256")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_keeps_the_data_position(tmp_path):
    """One process: 2 steps of batch 8 then a save keep sample 16; a plan of batch 4 resumes
    there. A checkpoint without the position (older autopar) reads as None."""
    (np.frombuffer(DEMO_TEXT.read_bytes(), dtype=np.uint8).astype(np.uint16)).tofile(tmp_path / "d.bin")
    cfg = TrainConfig(data=tmp_path / "d.bin")
    ctx = ParallelContext(mesh=None, device=torch.device("cpu"))
    plan = one_process(batch=8)
    prog = build_program(plan, ctx, cfg)
    train(plan, 2, ctx, cfg, program=prog)
    checkpoint.save(prog, tmp_path / "ck", step=2, samples=16)
    small = one_process(batch=4)
    resumed = build_program(small, ctx, cfg)
    from autopar.checkpoint_dir import resolve
    assert checkpoint.load(resumed, resolve(tmp_path / "ck", trust_code=False)) == checkpoint.Position(step=2, samples=16)
    import torch.distributed.checkpoint as dcp
    dcp.save({**checkpoint._merged(prog, checkpoint._stages(prog)), "step": 2}, checkpoint_id=str(tmp_path / "old"))
    old = resolve(tmp_path / "old", trust_code=True)  # no manifest: an older autopar's, trusted explicitly
    assert checkpoint.load(resumed, old) == checkpoint.Position(step=2, samples=None)
