"""--objective electra (issue 50): model.replaced_token_detection against the stock ElectraForMaskedLM and
ElectraForPreTraining (their sums and gradients), the shared embeddings, the export, finetune.py on it, and
its one-line errors. Its resume after a SIGKILL is in test_checkpoints.py."""

import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    FAST,
    Launch,
    common,
    crash_at,
    final_weights,
    logged,
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


def stock_sums(pair, raw, seed):
    """The loss sums of replaced_token_detection computed by the stock classes on padded rows: the generator's
    MLM at the labelled positions, its samples (model.sample: the same draw, seed) put there, and
    the discriminator's binary loss over the real tokens."""
    mask, labels = raw["attention_mask"], raw["labels"]
    chosen = labels != -100
    logits = pair.generator(input_ids=raw["input_ids"], token_type_ids=raw["token_type_ids"],
                            attention_mask=mask).logits[chosen]
    mlm_loss = F.cross_entropy(logits, labels[chosen], reduction="sum")
    torch.manual_seed(seed)
    with torch.no_grad():
        sampled = M.sample(logits.softmax(-1))
    fakes = raw["input_ids"].clone()
    fakes[chosen] = sampled
    originals = torch.where(chosen, labels, raw["input_ids"])
    replaced = (fakes != originals).float()
    disc_logits = pair.discriminator(input_ids=fakes, token_type_ids=raw["token_type_ids"], attention_mask=mask).logits
    real = mask.bool()
    disc_loss = F.binary_cross_entropy_with_logits(disc_logits[real], replaced[real], reduction="sum")
    return torch.stack([mlm_loss, (logits.argmax(-1) == labels[chosen]).sum().float(), disc_loss,
                        ((disc_logits[real] > 0) == replaced[real].bool()).sum().float()])


def grads(pair):
    return {n: p.grad.clone() for n, p in pair.named_parameters()}


@pytest.mark.parametrize("rows", ["full", "padded", "one row"])
def test_electra_step_is_the_stock_models_sums_and_gradients(rows):
    """Our step (the generator's layers on the real tokens, its head at the masked positions only, the samples
    put in on the device, the discriminator on the real tokens) gives the sums of the stock classes on padded
    rows, within 1e-4, and the same gradients (1e-5) in every weight, the shared embeddings included; a one-row
    batch's copy (sparse_targets') adds nothing. And the generator reads the discriminator's embeddings."""
    torch.manual_seed(0)
    pair = M.model_from(M.new_architecture("tiny", 300, 32, 0, M.GENERATOR_SIZE), "electra", 0.0)
    net = M.Pretraining(pair).eval()  # eval: no dropout RNG, so the only draw is the sample's
    assert pair.generator.electra.embeddings is pair.discriminator.electra.embeddings
    assert pair.generator.generator_lm_head.weight is pair.discriminator.electra.embeddings.word_embeddings.weight
    assert pair.generator.config.hidden_size == 32 and pair.generator.config.num_hidden_layers == 2
    n = 1 if rows == "one row" else 4
    ids = torch.randint(5, 300, (n, 16))
    ids[:, 0] = 2
    mask = torch.ones(n, 16, dtype=torch.long)
    if rows != "full":
        mask[-1, 11:] = 0
    labels = torch.full((n, 16), -100)
    for r in range(n):
        for c in (3 + r, 7, 9 + r % 2):
            labels[r, c] = int(ids[r, c])
            ids[r, c] = 4  # [MASK]
    raw = {"input_ids": ids * mask, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask,
           "labels": labels}
    batch, counts = M.prepare(M.sparse_targets({k: v.clone() for k, v in raw.items()}), torch.device("cpu"))
    assert ("copied_row" in batch) == (rows == "one row") and ("real_pos" in batch) == (rows != "full")
    torch.manual_seed(7)
    ours = net(**batch)
    ours[[0, 2]].sum().backward()
    ours_grads = grads(pair)
    pair.zero_grad()
    reference = stock_sums(pair, raw, 7)
    reference[[0, 2]].sum().backward()
    assert torch.allclose(ours.detach(), reference.detach(), atol=1e-4), (ours, reference)
    assert 0 < ours[3] < counts["num_tokens"]  # some replaced, some not
    stock_grads = grads(pair)
    assert ours_grads.keys() == stock_grads.keys()
    for name, g in ours_grads.items():
        assert torch.allclose(g, stock_grads[name], atol=1e-5), name
    assert ours_grads["discriminator.electra.embeddings.word_embeddings.weight"].abs().sum() > 0


def test_train_flops_count_both_models():
    """ELECTRA's FLOPs: the discriminator's encoder (mlm's, without its vocabulary head) plus the generator's
    encoder and head and the discriminator's head: more than the discriminator's encoder alone, less than
    the mlm model's plus a second one."""
    counts = {"num_tokens": 1000, "num_masked": 150, "num_attended": 30000, "num_attended_local": 20000}
    mlm = M.model_from(M.new_architecture("tiny", 8192, 128, 0), "mlm", 0.0)
    electra = M.model_from(M.new_architecture("tiny", 8192, 128, 0, 0.25), "electra", 0.0)
    head = 3 * 2 * (128 * 128 + 128 * 8192) * 150
    body = M.train_flops(mlm, counts) - head
    assert body < M.train_flops(electra, counts) < 2 * M.train_flops(mlm, counts)
    gen_encoder = 3 * (1000 * 2 * 2 * (4 * 32 * 32 + 2 * 32 * 128) + 2 * 2 * 2 * 32 * 30000)
    rest = 3 * (2 * 128 * 32 * 1000 + 2 * (32 * 128 + 128 * 8192) * 150 + 2 * (128 * 128 + 128) * 1000)
    assert M.train_flops(electra, counts) == body + gen_encoder + rest


def test_samples_follow_the_generator_s_softmax():
    """model.sample draws each row's token with its softmax probability (200,000 draws of three rows: every
    frequency within 5 standard errors of its probability, a token of probability 0 never), and the same seed
    draws the same tokens."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -float("inf")], [0.0] * 5, [-3.0, 8.0, 0.0, 1.0, 2.0]])
    probs = logits.softmax(-1)
    torch.manual_seed(0)
    draws = M.sample(probs.repeat(200_000, 1), block=2).view(200_000, 3)  # each row drawn on its own
    for row in range(3):
        frequency = torch.bincount(draws[:, row], minlength=5).double() / len(draws)
        se = (probs[row] * (1 - probs[row]) / len(draws)).sqrt().double()
        assert ((frequency - probs[row]).abs() <= 5 * se + 1e-9).all(), (row, frequency, probs[row])
    assert (draws[:, 0] != 4).all()
    torch.manual_seed(0)
    assert torch.equal(M.sample(probs.repeat(200_000, 1), block=2).view(200_000, 3), draws)


# ----------------------------------------------------------------------------- the trainer, the export, fine-tuning

@pytest.fixture(scope="module")
def electra_run(corpus, tok_dir, tmp_path_factory):
    """An electra run of 8 steps with an eval every 4 (the session's corpus), shared."""
    out = str(tmp_path_factory.mktemp("electra") / "run")
    result = run_main(*common(corpus, tok_dir, out), "--objective", "electra", "--max-steps", "8",
                      "--eval-corpus", corpus, "--eval-every", "4")
    return out, result.stdout


@pytest.mark.slow
def test_an_electra_run_logs_both_losses_and_exports_what_the_auto_classes_load(electra_run, tokenizer):
    """The log has the generator's MLM loss and the discriminator's per-token loss, summed as trained (x50), and
    the eval its replaced-token accuracy; hf/ is the discriminator (AutoModelForPreTraining: ElectraForPreTraining)
    and hf/generator/ the generator (AutoModelForMaskedLM: ElectraForMaskedLM), each with the tokenizer and the
    checkpoint's weights, the generator's embeddings the discriminator's."""
    from transformers import AutoModelForMaskedLM, AutoModelForPreTraining, AutoTokenizer
    out, stdout = electra_run
    mlm, disc, total = (logged(stdout, f"train/{name}") for name in ("mlm_loss", "disc_loss", "loss"))
    assert len(disc) == 8 and all(0 < v < 1 for v in disc.values())
    assert all(math.isclose(total[s], mlm[s] + M.DISC_WEIGHT * disc[s], rel_tol=1e-3) for s in total)
    assert 0.5 < summary(out)["eval"]["eval/disc_accuracy"] <= 1 and "eval/mlm_loss" in summary(out)["eval"]
    discriminator = AutoModelForPreTraining.from_pretrained(os.path.join(out, "hf"))
    generator = AutoModelForMaskedLM.from_pretrained(os.path.join(out, "hf", "generator"))
    assert (type(discriminator).__name__, type(generator).__name__) == ("ElectraForPreTraining", "ElectraForMaskedLM")
    weights = final_weights(out)
    for prefix, exported in (("discriminator.", discriminator), ("generator.", generator)):
        for name, value in exported.state_dict().items():
            assert torch.equal(value, weights[prefix + name]), prefix + name
    assert torch.equal(generator.electra.embeddings.word_embeddings.weight,
                       discriminator.electra.embeddings.word_embeddings.weight)
    for folder in ("hf", os.path.join("hf", "generator")):
        assert len(AutoTokenizer.from_pretrained(os.path.join(out, folder))) == len(tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_finetune_trains_the_discriminator_of_a_run_and_of_its_export(electra_run, tmp_path, pooling):
    """finetune.py takes an electra run (its checkpoint's discriminator) and its hf/ folder alike: the same
    ElectraForSequenceClassification, the same scores, with either pooling."""
    finetunes_alike(electra_run[0], tmp_path, pooling)


@pytest.mark.slow
def test_init_from_keeps_to_its_objective_and_electra_continues_its_own(electra_run, corpus, tok_dir, tokenizer,
                                                                         tmp_path):
    """--init-from an electra run's hf/ (both models) starts an electra run from its weights; a BERT source for
    electra, an ELECTRA for mlm, and an hf/ without its generator are one line each (found where the run is
    decided: plan_run, as for every bad input)."""
    from transformers import BertConfig, BertForMaskedLM
    out, _ = electra_run
    cont = str(tmp_path / "cont")
    run_main("--corpus", corpus, "--init-from", os.path.join(out, "hf"), "--objective", "electra", *FAST,
             "--eval-corpus", "none", "--out-dir", cont, "--max-steps", "1", "--lr", "0")
    assert all(torch.equal(v, final_weights(out)[k]) for k, v in final_weights(cont).items())
    bert = str(tmp_path / "bert")
    BertForMaskedLM(BertConfig(**M.new_architecture("tiny", len(tokenizer), 32, 0))).save_pretrained(bert)
    lone = tmp_path / "lone"
    lone.mkdir()
    for name in os.listdir(os.path.join(out, "hf")):
        if name != "generator":
            os.link(os.path.join(out, "hf", name), lone / name)
    cases = [(["--init-from", bert, "--objective", "electra"], "holds a BERT model, which --objective electra"),
             (["--init-from", out, "--objective", "mlm"], "holds an ELECTRA model, which --objective mlm"),
             (["--init-from", str(lone), "--objective", "electra"], "has no generator/ beside its discriminator")]
    one_line_plan_errors(["--corpus", corpus, "--tokenizer", tok_dir, "--out-dir", str(tmp_path / "x")], cases)


@pytest.mark.slow
def test_a_two_rank_electra_job_killed_and_run_again_ends_bitwise_equal(corpus, tok_dir, tmp_path):
    """2 ranks (each its own samples: its own RNG), SIGKILLed after the checkpoint at step 8, where the run also
    evaluated (eval draws the generator's samples from an RNG of its own: a resume there goes on alike), then
    the same command: the weights at step 12 are bitwise those of an uninterrupted run."""
    args = ["--objective", "electra", "--max-steps", "12", "--save-every", "4", "--eval-corpus", corpus,
            "--eval-every", "4"]
    ref, killed = str(tmp_path / "ref"), str(tmp_path / "killed")
    cmd = torchrun(2, *common(corpus, tok_dir, killed), *args)
    done, crashed = wait_for([Launch(torchrun(2, *common(corpus, tok_dir, ref), *args)),
                              Launch(cmd, crash_at(r"^step (9|10|11):"))])
    assert done.returncode == 0, done.stderr[-3000:]
    assert crashed.returncode != 0 and re.search(r"^step 8: eval/.*disc_accuracy", crashed.stdout, re.M), \
        crashed.stdout[-2000:]
    result = run(cmd)
    assert result.returncode == 0 and "resumed from" in result.stdout, result.stderr[-3000:]
    assert same_weights(final_weights(ref), final_weights(killed))
    assert summary(killed)["steps"] == 12
