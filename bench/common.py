"""
What the benchmarks share: our trainer in a subprocess and its summary.json; the generated corpora; the one
transformers.Trainer worker on run_mlm's recipe (vs_trainer.py, learning.py, time_to_quality.py); the one held-out
MLM evaluator (learning.py, time_to_quality.py). Not a benchmark itself:

    python bench/common.py --trainer SPEC.json    # one Trainer run (what trainer_run starts; SPEC: trainer_run)

Our side:
- pretrain(flags, out_dir): `pretrain_ddp.py FLAGS` (under torchrun for ranks > 1) with --out-dir, a fresh start
  (--resume none --overwrite), its log on stdout, no eval and no checkpoint before the end unless the flags say so;
  returns its summary.json (steady rates after pretrain_ddp.STEADY_AFTER steps, train_seconds, eval, lr_plan, ...)
  and its output. log_steps() and config_of() read what summary.json does not hold (per-interval scalars, the
  config line).
The Trainer side (run_mlm.py, line_by_line=False): a record per document, each tokenized with [CLS]/[SEP],
concatenated in corpus order, cut into max_seq_len blocks (the remainder dropped), shuffled by the Trainer's
sampler, DataCollatorForLanguageModeling(mlm_probability=0.15); our model (model.model_from after the same torch
seed: the same initial weights), our AdamW (model.new_optimizer) and our LR plan (estimate_steps.plan_of/lr_factor,
as a LambdaLR: the Trainer's own linear schedule starts at 0), clipping 1.0, fp32 on the CPU.
"""
import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def environment(threads=None, **extra):
    """The environment of a measured process: its OpenMP threads, the tokenizer on one thread (a worker's)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **extra}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def spread(values, fmt="{:,.0f}"):
    """'median [min-max]'."""
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def run_counting_cpu(command, **kwargs):
    """subprocess.run(command, **kwargs), and the CPU seconds (user + system) of the processes it started and
    waited for: the measure a loaded machine moves far less than wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, **kwargs)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


# ----------------------------------------------------------------------------- our trainer

@dataclass
class Run:
    summary: dict  # <out_dir>/summary.json
    log: str       # stdout and stderr, merged
    seconds: float  # launch to exit


def pretrain(flags, out_dir, *, ranks=1, threads=None, env=None, script=None, on_line=None, watch=None, every=0.2):
    """Run pretrain_ddp.py (or `script`: a command that takes its flags, e.g. a wrapper) into out_dir; exit with its
    output's tail if it fails. on_line(line, seconds since launch) sees each output line, watch(proc) is called
    every `every` seconds while it runs."""
    flags = list(flags)
    for flag, value in (("--log-to", "stdout"), ("--eval-corpus", "none"), ("--save-every", "1000000")):
        if flag not in flags:
            flags += [flag, value]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    cmd = [*launch, *(script or [os.path.join(ROOT, "pretrain_ddp.py")]), *flags, "--out-dir", out_dir,
           "--resume", "none", "--overwrite"]
    env = env or environment(threads)
    t0 = time.perf_counter()
    # The output goes to a file (a pipe would wait for any orphan that holds it); it is read through a file
    # description of its own, whose offset is not the child's
    with tempfile.TemporaryFile() as log, open(f"/proc/self/fd/{log.fileno()}", "rb") as tail:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        pending = b""
        while True:
            running = proc.poll() is None
            if watch and running:
                watch(proc)
            if on_line:
                *lines, pending = (pending + tail.read()).split(b"\n")
                for line in lines:
                    on_line(line.decode(errors="replace") + "\n", time.perf_counter() - t0)
            if not running:
                break
            time.sleep(every if watch or on_line else 0.05)
        seconds = time.perf_counter() - t0
        log.seek(0)
        text = log.read().decode(errors="replace")
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    with open(os.path.join(out_dir, "summary.json")) as f:
        return Run(json.load(f), text, seconds)


def log_steps(text):
    """The scalars of each 'step N: name value, ...' line of a run's log: [{'step': N, name: value, ...}]."""
    rows = []
    for m in re.finditer(r"^step (\d+): (.*)$", text, re.M):
        row = {"step": int(m[1])}
        for item in m[2].split(", "):
            name, _, value = item.rpartition(" ")
            try:
                row[name] = float(value)
            except ValueError:
                continue
        rows.append(row)
    return rows


def config_of(text):
    """The run's settings, from its 'config: {...}' line."""
    return json.loads(re.search(r"^config: (\{.*\})$", text, re.M)[1])


# ----------------------------------------------------------------------------- corpora and tokenizers

def zipf_sentences(rng, count, words=20_000):
    """count sentences of 5-29 made-up words (Zipf-distributed over `words` of 2-9 letters) and ' .'."""
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(words)]
    zipf = 1 / np.arange(1, words + 1)
    drawn = rng.choice(words, count * 30, p=zipf / zipf.sum())
    cuts = np.cumsum(rng.integers(5, 30, count))
    return [" ".join(vocab[w] for w in drawn[a:b]) + " ." for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]


def write_corpus(path, *, docs=None, mb=None, words="prose", doc_mb=None, seed=0):
    """A BERT-format corpus (a sentence a line, a blank line between documents) of `docs` documents or `mb` MB
    (what comes first); an existing file at path is kept. A document is a run of consecutive sentences from a
    random place in a pool: 5-45 of them, or (doc_mb) as many as make doc_mb MB (a book). The pool: builtin's
    sentences (words='prose': real English, repeated and reshuffled) or 100,000 sentences of made-up
    Zipf-distributed words ('zipf': a vocabulary of 20,000)."""
    if os.path.exists(path):
        return path
    import data_stream
    rng = np.random.default_rng([seed, 1])
    if words == "prose":
        with open(data_stream.build_builtin_corpus()[0], encoding="utf-8") as f:
            pool = [ln.strip() for ln in f if ln.strip()]
    else:
        pool = zipf_sentences(np.random.default_rng(seed), 100_000)
    written, count = 0, 0
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        while (docs is None or count < docs) and (mb is None or written < mb * 1e6):
            if doc_mb:
                start, lines, size = int(rng.integers(0, len(pool))), [], 0
                while size < doc_mb * 1e6:
                    lines.append(pool[(start + len(lines)) % len(pool)])
                    size += len(lines[-1]) + 1
            else:
                n = int(rng.integers(5, 46))
                start = int(rng.integers(0, len(pool) - n))
                lines = pool[start:start + n]
            text = ("\n\n" if count else "") + "\n".join(lines)
            f.write(text)
            written, count = written + len(text), count + 1
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def padded_tokenizer(vocab):
    """A tokenizer folder whose len() is exactly `vocab`: builtin's WordPiece, padded with never-matching
    [unusedN] entries when the corpus holds fewer pieces (it holds ~11.7k): the model then has the full
    vocab-row embedding and MLM output layer, which is what sets its speed."""
    import data_stream
    tok = data_stream.get_tokenizer(None, data_stream.resolve_corpus("builtin"), vocab)
    if len(tok) == vocab:
        return tok.name_or_path
    out = os.path.join(data_stream.CACHE_DIR, "bench", f"wordpiece-padded-{vocab}-{os.path.basename(tok.name_or_path)}")
    if not os.path.isdir(out):
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        spec = json.loads(tok.backend_tokenizer.to_str())
        pieces = spec["model"]["vocab"]
        # "[unusedN]" never forms one pre-token (BertPreTokenizer splits at "["), so nothing changes but the size
        for i in range(vocab - len(pieces)):
            pieces[f"[unused{i}]"] = len(pieces)
        padded = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="[UNK]",
                                         pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
        padded.save_pretrained(out + ".tmp")
        os.replace(out + ".tmp", out)
    assert len(data_stream.get_tokenizer(out)) == vocab
    return out


def documents(tok, corpus, split):
    """Token ids (no special tokens) of each document of a corpus's split, as pretrain_ddp.py's mlm stream reads
    them. corpus: 'builtin' (its split) or a file."""
    import data_stream
    opened = data_stream.open_corpus(corpus, split, "mlm")
    return [data_stream.tokenize_lines(tok, opened.read(d))[0].tolist() for d in range(opened.num_docs)]


def run_mlm_blocks(docs, tok, n):
    """run_mlm.py's group_texts over [CLS] doc [SEP] records: full blocks of n, the remainder dropped."""
    ids = [t for doc in docs for t in [tok.cls_token_id, *doc, tok.sep_token_id]]
    return [{"input_ids": ids[i:i + n], "token_type_ids": [0] * n, "attention_mask": [1] * n}
            for i in range(0, len(ids) // n * n, n)]


# ----------------------------------------------------------------------------- the Trainer (run_mlm's recipe)

def trainer_run(spec, run_dir, env):
    """One transformers.Trainer run in a fresh process; returns its result (also run_dir/result.json).
    spec: tokenizer, size, seed, batch_size, max_seq_len, lr, warmup (fraction), weight_decay, dropout; optional
      arch (bert, or modernbert: transformers' ModernBertForMaskedLM, sdpa) and mask_prob (0.15);
      corpus ('builtin' or a file, its 'train' split; doc_order 'corpus' or 'random': the documents shuffled once
      by the seed), or rows (a JSON file of token id lists, each a record: our windows) with in_order (no
      shuffling sampler);
      steps (the LR plan's and the run's length) or seconds (an LR plan over time: warmup, then linear to 0 at
      `seconds` of training, where the run stops);
      optional: save_steps [steps whose weights are saved], save_every_s (weights every that many seconds of
      training), hf_at_s (a Hugging Face folder with the tokenizer, run_dir/hf_at_budget, at that time),
      timed_after (steps left out of tokens_per_sec; default pretrain_ddp.STEADY_AFTER).
    The training clock starts at train() and leaves out the saves. Result: steps, train_seconds, tokens_per_sec,
    marks [{file, seconds, step}], hf (the folder or None), blocks, threads, final_lr."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--trainer", path, "--run-dir", run_dir],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"Trainer run failed ({path}):\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "result.json")) as f:
        return json.load(f)


def trainer_worker(spec, run_dir):
    import torch
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    import data_stream
    import estimate_steps
    import model as M
    import pretrain_ddp as P
    tok = data_stream.get_tokenizer(spec["tokenizer"])
    n = spec["max_seq_len"]
    if spec.get("rows"):
        with open(spec["rows"]) as f:
            blocks = [{"input_ids": r, "token_type_ids": [0] * len(r), "attention_mask": [1] * len(r)}
                      for r in json.load(f)]
    else:
        docs = documents(tok, spec.get("corpus", "builtin"), "train")
        if spec.get("doc_order") == "random":
            docs = [docs[i] for i in np.random.default_rng(spec["seed"]).permutation(len(docs))]
        blocks = run_mlm_blocks(docs, tok, n)
    arch = spec.get("arch", "bert")
    if arch == "modernbert":  # ModernBertForMaskedLM reads no token types
        blocks = [{k: v for k, v in block.items() if k != "token_type_ids"} for block in blocks]
    torch.manual_seed(spec["seed"])  # as pretrain_ddp.py: the seed, then the model (the same initial weights)
    model = M.model_from(M.new_architecture(spec["size"], len(tok), n, tok.pad_token_id, arch=arch), "mlm",
                         spec["dropout"])
    optimizer = M.new_optimizer(model, spec["lr"], spec["weight_decay"])
    seconds = spec.get("seconds")
    total = spec.get("steps") or 10_000  # over time: 10,000 positions of the plan
    plan = estimate_steps.plan_of(total, total, spec["batch_size"], spec["warmup"])
    clock = {"t0": None, "excluded": 0.0}

    def elapsed():
        return 0.0 if clock["t0"] is None else time.perf_counter() - clock["t0"] - clock["excluded"]

    def factor(step):
        return estimate_steps.lr_factor(plan, min(elapsed() / seconds, 1.0) * total if seconds else step)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    timed_after = spec.get("timed_after", P.STEADY_AFTER)
    save_steps, every = set(spec.get("save_steps", [])), spec.get("save_every_s")
    result = {"marks": [], "hf": None, "blocks": len(blocks), "threads": torch.get_num_threads()}
    tokens, times = [], []

    collator = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=spec.get("mask_prob", 0.15))

    def collate(examples):
        batch = collator(examples)
        tokens.append(int(batch["attention_mask"].sum()))
        return batch

    def excluded(save):  # a save, left out of the training clock
        t = time.perf_counter()
        save()
        clock["excluded"] += time.perf_counter() - t

    class Clock(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, targs, state, control, model=None, **kw):
            now, step = elapsed(), state.global_step
            times.append(now)
            marks, stop = result["marks"], bool(seconds) and now >= seconds
            if step in save_steps or (every and (now >= every * (len(marks) + 1) or stop)):
                name = f"mark_{len(marks):03d}_step{step}.pt"
                marks.append({"file": os.path.join(run_dir, name), "seconds": now, "step": step})
                excluded(lambda: torch.save({"model": model.state_dict()}, marks[-1]["file"]))
            if spec.get("hf_at_s") and result["hf"] is None and now >= spec["hf_at_s"]:
                result["hf"] = os.path.join(run_dir, "hf_at_budget")
                result["hf_step"], result["hf_seconds"] = step, now
                excluded(lambda: (model.save_pretrained(result["hf"]), tok.save_pretrained(result["hf"])))
            control.should_training_stop = control.should_training_stop or stop

    targs = TrainingArguments(
        output_dir=os.path.join(run_dir, "trainer_tmp"), per_device_train_batch_size=spec["batch_size"],
        max_steps=spec.get("steps") or 10**7, learning_rate=spec["lr"], weight_decay=spec["weight_decay"],
        adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6, max_grad_norm=1.0, use_cpu=True,
        dataloader_num_workers=0, logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        seed=spec["seed"])

    class InOrder(Trainer):  # records given in their order (our windows): no shuffling sampler
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    trainer = (InOrder if spec.get("in_order") else Trainer)(
        model=model, args=targs, train_dataset=blocks, optimizers=(optimizer, scheduler), data_collator=collate,
        callbacks=[Clock()])
    trainer.train()
    steps = len(times)
    timed = times[-1] - times[timed_after - 1] if steps > timed_after else times[-1]
    result.update(steps=steps, train_seconds=times[-1], final_lr=scheduler.get_last_lr()[0],
                  tokens_per_sec=sum(tokens[timed_after:steps] if steps > timed_after else tokens) / max(timed, 1e-9))
    with open(os.path.join(run_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


# ----------------------------------------------------------------------------- the evaluator

class Evaluator:
    """One held-out set for every model: the eval split's documents, each's tokens + [SEP], concatenated, cut into
    [CLS] + (max_seq_len - 2) + [SEP] windows; 15% of the non-special tokens masked 80/10/10 once with a fixed numpy
    seed, so every model sees identical masked inputs. score(model) -> MLM loss and accuracy at the masked
    positions. Baselines from the train split's token counts: always the most frequent token (accuracy) and the
    unigram distribution (loss, add-one smoothed)."""

    def __init__(self, tok_dir, train_corpus, eval_corpus, max_seq_len=128, mask_seed=1234, mask_prob=0.15,
                 batch_size=32):
        import torch

        import data_stream
        self.tok = tok = data_stream.get_tokenizer(tok_dir)
        self.max_seq_len, self.batch_size = max_seq_len, batch_size
        stream = [t for doc in documents(tok, eval_corpus, "eval") for t in [*doc, tok.sep_token_id]]
        width = max_seq_len - 2
        rows = [[tok.cls_token_id, *stream[i:i + width], tok.sep_token_id]
                for i in range(0, len(stream) // width * width, width)]
        ids = np.array(rows, np.int64)
        special = np.isin(ids, tok.all_special_ids)
        rng = np.random.default_rng(mask_seed)
        chosen = (rng.random(ids.shape) < mask_prob) & ~special
        how = rng.random(ids.shape)
        normal = np.setdiff1d(np.arange(len(tok)), tok.all_special_ids)
        labels = np.where(chosen, ids, -100)
        ids[chosen & (how < 0.8)] = tok.mask_token_id
        swap = chosen & (how >= 0.8) & (how < 0.9)
        ids[swap] = rng.choice(normal, int(swap.sum()))
        self.ids, self.labels = torch.from_numpy(ids), torch.from_numpy(labels)
        targets = labels[labels != -100]
        counts = np.bincount([t for doc in documents(tok, train_corpus, "train") for t in doc], minlength=len(tok))
        probs = (counts + 1) / (counts + 1).sum()
        self.info = {"windows": len(rows), "masked": len(targets), "eval_tokens": len(stream),
                     "most_frequent_token": tok.convert_ids_to_tokens(int(counts.argmax())),
                     "most_frequent_accuracy": float((targets == counts.argmax()).mean()),
                     "unigram_loss": float(-np.log(probs[targets]).mean())}

    def score(self, weights, model_size):
        """weights: a file holding {'model': BertForMaskedLM state_dict} (ours' checkpoints' trainer.pt too), or
        a Hugging Face folder."""
        import torch
        from transformers import BertForMaskedLM
        from transformers.utils import logging as hf_logging

        import model as M
        hf_logging.disable_progress_bar()
        if os.path.isdir(weights):
            model = BertForMaskedLM.from_pretrained(weights)
        else:
            architecture = M.new_architecture(model_size, len(self.tok), self.max_seq_len, self.tok.pad_token_id)
            model = M.model_from(architecture, "mlm", 0.0)
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True)["model"])
        model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(self.ids), self.batch_size):
                ids, labels = self.ids[i:i + self.batch_size], self.labels[i:i + self.batch_size]
                hidden = model.bert(input_ids=ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state
                picked = labels != -100
                logits = model.cls(hidden[picked]).double()
                loss_sum += float(torch.nn.functional.cross_entropy(logits, labels[picked], reduction="sum"))
                correct += int((logits.argmax(-1) == labels[picked]).sum())
        masked = int((self.labels != -100).sum())
        return {"loss": loss_sum / masked, "accuracy": correct / masked}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--trainer", required=True, metavar="SPEC.json", help="one Trainer run (trainer_run's spec)")
    p.add_argument("--run-dir", required=True)
    a = p.parse_args()
    with open(a.trainer) as f:
        trainer_worker(json.load(f), a.run_dir)
