"""
Stream BERT pretraining batches from a text corpus of any size, sharded over DDP ranks and
DataLoader workers, reshuffled every epoch, and resumable exactly from a cursor.

Corpus format (the original BERT one): one sentence per line, a blank line between documents.
`--corpus builtin` is English prose that ships with CPython (the pydoc topics plus standard
library docstrings), so nothing is ever downloaded.

    python data_stream.py --show 3                 # decoded samples from the builtin corpus
    python data_stream.py --corpus my_texts/ --bench

Design, in short:
- A one-time byte-offset index of documents (a few numbers per document); documents are read
  by offset when needed, so memory does not grow with the corpus.
- Each epoch permutes the documents (same on every rank) and cuts the permutation into
  world_size x num_workers byte-balanced shards: every document is read by exactly one
  (rank, worker).
- Every random choice for a document (pairs, NSP, masking) comes from an RNG keyed by
  (seed, epoch, document id), so a resumed worker needs only its position, not RNG state.
- Each batch carries a cursor (shard, chunk, offset); the trainer reports the ones it has
  consumed with `stream.consumed(batch)` and checkpoints `stream.state_dict()`.
"""

import argparse
import ast
import glob
import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import time
import warnings

# The Rust tokenizer's own thread pool deadlocks after fork() into DataLoader workers.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

CACHE_DIR = os.path.expanduser(os.environ.get("BERT_DDP_CACHE", "~/.cache/bert_ddp"))
MAX_LINE_BYTES = 1 << 16   # longer lines are cut into pieces of this size (bounded memory)
MAX_DOC_BYTES = 1 << 20    # longer documents are cut into several documents at a line
DOCS_PER_CHUNK = 16        # samples are shuffled within a chunk of this many documents
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


class CorpusError(Exception):
    """A user mistake about the corpus or tokenizer; the CLIs print it as one line."""


# ----------------------------------------------------------------------------- corpus files

def _atomic_write_text(path, text):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _split_sentences(text):
    """Prose paragraphs -> sentences; code examples and tables are dropped."""
    sentences = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in para.splitlines()]
        if not lines or any(ln.startswith((">>>", "...", "|", "+-", "$")) for ln in lines):
            continue
        if para.startswith(("    ", "\t")) and not para.strip().endswith("."):
            continue
        joined = " ".join(ln for ln in lines if ln)
        sentences += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", joined) if len(s) > 1]
    return sentences


def build_builtin_corpus():
    """Write the builtin corpus (train + held-out eval split) once; return the two paths."""
    out_dir = os.path.join(CACHE_DIR, f"builtin-py{sys.version_info[0]}{sys.version_info[1]}-v1")
    train_path, eval_path = os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "eval.txt")
    if os.path.exists(train_path) and os.path.exists(eval_path):
        return train_path, eval_path
    import pydoc_data.topics
    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(f for f in filenames if f.endswith(".py")):
            try:  # parse, never import: importing stdlib modules has side effects
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 300:
                        texts.append(doc)
    docs = [s for s in (_split_sentences(t) for t in texts) if len(s) >= 2]
    os.makedirs(out_dir, exist_ok=True)
    # Every 20th document is held out for evaluation and never enters the training stream.
    for path, part in ((eval_path, docs[::20]), (train_path, [d for i, d in enumerate(docs) if i % 20])):
        _atomic_write_text(path, "\n\n".join("\n".join(d) for d in part) + "\n")
    return train_path, eval_path


def _plain_copy(path):
    """A .gz file is decompressed once into the cache: documents are read by byte offset."""
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = os.path.join(CACHE_DIR, "gunzip", f"{key}-{os.path.basename(path)[:-3]}")
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = f"{out}.tmp{os.getpid()}"
        try:
            with gzip.open(path, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (OSError, EOFError) as e:
            raise CorpusError(f"corpus file {path} is not a readable gzip file ({e})") from None
        os.replace(tmp, out)
    return out


def resolve_corpus(spec, split="train"):
    """'builtin', a file, a directory, a glob, or a comma-separated list of these -> file paths."""
    files = []
    for part in [p for p in spec.split(",") if p]:
        if part == "builtin":
            files.append(build_builtin_corpus()[0 if split == "train" else 1])
        elif any(c in part for c in "*?["):
            found = sorted(p for p in glob.glob(part, recursive=True) if os.path.isfile(p))
            if not found:
                raise CorpusError(f"--corpus glob {part!r} matches no file")
            files += found
        elif os.path.isdir(part):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(part) for f in fs
                           if f.endswith((".txt", ".txt.gz")) and not f.startswith("."))
            if not found:
                raise CorpusError(f"--corpus directory {part} holds no .txt or .txt.gz files")
            files += found
        elif os.path.isfile(part):
            files.append(part)
        else:
            raise CorpusError(f"--corpus path {part} does not exist")
    if not files:
        raise CorpusError("--corpus is empty: give a file, a directory, a glob or 'builtin'")
    return [_plain_copy(f) if f.endswith(".gz") else f for f in files]


def index_documents(files):
    """One pass over the corpus -> per-document (file, start, end) byte offsets.

    Memory is a few numbers per document, never the text. Documents longer than MAX_DOC_BYTES
    are cut at a line, lines longer than MAX_LINE_BYTES at a character boundary.
    """
    file_ids, starts, ends, bad_lines = [], [], [], 0
    for file_id, path in enumerate(files):
        with open(path, "rb") as f:
            pos, doc_start = 0, None
            while True:
                line = f.readline(MAX_LINE_BYTES)
                if not line:
                    break
                if len(line) == MAX_LINE_BYTES and not line.endswith(b"\n"):
                    k = len(line) - 1  # step back to the start of a multi-byte UTF-8 character
                    while k > 0 and (line[k] & 0xC0) == 0x80:
                        k -= 1
                    if line[k] >= 0xC0:
                        line = line[:k]
                        f.seek(pos + k)
                if line.strip():
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError:
                        bad_lines += 1
                    if doc_start is None:
                        doc_start = pos
                    elif pos - doc_start >= MAX_DOC_BYTES:
                        file_ids.append(file_id), starts.append(doc_start), ends.append(pos)
                        doc_start = pos
                elif doc_start is not None:
                    file_ids.append(file_id), starts.append(doc_start), ends.append(pos)
                    doc_start = None
                pos += len(line)
            if doc_start is not None:
                file_ids.append(file_id), starts.append(doc_start), ends.append(pos)
    if bad_lines:
        warnings.warn(f"corpus: {bad_lines} line(s) hold bytes that are not UTF-8; they were replaced", stacklevel=2)
    if not starts:
        raise CorpusError(f"corpus {', '.join(files)} holds no text (every line is blank)")
    return {"file": np.array(file_ids, np.int32), "start": np.array(starts, np.int64),
            "end": np.array(ends, np.int64)}


def split_lines(raw):
    """A document's bytes -> its non-blank lines (sentences), long lines cut into pieces."""
    lines = []
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        line = line.strip()
        while len(line) > MAX_LINE_BYTES:
            lines.append(line[:MAX_LINE_BYTES])
            line = line[MAX_LINE_BYTES:].lstrip()
        if line:
            lines.append(line)
    return lines


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(files, vocab_size, out_dir):
    """Train a lower-cased BERT WordPiece tokenizer, streaming the corpus line by line."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def lines():
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.strip():
                        yield line[:MAX_LINE_BYTES]

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(lines(), trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                     cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    tmp = f"{out_dir}.tmp{os.getpid()}"
    hf_tok.save_pretrained(tmp)
    try:
        os.rename(tmp, out_dir)
    except OSError:  # another process finished the same tokenizer first
        shutil.rmtree(tmp, ignore_errors=True)


def get_tokenizer(tokenizer_dir=None, files=None, vocab_size=8192):
    """Load a local Hugging Face tokenizer folder, or train one on `files` (cached, reused)."""
    from transformers import AutoTokenizer
    if tokenizer_dir is None:
        stats = [(os.path.abspath(p), os.path.getsize(p), os.path.getmtime(p)) for p in files]
        key = hashlib.sha1(json.dumps([stats, vocab_size]).encode()).hexdigest()[:16]
        tokenizer_dir = os.path.join(CACHE_DIR, "tokenizers", f"wordpiece-{vocab_size}-{key}")
        if not os.path.isdir(tokenizer_dir):
            os.makedirs(os.path.dirname(tokenizer_dir), exist_ok=True)
            train_tokenizer(files, vocab_size, tokenizer_dir)
    elif not os.path.isdir(tokenizer_dir):
        raise CorpusError(f"--tokenizer {tokenizer_dir} is not a folder (give a save_pretrained folder)")
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types here; the user needs one line
        raise CorpusError(f"--tokenizer {tokenizer_dir} does not load: {str(e).splitlines()[0]}") from None
    missing = [name for name in ("cls_token", "sep_token", "pad_token", "mask_token") if getattr(tok, name) is None]
    if missing or not getattr(tok, "is_fast", False):
        raise CorpusError(f"--tokenizer {tokenizer_dir} must be a fast tokenizer with "
                          f"[CLS]/[SEP]/[PAD]/[MASK] tokens (missing: {', '.join(missing) or 'fast backend'})")
    return tok


# ----------------------------------------------------------------------------- samples

def doc_rng(seed, epoch, doc_id, *purpose):
    """Independent RNG per (seed, epoch, document, purpose): same samples on any rank/worker."""
    return np.random.default_rng([seed, epoch, doc_id, *purpose])


def plan_pairs(seg_lens, max_num_tokens, short_seq_prob, doc_id, num_docs, rng):
    """Google's create_instances_from_document, structure only (shared with estimate_steps.py).

    Returns one (a_start, a_end, b_end, random_doc, random_frac) per sample. Segment A is
    segments a_start:a_end; B is segments a_end:b_end, or (random_doc >= 0) sentences of another
    document starting at random_frac of its length. The RNG draws here never depend on token
    contents of other documents, so the count of samples needs only this document's lengths.
    """
    target_len = max_num_tokens
    if rng.random() < short_seq_prob:
        target_len = int(rng.integers(2, max_num_tokens + 1))
    plans, chunk_start, chunk_len, i = [], 0, 0, 0
    while i < len(seg_lens):
        chunk_len += seg_lens[i]
        if i == len(seg_lens) - 1 or chunk_len >= target_len:
            n = i + 1 - chunk_start
            a_end = chunk_start + (int(rng.integers(1, n)) if n >= 2 else 1)
            if n == 1 or rng.random() < 0.5:
                random_doc = int(rng.random() * (num_docs - 1)) if num_docs > 1 else doc_id
                random_doc += num_docs > 1 and random_doc >= doc_id  # any document but this one
                plans.append((chunk_start, a_end, a_end, random_doc, rng.random()))
                i = a_end - 1  # the unused segments go back for the next sample
            else:
                plans.append((chunk_start, a_end, i + 1, -1, 0.0))
            chunk_start, chunk_len = i + 1, 0
        i += 1
    return plans


def truncate_pair(a, b, max_num_tokens, rng):
    """BERT's truncate_seq_pair in closed form: the same lengths as trimming the longer side one
    token at a time, and the same distribution of front/back cuts, without a per-token loop."""
    la, lb, m = len(a), len(b), max_num_tokens
    if la + lb > m:
        if la > lb:
            la = max(lb, m - lb)
        else:
            lb = max(la, m - la)
        if la + lb > m:  # both sides equal and still too long: they alternate, A keeps the odd one
            la, lb = (m + 1) // 2, m // 2
    front_a, front_b = rng.binomial(len(a) - la, 0.5), rng.binomial(len(b) - lb, 0.5)
    return a[front_a:front_a + la], b[front_b:front_b + lb]


def mask_tokens(ids, special_ids, mask_id, random_ids, mask_prob, rng):
    """BERT dynamic masking on one sample: mask_prob of non-special tokens, 80% [MASK],
    10% a random token from random_ids (the vocabulary less its special tokens), 10% kept."""
    ids = np.array(ids, dtype=np.int64)
    chosen = (rng.random(len(ids)) < mask_prob) & ~np.isin(ids, special_ids)
    labels = np.where(chosen, ids, -100)
    action = rng.random(len(ids))
    ids[chosen & (action < 0.8)] = mask_id
    random_pos = chosen & (action >= 0.8) & (action < 0.9)
    ids[random_pos] = random_ids[rng.integers(0, len(random_ids), int(random_pos.sum()))]
    return ids, labels


def shard_documents(doc_bytes, seed, epoch, num_shards, shuffle=True, exclude=None):
    """The epoch's document order, cut into num_shards contiguous byte-balanced shards.
    `exclude`: documents already read this epoch (a resume with another number of shards)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(doc_bytes)) if shuffle else np.arange(len(doc_bytes))
    if exclude is not None:
        order = order[~np.isin(order, exclude)]
    if len(order) == 0:
        return [order] * num_shards
    cum = np.cumsum(doc_bytes[order])
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, num_shards) / num_shards, side="right")
    return np.split(order, cuts)


def batches_per_rank(samples_per_worker, batch_size):
    """Micro-batches one rank yields: each worker ends with a partial batch (estimator uses it)."""
    return sum(-(-n // batch_size) for n in samples_per_worker)


# ----------------------------------------------------------------------------- the stream

class BertPretrainStream(IterableDataset):
    """Batches (dicts of tensors) of BERT pretraining samples, one shard per (rank, worker).

    objective 'nsp': original BERT sentence pairs with next-sentence labels;
    objective 'mlm': RoBERTa-style, sentences packed into full sequences, documents separated
    by [SEP], no padding but at the very end of a shard.
    """

    def __init__(self, corpus="builtin", tokenizer=None, split="train", objective="nsp",
                 max_seq_len=128, batch_size=32, mask_prob=0.15, short_seq_prob=0.1, seed=0,
                 rank=None, world_size=None, shuffle=True, vocab_size=8192):
        if objective not in ("nsp", "mlm"):
            raise CorpusError(f"--objective must be nsp or mlm, not {objective!r}")
        if max_seq_len < (5 if objective == "nsp" else 3):
            raise CorpusError(f"--max-seq-len {max_seq_len} is too small for a {objective} sample")
        if batch_size < 1:
            raise CorpusError(f"--batch-size must be at least 1, not {batch_size}")
        self.files = resolve_corpus(corpus, split)
        self.index = index_documents(self.files)
        self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer(None, resolve_corpus(corpus), vocab_size)
        self.objective, self.max_seq_len, self.batch_size = objective, max_seq_len, batch_size
        self.mask_prob, self.short_seq_prob, self.seed, self.shuffle = mask_prob, short_seq_prob, seed, shuffle
        if rank is None:
            dist = torch.distributed
            rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.rank, self.world_size = rank, world_size
        tok = self.tokenizer
        self.cls_id, self.sep_id, self.pad_id = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id
        self.mask_id = tok.mask_token_id
        self.special_ids = np.array(sorted(set(tok.all_special_ids)), np.int64)
        self.vocab_size = len(tok)
        self.random_ids = np.setdiff1d(np.arange(self.vocab_size), self.special_ids)
        self.epoch, self.resume, self._consumed = 0, None, None
        self._open_files = {}

    def __len__(self):  # DataLoader must not guess; the estimator answers this question
        raise TypeError("a stream has no length: use estimate_steps.py")

    @property
    def num_docs(self):
        return len(self.index["start"])

    # --- epochs, cursors and the corpus fingerprint (main process)
    def set_epoch(self, epoch):
        self.epoch, self.resume, self._consumed = epoch, None, None

    def fingerprint(self):
        """What must be equal on every rank and across a resume: documents, bytes, the offset index."""
        digest = hashlib.sha256()
        for key in ("file", "start", "end"):
            digest.update(np.ascontiguousarray(self.index[key]).tobytes())
        return {"documents": self.num_docs, "bytes": int(self._doc_bytes().sum()), "index": digest.hexdigest()[:16]}

    def _doc_bytes(self):
        return self.index["end"] - self.index["start"]

    def consumed(self, cursor):
        """Record that the trainer used the batch with this cursor (call for every batch it trains on)."""
        shard, chunk, offset, num_shards = cursor
        if self._consumed is None:
            self._consumed = {"epoch": self.epoch, "num_shards": num_shards, "positions": {}, "last_shard": None,
                              "exclude": []}
        self._consumed["positions"][str(shard)] = [chunk, offset]
        self._consumed["last_shard"] = shard

    def state_dict(self):
        """Where the consumed part of this epoch ends: JSON-serialisable. `positions` are per shard of
        a sharding into `num_shards` of the epoch's documents less `exclude` (read before a resize)."""
        if self._consumed is None:
            return {"epoch": self.epoch, "num_shards": None, "positions": {}, "last_shard": None, "exclude": []}
        return json.loads(json.dumps(self._consumed))

    @staticmethod
    def merge_states(states):
        """The states of all ranks as one (for a resume on another world size: every shard's position)."""
        return {**states[0], "positions": {k: v for s in states for k, v in s["positions"].items()},
                "last_shard": None}

    def load_state_dict(self, state, num_workers=None):
        """The next iteration (with `num_workers` DataLoader workers; None: as many as `state` was
        written with) continues after what `state` says was consumed. Returns how many documents
        the resume skips: 0 unless the number of shards (ranks x workers) changed, when partly read
        chunks cannot be continued."""
        state = {"exclude": [], **json.loads(json.dumps(state))}
        skipped = 0
        num_shards = state["num_shards"] if num_workers is None else self.world_size * max(num_workers, 1)
        if state["num_shards"] and state["num_shards"] != num_shards:
            # Resharded resume: every document the old sharding started counts as read (a partly
            # read chunk too: its samples were shuffled together), the rest is cut into new shards.
            # The exclusions accumulate, so any chain of resizes reads a document at most once.
            old = shard_documents(self._doc_bytes(), self.seed, state["epoch"], state["num_shards"], self.shuffle,
                                  np.array(state["exclude"], np.int64))
            exclude = set(state["exclude"])
            for s, (chunk, offset) in state["positions"].items():
                exclude.update(old[int(s)][:(chunk + (offset > 0)) * DOCS_PER_CHUNK].tolist())
                skipped += len(old[int(s)][chunk * DOCS_PER_CHUNK:(chunk + 1) * DOCS_PER_CHUNK]) if offset else 0
            state = {"epoch": state["epoch"], "num_shards": num_shards, "positions": {}, "last_shard": None,
                     "exclude": sorted(exclude)}
        self.epoch, self.resume = state["epoch"], state
        self._consumed = json.loads(json.dumps(state)) if state["num_shards"] else None
        return skipped

    # --- reading and tokenizing (worker process)
    def _read_lines(self, doc_id):
        file_id = int(self.index["file"][doc_id])
        f = self._open_files.get(file_id)
        if f is None:
            f = self._open_files[file_id] = open(self.files[file_id], "rb")
        start = int(self.index["start"][doc_id])
        f.seek(start)
        return split_lines(f.read(int(self.index["end"][doc_id]) - start))

    def _tokenize(self, lines):
        encoded = self.tokenizer.backend_tokenizer.encode_batch(lines, add_special_tokens=False)
        return [e.ids for e in encoded if e.ids]

    def _random_b(self, doc_id, frac, target_len):
        lines = self._read_lines(doc_id)
        start, tokens = int(frac * len(lines)), []
        while start < len(lines) and len(tokens) < target_len:
            for seg in self._tokenize(lines[start:start + 8]):
                tokens += seg
                if len(tokens) >= target_len:
                    break
            start += 8
        return tokens or [self.tokenizer.unk_token_id]

    def segments(self, doc_id):
        """A document's sentences as token lists (empty ones dropped): what samples are made of."""
        return self._tokenize(self._read_lines(doc_id))

    def pair_plans(self, seg_lens, doc_id, epoch):
        """The nsp samples of a document in an epoch (plan_pairs); estimate_steps.py counts these."""
        return plan_pairs(seg_lens, self.max_seq_len - 3, self.short_seq_prob, doc_id, self.num_docs,
                          doc_rng(self.seed, epoch, doc_id, 0))

    def _nsp_samples(self, doc_id):
        segs = self.segments(doc_id)
        max_tokens = self.max_seq_len - 3  # room for [CLS] A [SEP] B [SEP]
        plans = self.pair_plans([len(s) for s in segs], doc_id, self.epoch)
        trunc_rng, mask_rng = doc_rng(self.seed, self.epoch, doc_id, 1), doc_rng(self.seed, self.epoch, doc_id, 2)
        samples = []
        for a_start, a_end, b_end, random_doc, frac in plans:
            a = [t for s in segs[a_start:a_end] for t in s]
            if random_doc >= 0:
                b = self._random_b(random_doc, frac, max(1, max_tokens - len(a)))
            else:
                b = [t for s in segs[a_end:b_end] for t in s]
            a, b = truncate_pair(a, b, max_tokens, trunc_rng)
            ids, labels = mask_tokens([self.cls_id, *a, self.sep_id, *b, self.sep_id], self.special_ids,
                                      self.mask_id, self.random_ids, self.mask_prob, mask_rng)
            types = np.zeros(len(ids), np.int64)
            types[len(a) + 2:] = 1
            samples.append((ids, types, labels, int(random_doc >= 0)))
        return samples

    def _mlm_tokens(self, doc_ids):
        """The packed token stream of some documents: sentences back to back, [SEP] after each doc."""
        tokens = []
        for doc_id in doc_ids:
            tokens += [t for s in self.segments(doc_id) for t in s] + [self.sep_id]
        return tokens

    def _collate(self, samples, cursor):
        # Pad to a multiple of 8 (tensor cores), not to max_seq_len: less wasted compute.
        width = min(self.max_seq_len, -(-max(len(s[0]) for s in samples) // 8) * 8)
        input_ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        token_type_ids = torch.zeros((len(samples), width), dtype=torch.long)
        labels = torch.full((len(samples), width), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, (ids, types, lab, _) in enumerate(samples):
            input_ids[row, :len(ids)] = torch.from_numpy(ids)
            token_type_ids[row, :len(ids)] = torch.from_numpy(types)
            labels[row, :len(ids)] = torch.from_numpy(lab)
            attention_mask[row, :len(ids)] = 1
        batch = {"input_ids": input_ids, "token_type_ids": token_type_ids,
                 "attention_mask": attention_mask, "labels": labels, "cursor": cursor}
        if self.objective == "nsp":
            batch["next_sentence_label"] = torch.tensor([s[3] for s in samples], dtype=torch.long)
        return batch

    def _chunk_samples(self, shard_docs, chunk):
        """nsp: all samples of one chunk of documents, in the chunk's shuffled order."""
        doc_ids = shard_docs[chunk * DOCS_PER_CHUNK:(chunk + 1) * DOCS_PER_CHUNK]
        samples = [s for d in doc_ids for s in self._nsp_samples(int(d))]
        if self.shuffle:
            order = doc_rng(self.seed, self.epoch, int(doc_ids[0]), 3).permutation(len(samples))
            samples = [samples[i] for i in order]
        return samples

    def _samples(self, shard_docs, chunk, offset):
        """Yield (sample, (chunk, offset) of the next sample) from a position in the shard."""
        num_chunks = -(-len(shard_docs) // DOCS_PER_CHUNK)
        if self.objective == "nsp":
            for c in range(chunk, num_chunks):
                samples = self._chunk_samples(shard_docs, c)
                for k in range(offset if c == chunk else 0, len(samples)):
                    yield samples[k], (c, k + 1) if k + 1 < len(samples) else (c + 1, 0)
            return
        # mlm: windows of max_seq_len - 2 tokens over the shard's token stream. A window may span
        # chunks; a position is the (chunk, token offset) where the next window starts.
        width, buf, buf_pos = self.max_seq_len - 2, [], (chunk, offset)
        for c in range(chunk, num_chunks):
            tokens = self._mlm_tokens(shard_docs[c * DOCS_PER_CHUNK:(c + 1) * DOCS_PER_CHUNK])
            k = offset if c == chunk else 0
            while k < len(tokens):
                take = tokens[k:k + width - len(buf)]
                buf, k = buf + take, k + len(take)
                if len(buf) == width:
                    next_pos = (c, k) if k < len(tokens) else (c + 1, 0)
                    yield self._mlm_sample(buf, shard_docs, buf_pos), next_pos
                    buf, buf_pos = [], next_pos
        if buf:
            yield self._mlm_sample(buf, shard_docs, buf_pos), (num_chunks, 0)

    def _mlm_sample(self, tokens, shard_docs, pos):
        first_doc = int(shard_docs[pos[0] * DOCS_PER_CHUNK])
        rng = doc_rng(self.seed, self.epoch, first_doc, 4, pos[1])
        ids, labels = mask_tokens([self.cls_id, *tokens, self.sep_id], self.special_ids, self.mask_id,
                                  self.random_ids, self.mask_prob, rng)
        return ids, np.zeros(len(ids), np.int64), labels, 0

    def __iter__(self):
        info = get_worker_info()
        num_workers, worker_id = (info.num_workers, info.id) if info else (1, 0)
        num_shards = self.world_size * num_workers
        resume = self.resume or {"num_shards": None, "positions": {}, "last_shard": None, "exclude": []}
        if resume["num_shards"] not in (None, num_shards):
            raise RuntimeError(f"the stream was resumed for {resume['num_shards']} shards but is read as "
                               f"{num_shards}: pass the DataLoader's num_workers to load_state_dict")
        positions, last, rotate = resume["positions"], resume["last_shard"], 0
        if last is not None:
            # DataLoader takes batches round-robin from worker 0; the old run's next batch was
            # due from the worker after the last one consumed, so new worker i plays that role.
            rotate = (last - self.rank * num_workers + 1) % num_workers
        exclude = np.array(resume["exclude"], np.int64) if resume["exclude"] else None
        shard = self.rank * num_workers + (worker_id + rotate) % num_workers
        shard_docs = shard_documents(self._doc_bytes(), self.seed, self.epoch, num_shards, self.shuffle, exclude)[shard]
        chunk, offset = positions.get(str(shard), (0, 0))
        batch, pos = [], (chunk, offset)
        for sample, pos in self._samples(shard_docs, chunk, offset):
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield self._collate(batch, (shard, *pos, num_shards))
                batch = []
        if batch:
            yield self._collate(batch, (shard, *pos, num_shards))


# ----------------------------------------------------------------------------- CLI

def add_data_args(parser):
    """The corpus/tokenizer/sample flags, shared by every script of the project."""
    parser.add_argument("--corpus", default="builtin",
                        help="'builtin' (prose shipped with Python), a .txt/.txt.gz file, a directory, a glob, "
                             "or a comma-separated list; one sentence per line, blank line between documents")
    parser.add_argument("--tokenizer", default=None,
                        help="a local Hugging Face tokenizer folder; default: train a WordPiece on the corpus "
                             f"(cached under {CACHE_DIR})")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of a trained tokenizer")
    parser.add_argument("--objective", default="nsp", choices=["nsp", "mlm"],
                        help="nsp: original BERT sentence pairs + next-sentence labels; mlm: packed, RoBERTa-style")
    parser.add_argument("--max-seq-len", type=int, default=128, help="tokens per sample, [CLS]/[SEP] included")
    parser.add_argument("--short-seq-prob", type=float, default=0.1,
                        help="probability that a document's samples aim at a shorter random length (BERT: 0.1)")
    parser.add_argument("--mask-prob", type=float, default=0.15, help="fraction of tokens masked for MLM")
    parser.add_argument("--seed", type=int, default=0, help="seeds document order, pairs and masking")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Stream BERT pretraining samples: show some, or time one worker.")
    add_data_args(parser)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per batch")
    parser.add_argument("--show", type=int, default=0, metavar="N", help="print N decoded samples ([MASK] visible)")
    parser.add_argument("--bench", action="store_true",
                        help="time one worker over the corpus (up to --bench-seconds) next to the bare tokenizer")
    parser.add_argument("--bench-seconds", type=float, default=20.0, help="time budget of --bench")
    args = parser.parse_args(argv)
    try:
        tokenizer = get_tokenizer(args.tokenizer, resolve_corpus(args.corpus), args.vocab_size)
        stream = BertPretrainStream(args.corpus, tokenizer, objective=args.objective, max_seq_len=args.max_seq_len,
                                    batch_size=args.batch_size, mask_prob=args.mask_prob,
                                    short_seq_prob=args.short_seq_prob, seed=args.seed, rank=0, world_size=1)
    except CorpusError as e:
        sys.exit(f"data_stream.py: error: {e}")
    print(f"corpus: {len(stream.files)} file(s), {stream.num_docs} documents; vocab {stream.vocab_size}")
    shown = 0
    for batch in stream if args.show else ():
        for row in range(len(batch["input_ids"])):
            if shown == args.show:
                break
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()]
            masked = batch["labels"][row][batch["labels"][row] != -100]
            nsp = batch.get("next_sentence_label")
            print(f"--- sample {shown}: {len(ids)} tokens, {len(masked)} masked"
                  + (f", B is {'random' if nsp[row] else 'the continuation'}" if nsp is not None else ""))
            print(tokenizer.decode(ids.tolist()))
            print("  targets:", tokenizer.decode(masked.tolist()))
            shown += 1
        if shown == args.show:
            break
    if args.bench:
        bench(stream, args.bench_seconds)


def bench(stream, seconds):
    """Samples/s and tokens/s of one worker, next to the bare tokenizer on the same documents."""
    t0, samples, tokens, epoch = time.perf_counter(), 0, 0, 0
    while time.perf_counter() - t0 < seconds:  # whole epochs until the time budget is spent
        stream.set_epoch(epoch)
        for batch in stream:
            samples += len(batch["input_ids"])
            tokens += int(batch["attention_mask"].sum())
            if time.perf_counter() - t0 > seconds:
                break
        epoch += 1
    stream_s = time.perf_counter() - t0
    lines, chars, docs, t0 = [], 0, 0, time.perf_counter()
    for doc_id in range(stream.num_docs):
        doc_lines = stream._read_lines(doc_id)
        lines, chars, docs = lines + doc_lines, chars + sum(map(len, doc_lines)), docs + 1
        if chars > 4 * tokens:  # ~4 characters per token: about the same amount of text
            break
    t1 = time.perf_counter()
    bare_tokens = sum(len(e.ids) for e in stream.tokenizer.backend_tokenizer.encode_batch(lines))
    tok_s = time.perf_counter() - t1
    print(f"stream: {samples / stream_s:,.0f} samples/s, {tokens / stream_s:,.0f} tokens/s (one worker, "
          f"{stream_s:.1f} s)")
    print(f"bare tokenizer encode_batch: {bare_tokens / tok_s:,.0f} tokens/s on {docs} documents "
          f"(read {t1 - t0:.2f} s)")


if __name__ == "__main__":
    main()
