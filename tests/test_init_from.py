"""--init-from: BERT's phase 2 and continued pretraining start from trained weights (weights only),
take the source's tokenizer and shape, say in one line what does not fit, and resume their own
checkpoints after a crash."""
import os
import re

import pytest
import torch
from conftest import FAST, crash_at, final_weights, plain, run, run_main, summary

import data_stream
import pretrain_ddp as P

pytestmark = pytest.mark.slow  # every test here starts the trainer


@pytest.fixture(scope="module")
def phase1(corpus, tok_dir, tmp_path_factory):
    """An mlm run at 32 tokens (its model has BERT's 512 positions) with the session tokenizer."""
    out = str(tmp_path_factory.mktemp("phase1") / "run")
    run_main("--corpus", corpus, "--tokenizer", tok_dir, "--out-dir", out, "--objective", "mlm", *FAST,
             "--max-steps", "4")
    return out


def body(state):
    """The weights a phase 2 takes over (the NSP head and pooler may start fresh)."""
    return {k: v for k, v in state.items() if not k.startswith(("cls.seq_relationship", "bert.pooler"))}


def test_phase2_takes_weights_and_tokenizer_then_resumes_its_own(tmp_path, corpus, phase1):
    out = str(tmp_path / "phase2")
    # lr 0: AdamW moves nothing, so the weights saved are what the run started from
    cmd = plain("--corpus", corpus, "--init-from", phase1, "--objective", "nsp", *FAST, "--max-seq-len", "64",
                "--lr", "0", "--out-dir", out, "--max-steps", "3", "--save-every", "1")
    rc, stdout, stderr = run(cmd, crash_at(r"^step 2:"))  # SIGKILL, as a crash would
    assert rc != 0 and "initialised from" in stdout and "step_000004" in stdout, stderr[-3000:]
    assert "the NSP head starts fresh" in stderr
    source, started = body(final_weights(phase1)), body(final_weights(out))
    assert source.keys() == started.keys() and all(torch.equal(source[k], started[k]) for k in source)
    assert set(final_weights(out)) > set(source)  # the NSP head is there, fresh
    # its tokenizer is the source's (no --tokenizer given, none trained)
    assert data_stream.tokenizer_hash(data_stream.get_tokenizer(os.path.join(out, "tokenizer"))) == \
        data_stream.tokenizer_hash(data_stream.get_tokenizer(os.path.join(phase1, "tokenizer")))
    # the same command again: it resumes its own checkpoint, not the source
    _, stdout, stderr = run_main(*cmd[2:])
    assert f"resumed from {out}/checkpoints/step_00000" in stdout and "initialised" not in stdout
    assert "has checkpoints of its own" in stderr
    assert summary(out)["steps"] == 3  # a plan of its own from step 0, not the source's step 4


def test_a_hugging_face_folder_of_any_shape_starts_a_run_and_what_does_not_fit_is_one_line(tmp_path, corpus, tok_dir,
                                                                                            phase1):
    from transformers import BertConfig, BertModel
    # A Hugging Face BertModel of a shape not in MODEL_SIZES, without heads and without a tokenizer.
    bare = str(tmp_path / "bare")
    config = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=256, max_position_embeddings=128)
    BertModel(config).save_pretrained(bare)
    out = str(tmp_path / "from_bare")
    result = run(plain("--corpus", corpus, "--init-from", bare, "--tokenizer", tok_dir, *FAST, "--out-dir", out,
                       "--max-steps", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BERT-3L-64H-2A nsp" in result.stdout
    assert "the MLM head starts fresh" in result.stderr and "the NSP head starts fresh" in result.stderr
    assert "LOAD REPORT" not in result.stderr  # transformers' table is replaced by the one line
    small_vocab = str(tmp_path / "small_vocab")
    BertModel(BertConfig(**{**config.to_dict(), "vocab_size": 100})).save_pretrained(small_vocab)
    roberta = tmp_path / "roberta"
    roberta.mkdir()
    (roberta / "config.json").write_text('{"model_type": "roberta"}')
    base = ["--corpus", corpus, "--out-dir", str(tmp_path / "o"), *FAST]
    # One case end to end (exit code 2, one line, no traceback), the others where rank 0 decides, in-process.
    result = run(plain(*base, "--init-from", bare), timeout=180)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "has no tokenizer: give the one its model was trained with (--tokenizer DIR)" in result.stderr
    data_stream.get_tokenizer(None, [corpus], vocab_size=200).save_pretrained(str(tmp_path / "other_tok"))
    cases = [(["--init-from", bare, "--tokenizer", tok_dir, "--model-size", "mini"],
              "--model-size mini differs from --init-from"),
             (["--init-from", bare, "--tokenizer", tok_dir, "--max-seq-len", "200"],
              "--max-seq-len 200 exceeds the 128 positions"),
             (["--init-from", small_vocab, "--tokenizer", tok_dir], "embeds 100"),
             (["--init-from", phase1, "--tokenizer", str(tmp_path / "other_tok")],
              "is not the tokenizer of --init-from"),
             (["--init-from", str(roberta)], "holds a roberta model"),
             (["--init-from", str(tmp_path)], "is not a checkpoint folder, a run's out dir or a Hugging Face")]
    for extra, message in cases:
        with pytest.raises(P.USER_ERRORS, match=re.escape(message)):
            P.plan_run(P.parse_args([*base, *extra]), torch.device("cpu"), None, P.Rank0Only())
