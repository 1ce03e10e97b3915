"""Shared fixtures: a generated corpus and a tokenizer trained on it, built once per test run."""
import os
import random
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Never touch the user's cache (or CI's home): every cached artefact of the run goes here.
os.environ.setdefault("BERT_DDP_CACHE", tempfile.mkdtemp(prefix="bert_ddp_test_cache_"))

WORDS = ("the a of to and in is was for on that with as by at from it an be this which or are "
         "river stone garden winter paper engine market signal window forest letter silver bridge "
         "music number orange planet rabbit season teacher valley yellow basket candle doctor "
         "empty finger guitar hollow island jacket kettle lemon meadow needle ocean pepper").split()
NUMBERS = "zero one two three four five six seven eight nine".split()


def marker(doc_id):
    """'docstart four two' for document 42: survives tokenization and decoding intact."""
    return "docstart " + " ".join(NUMBERS[int(c)] for c in str(doc_id))


def write_corpus(path, num_docs, seed=0, min_sents=1, max_sents=30, skew=None):
    """A corpus in BERT format; each document's first sentence is its marker."""
    rng = random.Random(seed)
    docs = []
    for d in range(num_docs):
        n = skew[d] if skew else rng.randint(min_sents, max_sents)
        sents = [marker(d) + " ."]
        sents += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25))) + " ." for _ in range(n - 1)]
        docs.append("\n".join(sents))
    with open(path, "w") as f:
        f.write("\n\n".join(docs) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", 120)


@pytest.fixture(scope="session")
def tokenizer(corpus):
    import data_stream
    return data_stream.get_tokenizer(None, [corpus], vocab_size=300)


def release_out_dir_locks():
    """A test that runs pretrain_ddp's plan_run or main() in this process holds its out dir's lock (a
    process holds it for its life): drop it, so that runs started after it can use the out dir."""
    locks = getattr(sys.modules.get("checkpoints"), "OUT_DIR_LOCK", {})
    for f in locks.values():
        f.close()
    locks.clear()


@pytest.fixture(autouse=True)
def out_dir_locks_released():
    yield
    release_out_dir_locks()
