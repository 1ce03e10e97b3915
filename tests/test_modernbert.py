"""--arch modernbert (issue 51): model.encode_modern against the stock ModernBertForMaskedLM (sdpa, padded rows,
one sequence a row): the same logits and gradients, at 128 tokens and at 512 (where the local layers' band is
narrower than a sequence), packed and not; its classifier; and the run, the export and fine-tuning."""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    FAST,
    Launch,
    common,
    crash_at,
    final_weights,
    one_line_plan_errors,
    run,
    run_main,
    same_weights,
    summary,
    torchrun,
    wait_for,
)
from test_finetune import finetunes_alike

import model as M
import pretrain_ddp as P


def sequences(lengths, vocab, seed):
    """Token ids of the given lengths ([CLS] 2 first), about 15% of them masked (4) with their targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(5, vocab, (n,), generator=g)
        ids[0] = 2
        labels = torch.full((n,), -100)
        chosen = torch.rand(n, generator=g) < 0.15
        chosen[0] = False
        chosen[n // 2] = True
        labels[chosen] = ids[chosen]
        ids[chosen] = 4
        out.append((ids, labels))
    return out


def padded(seqs):
    """One sequence a row, padded with 0: what the stock class reads."""
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, (i, lab) in enumerate(seqs):
        ids[r, :len(i)], labels[r, :len(i)], mask[r, :len(i)] = i, lab, 1
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask, "labels": labels}


def packed(seqs, width):
    """The sequences in order into rows of `width` (a new row where the next does not fit), as data_stream's
    collate packs: position_ids from 0 and sequence_ids per sequence, -1 on padding."""
    rows, row, used = [], [], 0
    for s in seqs:
        if used + len(s[0]) > width:
            rows.append(row)
            row, used = [], 0
        row.append(s)
        used += len(s[0])
    rows.append(row)
    shape = (len(rows), -(-max(sum(len(i) for i, _ in r) for r in rows) // 8) * 8)
    batch = {"input_ids": torch.zeros(shape, dtype=torch.long), "labels": torch.full(shape, -100),
             "position_ids": torch.zeros(shape, dtype=torch.long), "sequence_ids": torch.full(shape, -1)}
    number = 0
    for r, row in enumerate(rows):
        at = 0
        for ids, labels in row:
            cols = slice(at, at + len(ids))
            batch["input_ids"][r, cols], batch["labels"][r, cols] = ids, labels
            batch["position_ids"][r, cols] = torch.arange(len(ids))
            batch["sequence_ids"][r, cols] = number
            number, at = number + 1, at + len(ids)
    batch["token_type_ids"] = torch.zeros(shape, dtype=torch.long)
    batch["attention_mask"] = (batch["sequence_ids"] >= 0).long()
    return batch


def grads(net):
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("width,lengths", [(128, [128, 70, 31, 100, 9]), (512, [512, 300, 150, 201, 90])])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_modernbert_logits_and_gradients_are_the_stock_models(width, lengths, layout):
    """Our forward (the real tokens only, RoPE at each sequence's own positions, the band of the local layers
    inside each sequence, the head at the masked positions only) gives, per sequence, the stock
    ModernBertForMaskedLM's logits on padded rows (sdpa) within 1e-4 and its gradients in every weight; at
    512 tokens the band (64 each side) is narrower than the sequences, and a packed row holds several."""
    torch.manual_seed(0)
    hf = M.model_from(M.new_architecture("tiny", 300, width, 0, arch="modernbert"), "mlm", 0.0)
    # tiny: 2 layers, global then local (a third layer would be local, a fourth global again)
    assert [layer.attention_type for layer in hf.model.layers] == ["full_attention", "sliding_attention"]
    assert hf.decoder.weight is hf.model.embeddings.tok_embeddings.weight
    seqs = sequences(lengths, 300, 1)
    raw = padded(seqs) if layout == "padded" else packed(seqs, width)
    batch, counts = M.prepare(M.sparse_targets({k: v.clone() for k, v in raw.items()}), torch.device("cpu"))
    assert ("real_pos" in batch) and (("sequence_ids" in batch) == (layout == "packed"))
    net = M.Pretraining(hf).train()  # dropout 0: training's path, no RNG
    ours, _ = net.logits(**{k: v for k, v in batch.items() if k != "masked_targets"})
    F.cross_entropy(ours, batch["masked_targets"], reduction="sum").backward()
    ours_grads = grads(hf)
    hf.zero_grad()
    stock = padded(seqs)
    chosen = stock["labels"] != -100
    logits = hf(input_ids=stock["input_ids"], attention_mask=stock["attention_mask"]).logits[chosen]
    F.cross_entropy(logits, stock["labels"][chosen], reduction="sum").backward()
    assert ours.shape == logits.shape and counts["num_masked"] == int(chosen.sum())
    assert torch.allclose(ours, logits, atol=1e-4), (ours - logits).abs().max()
    stock_grads = grads(hf)
    assert ours_grads.keys() == stock_grads.keys()
    for name, g in ours_grads.items():
        assert torch.allclose(g, stock_grads[name], atol=1e-5, rtol=1e-4), name


def test_the_band_and_the_positions_matter():
    """What the parity above rests on, each broken once: without the band at 512 tokens, or with a packed row's
    sequences attending to each other, our logits leave the stock model's."""
    torch.manual_seed(0)
    hf = M.model_from(M.new_architecture("tiny", 300, 512, 0, arch="modernbert"), "mlm", 0.0).eval()
    for weight in hf.parameters():  # 10x the init's scale: a fresh model's context barely moves its logits
        if weight.ndim == 2:
            torch.nn.init.normal_(weight, std=0.2)
    seqs = sequences([300, 150, 100], 300, 2)  # two rows
    stock = padded(seqs)
    chosen = stock["labels"] != -100
    with torch.no_grad():
        reference = hf(input_ids=stock["input_ids"], attention_mask=stock["attention_mask"]).logits[chosen]
        batch, _ = M.prepare(M.sparse_targets(packed(seqs, 512)), torch.device("cpu"))
        del batch["masked_targets"]
        net = M.Pretraining(hf).eval()
        assert torch.allclose(net.logits(**batch)[0], reference, atol=1e-4)
        # RoPE is relative: positions running on across a row would give the same scores (to rounding); the
        # sequences' separation is what packing must keep
        mixed = {**batch, "sequence_ids": (batch["sequence_ids"] >= 0).long() - 1 + (batch["sequence_ids"] >= 0)}
        assert not torch.allclose(net.logits(**mixed)[0], reference, atol=1e-2)
        hf.config.sliding_window = 10_000
        assert not torch.allclose(net.logits(**batch)[0], reference, atol=1e-2)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classify_is_the_stock_sequence_classifier(pooling):
    """model.classify on a ModernBertForSequenceClassification (its classifier_pooling the pooling asked for)
    gives the stock class's logits on padded rows longer than the band, within 1e-5, with its gradients."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification
    torch.manual_seed(0)
    architecture = {k: v for k, v in M.new_architecture("tiny", 300, 512, 0, arch="modernbert").items() if k != "arch"}
    clf = ModernBertForSequenceClassification(ModernBertConfig(**architecture, num_labels=3,
                                                               classifier_pooling=pooling)).eval()
    stock = padded(sequences([200, 150, 7], 300, 3))
    ours = M.classify(clf, stock["input_ids"], stock["token_type_ids"], stock["attention_mask"], pooling)
    ours.sum().backward()
    ours_grads = grads(clf)
    clf.zero_grad()
    reference = clf(input_ids=stock["input_ids"], attention_mask=stock["attention_mask"]).logits
    reference.sum().backward()
    assert torch.allclose(ours, reference, atol=1e-5), (ours - reference).abs().max()
    for name, g in grads(clf).items():
        assert torch.allclose(ours_grads[name], g, atol=1e-5, rtol=1e-4), name


def test_flops_count_the_band_and_the_glu():
    """counts_of's local pairs are those within 64 of each other in a sequence (counted against a mask), and
    train_flops charges them to the local layers, GeGLU's three matrices to every layer."""
    lengths = [200, 65, 3]
    mask = torch.zeros(3, 200, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    counts = M.counts_of(mask, None, None)
    near = torch.arange(200)
    band = (near[:, None] - near[None, :]).abs() <= 64
    assert counts["num_attended_local"] == sum(int(band[:n, :n].sum()) for n in lengths)
    assert counts["num_attended"] == sum(n * n for n in lengths)
    counts["num_masked"] = 30
    hf = M.model_from(M.new_architecture("tiny", 8192, 512, 0, arch="modernbert"), "mlm", 0.0)
    h, ff = 128, M.glu_width(128)
    assert ff == 336 and hf.config.intermediate_size == ff
    body = counts["num_tokens"] * 2 * 2 * (4 * h * h + 3 * h * ff)
    attention = 2 * 2 * h * (counts["num_attended"] + counts["num_attended_local"])  # one global, one local
    assert M.train_flops(hf, counts) == 3 * (body + attention + 2 * (h * h + h * 8192) * 30)


# ----------------------------------------------------------------------------- the trainer, the export, fine-tuning

MODERN = ["--arch", "modernbert", "--objective", "mlm", "--max-seq-len", "128", "--dropout", "0"]


@pytest.fixture(scope="module")
def modern_run(corpus, tok_dir, tmp_path_factory):
    """A modernbert run of 8 steps at 128 tokens (the band inside the rows) with an eval every 4, shared."""
    out = str(tmp_path_factory.mktemp("modernbert") / "run")
    result = run_main(*common(corpus, tok_dir, out), *MODERN, "--max-steps", "8", "--eval-corpus", corpus,
                      "--eval-every", "4")
    return out, result.stdout


@pytest.mark.slow
def test_the_export_is_the_model_that_trained(modern_run, corpus, tok_dir, tokenizer):
    """hf/ loads with AutoModelForMaskedLM as a ModernBertForMaskedLM holding the checkpoint's weights (the
    decoder tied to the embeddings), and the stock class, reading the run's eval batches as padded rows, scores
    them at the run's own eval loss (to 1e-5)."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    import data_stream
    out, stdout = modern_run
    assert "model: ModernBERT-tiny mlm" in stdout
    hf = AutoModelForMaskedLM.from_pretrained(os.path.join(out, "hf")).eval()
    assert type(hf).__name__ == "ModernBertForMaskedLM"
    assert hf.decoder.weight is hf.model.embeddings.tok_embeddings.weight
    weights = final_weights(out)
    assert hf.state_dict().keys() == weights.keys()
    assert all(torch.equal(value, weights[name]) for name, value in hf.state_dict().items())
    assert len(AutoTokenizer.from_pretrained(os.path.join(out, "hf"))) == len(tokenizer)
    args = P.parse_args(common(corpus, tok_dir, out) + MODERN)
    stream = data_stream.stream_from_args(args, corpus, "eval", tokenizer, P.EVAL_SEED, False, 0, 1)
    stream.set_epoch(0)
    loss, masked = 0.0, 0
    with torch.no_grad():
        for batch in stream:
            assert "sequence_ids" not in batch  # mlm rows: one text each
            chosen = batch["labels"] != -100
            logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[chosen]
            loss += float(F.cross_entropy(logits, batch["labels"][chosen], reduction="sum"))
            masked += int(chosen.sum())
    assert masked > 100
    assert loss / masked == pytest.approx(summary(out)["eval"]["eval/mlm_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_finetune_trains_a_run_and_its_export_alike(modern_run, tmp_path, pooling):
    """finetune.py takes a modernbert run (its checkpoint) and its hf/ folder alike: the same
    ModernBertForSequenceClassification (the MLM's head under its classifier), the same scores."""
    finetunes_alike(modern_run[0], tmp_path, pooling)


@pytest.mark.slow
def test_init_from_continues_a_modernbert_and_the_arch_is_kept_to(modern_run, corpus, tok_dir, tokenizer, tmp_path):
    """--init-from a modernbert run's hf/ (no --arch: the source's) continues its pretraining from its weights;
    what cannot be trained so is one line each: nsp or electra with --arch modernbert, a BERT source for
    --arch modernbert, a ModernBERT source for nsp, --arch bert on a modernbert checkpoint."""
    from transformers import BertConfig, BertForMaskedLM
    out, _ = modern_run
    cont = str(tmp_path / "cont")
    result = run_main("--corpus", corpus, "--init-from", os.path.join(out, "hf"), "--objective", "mlm", *FAST,
                      "--eval-corpus", "none", "--out-dir", cont, "--max-steps", "1", "--lr", "0")
    assert "model: ModernBERT-tiny mlm" in result.stdout
    assert all(torch.equal(v, final_weights(out)[k]) for k, v in final_weights(cont).items())
    bert = str(tmp_path / "bert")
    BertForMaskedLM(BertConfig(**M.new_architecture("tiny", len(tokenizer), 32, 0))).save_pretrained(bert)
    cases = [(["--arch", "modernbert"], "--arch modernbert trains with --objective mlm, not nsp (the default)"),
             (["--arch", "modernbert", "--objective", "electra"], "--arch modernbert trains with --objective mlm"),
             (["--init-from", bert, *MODERN], "holds a BERT model, which --objective mlm --arch modernbert"),
             (["--init-from", os.path.join(out, "hf")], "holds a ModernBERT model, which --objective nsp"),
             (["--init-from", out, "--objective", "mlm", "--arch", "bert"], "holds a ModernBERT model")]
    one_line_plan_errors(["--corpus", corpus, "--tokenizer", tok_dir, "--out-dir", str(tmp_path / "x")], cases)


@pytest.mark.slow
def test_a_two_rank_modernbert_job_killed_and_run_again_ends_bitwise_equal(corpus, tok_dir, tmp_path):
    """2 ranks, dropout on (every layer's, in attention too: its RNG is in the checkpoint), SIGKILLed after the
    checkpoint at step 8, then the same command: the weights at step 12 are bitwise an uninterrupted run's."""
    args = ["--arch", "modernbert", "--objective", "mlm", "--max-seq-len", "128", "--max-steps", "12",
            "--save-every", "4"]
    ref, killed = str(tmp_path / "ref"), str(tmp_path / "killed")
    cmd = torchrun(2, *common(corpus, tok_dir, killed), *args)
    done, crashed = wait_for([Launch(torchrun(2, *common(corpus, tok_dir, ref), *args)),
                              Launch(cmd, crash_at(r"^step (9|10|11):"))])
    assert done.returncode == 0, done.stderr[-3000:]
    assert crashed.returncode != 0 and "saved" in crashed.stdout, crashed.stdout[-2000:]
    result = run(cmd)
    assert result.returncode == 0 and "resumed from" in result.stdout, result.stderr[-3000:]
    assert same_weights(final_weights(ref), final_weights(killed))
    assert summary(killed)["steps"] == 12 and "model: ModernBERT-tiny mlm" in done.stdout
