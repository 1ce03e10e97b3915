"""
Stream BERT pretraining batches from a corpus of any size, sharded over DDP ranks and DataLoader
workers, reshuffled every epoch, and resumable exactly from a cursor.

Corpora: BERT's own text format (one sentence per line, a blank line between documents; .txt or
.txt.gz), JSON lines ({"text": ...} per line; .jsonl, .jsonl.gz), parquet files and folders written
by Hugging Face `datasets.Dataset.save_to_disk` (.arrow), alone or mixed. `--corpus builtin` is
English prose that ships with CPython (the pydoc topics plus standard library docstrings), so
nothing is ever downloaded; builtin_corpus.py, imported only to write it once, gathers it.

    python data_stream.py --show 3                                # decoded samples from the builtin corpus
    python data_stream.py --corpus wiki.jsonl.gz --build-cache   # tokenize ahead, on all cores
    python bench/stream_bench.py --corpus my_texts/              # one worker's rate next to the bare tokenizer

The layers, one section each, top to bottom, each using only the ones above it:
1. Reading: a corpus -> numbered documents, each a list of sentences. A one-time offset index
   (cached on disk) says where each document is; documents are read by position when needed, so
   memory does not grow with the corpus. Long documents are cut into parts of --max-doc-bytes.
   Parquet and Arrow files are read by arrow_corpus.py, the only code that needs pyarrow,
   imported when such a file is met (text and jsonl corpora need neither).
2. Tokenizer: a WordPiece trained on an evenly spread sample of the corpus (or a folder).
3. Token cache: the first time a document is tokenized, its ids go to a memory-mapped cache shared
   by the processes of a machine; later epochs and runs read ids, never text.
4. Samples: BERT's sentence pairs (Google's rules) or packed windows, masked per batch in numpy
   and collated into tensors. Every random choice comes from an RNG keyed by (seed, epoch,
   document, purpose).
5. Order and shards: each epoch permutes the documents and cuts them into ranks x workers
   byte-balanced shards; a worker keeps --shuffle-docs documents open and draws each sample from
   one of them, with probability proportional to what it has left (a document is read at its first
   draw), so a batch mixes many documents alike all epoch; it reads the samples in blocks of
   --shuffle-block, each in a random order, so a document's samples do not come in the order of its
   text. Its cursor is small and exact; a resize goes on from the cursors of all old shards.
6. The stream: BertPretrainStream, the IterableDataset that holds the state (epoch, the cursor to resume
   from, what the trainer consumed: `stream.consumed(batch["cursor"])`, `stream.state_dict()`), and its
   settings (StreamSettings). A plain `DataLoader(stream, batch_size=None, num_workers=N)` reads it; the
   trainer's loader (workers.py) adds workers from a forkserver that end with their trainer.
7. CLI: the data flags every script shares (add_data_args, stream_from_args), --show, --build-cache.
"""

import argparse
import contextlib
import copy
import fcntl
import functools
import glob
import gzip
import hashlib
import itertools
import json
import locale
import mmap
import os
import re
import resource
import shutil
import sys
import time
import uuid
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

CACHE_DIR = os.path.expanduser(os.environ.get("BERT_DDP_CACHE", "~/.cache/bert_ddp"))
MAX_LINE_BYTES = 1 << 16    # longer lines are cut into pieces of this size (bounded memory)
MAX_DOC_BYTES = 1 << 16     # default --max-doc-bytes: longer documents are read as several parts
SHUFFLE_DOCS = 256          # default --shuffle-docs: documents a worker keeps open to draw from
SHUFFLE_BLOCK = 8192        # default --shuffle-block: samples a worker shuffles together
FIRST_BLOCK = 32            # a shard's first block; each next one is twice as big, up to --shuffle-block
TOKENIZER_SAMPLE_MB = 100   # default --tokenizer-sample-mb: text the WordPiece is trained on
PIECE_TOKENS = 1 << 23      # the token cache is written in pieces of about this many tokens (16 MB)
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
INDEX_VERSION, CACHE_VERSION = 3, 1  # bump when the index or cache layout changes


class CorpusError(Exception):
    """A user mistake about the corpus or tokenizer; the CLIs print it as one line."""


# ============================================================================= 1. reading

def atomic_write(path, write, mode="wb"):
    """write(f) into a temporary file beside path, fsynced, then renamed over path: a reader, or a
    crash at any moment, sees the old file or the whole new one, never a part (used for every
    file the scripts write that another process or a later run reads)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def try_write(write, what, path, needed=None):
    """write(); None if it worked, else one line for a write that failed for an OSError, found in the
    error's context (torch.save reports a full disk as a RuntimeError raised while handling it, safetensors
    as "(os error 28)"): what, why, the file system of path, its free space, what was needed."""
    try:
        write()
        return None
    except Exception as failed:  # one without an OSError behind it is raised
        error = failed
        while error is not None and not isinstance(error, OSError):
            code = re.search(r"\(os error (\d+)\)", str(error))  # how Rust libraries (safetensors) say theirs
            error = OSError(int(code[1]), os.strerror(int(code[1]))) if code else error.__context__
        if error is None:
            raise
    mount = os.path.realpath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        free = f"{shutil.disk_usage(mount).free / 1e6:,.0f} MB free"
    except OSError:
        free = "free space unknown"
    need = f", about {needed / 1e6:,.0f} MB needed" if needed else ""
    return f"cannot write {what}: {error.strerror or error} on the file system at {mount} ({free}{need})"


@contextlib.contextmanager
def _machine_lock(path):
    """One process of the machine at a time (the ranks of a node share the cache directory)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _split_prose(text):
    """Prose paragraphs -> sentences (builtin_corpus.split_prose; bench/learning.py splits texts with it)."""
    import builtin_corpus
    return builtin_corpus.split_prose(text)


def build_builtin_corpus():
    """Write the builtin corpus (builtin_corpus.py: train + held-out eval split) once; return the two paths."""
    out_dir = os.path.join(CACHE_DIR, f"builtin-py{sys.version_info[0]}{sys.version_info[1]}-v1")
    train_path, eval_path = os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "eval.txt")
    if not (os.path.exists(train_path) and os.path.exists(eval_path)):
        try:
            import builtin_corpus
        except ModuleNotFoundError as e:
            if e.name != "builtin_corpus":
                raise
            raise CorpusError("--corpus builtin needs builtin_corpus.py: copy it beside data_stream.py") from None
        builtin_corpus.write_corpus(train_path, eval_path, atomic_write)
    return train_path, eval_path


def file_identity(path):
    """What tells this machine's copy of a file apart from any other version of it: a rewrite
    changes the ctime even when size and mtime are restored (cp -p, rsync -t, tar)."""
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def cache_key(parts, length, digest=hashlib.sha1):
    """The name of a cached artefact (gunzip copy, index, tokenizer, token cache): a hash of what it
    was made from, so a changed input or setting finds a new name, never a stale file."""
    return digest(json.dumps(parts, default=str).encode()).hexdigest()[:length]


def _plain_copy(path):
    """A .gz file is decompressed once into the cache: documents are read by byte offset."""
    key = cache_key(file_identity(path), 16)
    out = os.path.join(CACHE_DIR, "gunzip", f"{key}-{os.path.basename(path)[:-3]}")
    with _machine_lock(out + ".lock"):
        if not os.path.exists(out):
            try:
                with gzip.open(path, "rb") as src:
                    atomic_write(out, lambda dst: shutil.copyfileobj(src, dst, 1 << 20))
            except (OSError, EOFError) as e:
                raise CorpusError(f"corpus file {path} is not a readable gzip file ({e})") from None
    return out


def file_format(path):
    """'text', 'jsonl', 'parquet' or 'arrow', by the name (a .gz is read as what it holds)."""
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return name.rsplit(".", 1)[1] if name.endswith((".parquet", ".arrow")) else "text"


CORPUS_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz", ".parquet", ".arrow")


def _dataset_split(folder, split):
    """A `save_to_disk` DatasetDict folder -> the name of its split to read (eval: validation or test)."""
    try:
        with open(os.path.join(folder, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
    except (OSError, ValueError, AttributeError) as e:
        raise CorpusError(f"{os.path.join(folder, 'dataset_dict.json')} does not read as a DatasetDict ({e})") from None
    for name in ("train",) if split == "train" else ("validation", "test", split):
        if name in splits:
            return name
    example = os.path.join(folder, splits[0] if splits else "")
    raise CorpusError(f"--corpus {folder} is a DatasetDict with splits {', '.join(splits)}, none of them the "
                      f"{split} split: give the folder of one, e.g. {example}")


def _corpus_files_in(folder, split):
    """The corpus files under a folder (hidden and cache-* files skipped; a DatasetDict: one split)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        if "dataset_dict.json" in filenames:
            dirnames[:] = [_dataset_split(dirpath, split)]
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        # datasets' cache-*.arrow files are intermediate results, not the dataset
        found += [os.path.join(dirpath, f) for f in sorted(filenames)
                  if f.endswith(CORPUS_SUFFIXES) and not f.startswith((".", "cache-"))]
    return found


def resolve_corpus(spec, split="train"):
    """'builtin', a file, a directory, a glob, or a comma-separated list of these -> file paths."""
    files = []
    for part in [p for p in spec.split(",") if p] if isinstance(spec, str) else list(spec):
        if part == "builtin":
            files.append(build_builtin_corpus()[0 if split == "train" else 1])
        elif any(c in part for c in "*?["):
            found = sorted(p for p in glob.glob(part, recursive=True) if os.path.isfile(p))
            if not found:
                raise CorpusError(f"--corpus glob {part!r} matches no file")
            files += found
        elif os.path.isdir(part):
            found = _corpus_files_in(part, split)
            if not found:
                raise CorpusError(f"--corpus directory {part} holds no .txt, .jsonl, .parquet or .arrow files "
                                  "(.gz allowed for text and jsonl)")
            files += found
        elif os.path.isfile(part):
            files.append(part)
        else:
            raise CorpusError(f"--corpus path {part} does not exist")
    if not files:
        raise CorpusError("--corpus is empty: give a file, a directory, a glob or 'builtin'")
    return files


def _arrow_corpus(path):
    """arrow_corpus.py, the only code that needs pyarrow: imported when a parquet/Arrow file is read."""
    try:
        import arrow_corpus
    except ImportError as e:
        if e.name == "arrow_corpus":  # data_stream.py copied alone
            raise CorpusError(f"corpus file {path} is read by arrow_corpus.py: copy it beside data_stream.py") from None
        # a pyarrow built for another numpy fails here too: say what the import said
        raise CorpusError(f"corpus file {path} needs pyarrow, which did not import ({e}): "
                          "pip install -U pyarrow") from None
    return arrow_corpus


def _record_index(starts, ends, text_lengths, max_doc_bytes, bad, empty):
    """Records (where each is: start, end) -> the index: a record over max_doc_bytes is read as several parts."""
    lengths = np.asarray(text_lengths, np.int64)
    parts = np.maximum(1, -(-lengths // max_doc_bytes))
    record = np.repeat(np.arange(len(parts)), parts)
    part = np.arange(len(record)) - np.repeat(np.cumsum(parts) - parts, parts)
    size = np.maximum(np.minimum(lengths[record] - part * max_doc_bytes, max_doc_bytes), 1)
    return {"start": starts[record], "end": ends[record], "part": part.astype(np.int32), "bytes": size,
            "chars": size, "bad": bad, "empty": empty}


def _index_text(path, max_doc_bytes):
    """BERT format: (start, end) byte offsets of documents; long documents cut at a line, long
    lines at a UTF-8 character boundary. Returns starts, ends, characters (without the document's
    last newline: what the same sentences joined into a record hold) and the count of non-UTF-8 lines."""
    docs = []  # (start, end, characters) of each document
    bad_lines = 0
    with open(path, "rb") as f:
        pos = 0
        doc_start = None
        doc_chars = 0
        while True:
            line = f.readline(MAX_LINE_BYTES)  # b"" at the end: a blank line that ends the last document
            if len(line) == MAX_LINE_BYTES and not line.endswith(b"\n"):
                k = len(line) - 1  # step back to the start of a multi-byte UTF-8 character
                while k > 0 and (line[k] & 0xC0) == 0x80:
                    k -= 1
                if k > 0 and line[k] >= 0xC0:  # (k == 0: no character starts in the piece; keep it whole)
                    line = line[:k]
                    f.seek(pos + k)
            if line.strip():
                try:
                    length = len(line.decode("utf-8"))
                except UnicodeDecodeError:
                    bad_lines, length = bad_lines + 1, len(line)
                if doc_start is None:
                    doc_start = pos
                elif pos - doc_start >= max_doc_bytes:
                    docs.append((doc_start, pos, doc_chars - 1))
                    doc_start, doc_chars = pos, 0
                doc_chars += length
            elif doc_start is not None:
                docs.append((doc_start, pos, doc_chars - 1))
                doc_start, doc_chars = None, 0
            if not line:
                break
            pos += len(line)
    starts, ends, chars = np.array(docs, np.int64).reshape(-1, 3).T
    return {"start": starts, "end": ends, "part": np.zeros(len(starts), np.int32), "bytes": ends - starts,
            "chars": np.maximum(chars, 1), "bad": bad_lines, "empty": 0}


def _json_text(line, path, line_no, text_field):
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except ValueError as e:
        raise CorpusError(f"{path}, line {line_no}: not valid JSON ({e.args[0].split(':')[0]}); "
                          "fix or remove the line") from None
    if not isinstance(record, dict) or text_field not in record:
        has = ", ".join(list(record)[:8]) if isinstance(record, dict) else type(record).__name__
        raise CorpusError(f"{path}, line {line_no}: no field {text_field!r} (it has: {has}); "
                          "name the text with --text-field")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise CorpusError(f"{path}, line {line_no}: field {text_field!r} is a {type(text).__name__}, not text")
    return text or ""


def _index_jsonl(path, text_field, max_doc_bytes, name):
    """JSON lines: one record per line, indexed by byte offsets; records parsed once here, so a bad
    line is reported (as `name`'s) before training rather than in the middle of it."""
    records = []  # (start, end, characters) of each record that holds text
    empty = 0
    bad = 0
    with open(path, "rb") as f:
        pos = 0
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError:
                    bad += 1
                text = _json_text(line, name, line_no, text_field)
                if text.strip():
                    records.append((pos, pos + len(line), len(text)))
                else:
                    empty += 1
            pos += len(line)
    starts, ends, lengths = np.array(records, np.int64).reshape(-1, 3).T
    return _record_index(starts, ends, lengths, max_doc_bytes, bad, empty)


def _index_records(path, fmt, text_field, max_doc_bytes):
    """parquet: (row group, row) per record; arrow: (0, row) (arrow_corpus.py reads them)."""
    group, row, lengths, empty = _arrow_corpus(path).index_records(path, fmt, text_field, CorpusError)
    return _record_index(group, row, lengths, max_doc_bytes, 0, empty)


def _index_file(path, fmt, text_field, max_doc_bytes, name):
    """One file's index, cached on disk by (path, size, mtime, settings): a restart reads no text.
    The first process of a machine builds it; the others wait for it and load it."""
    key = cache_key([file_identity(path), fmt, text_field, max_doc_bytes, INDEX_VERSION], 20)
    cached = os.path.join(CACHE_DIR, "index", f"{key}.npz")
    with _machine_lock(cached + ".lock"):
        if not os.path.exists(cached):
            try:
                if fmt == "text":
                    index = _index_text(path, max_doc_bytes)
                elif fmt == "jsonl":
                    index = _index_jsonl(path, text_field, max_doc_bytes, name)
                else:
                    index = _index_records(path, fmt, text_field, max_doc_bytes)
            except OSError as e:
                raise CorpusError(f"corpus file {name} cannot be read ({e.strerror or e})") from None
            atomic_write(cached, lambda f: np.savez(f, **index))
        with np.load(cached) as z:
            return {k: z[k] for k in z.files}


def _whitespace_after(text, pos):
    """The first whitespace at or after pos (a part of a long record starts on a word)."""
    m = re.compile(r"\s").search(text, pos, pos + 1000)
    return m.start() if m else pos


def _cut_lines(lines):
    """The non-blank lines, stripped; a line longer than MAX_LINE_BYTES is cut into pieces (bounded memory)."""
    out = []
    for line in lines:
        line = line.strip()
        while len(line) > MAX_LINE_BYTES:
            out.append(line[:MAX_LINE_BYTES])
            line = line[MAX_LINE_BYTES:].lstrip()
        if line:
            out.append(line)
    return out


class Corpus:
    """Numbered documents, each a list of sentences, read by position from the corpus files.

    `sentences`: records of jsonl/parquet/arrow are split into sentences (for nsp pairs); text
    files are already one sentence per line. State: the index and this process's open files."""

    def __init__(self, spec="builtin", split="train", text_field="text", max_doc_bytes=MAX_DOC_BYTES,
                 sentences=True, language="en"):
        if max_doc_bytes < 1024:
            raise CorpusError(f"--max-doc-bytes must be at least 1024, not {max_doc_bytes}")
        self.text_field, self.max_doc_bytes = text_field, max_doc_bytes
        self.sentences, self.language = sentences, language
        given = resolve_corpus(spec, split)
        self.formats = [file_format(p) for p in given]
        # gzip has no random access: a .gz is decompressed once into the cache
        self.files = [_plain_copy(p) if p.endswith(".gz") else p for p in given]
        parts = [_index_file(p, f, text_field, max_doc_bytes, name)
                 for p, f, name in zip(self.files, self.formats, given, strict=True)]
        bad, empty = sum(int(x["bad"]) for x in parts), sum(int(x["empty"]) for x in parts)
        if bad:
            warnings.warn(f"corpus: {bad} line(s) hold bytes that are not UTF-8; they were replaced", stacklevel=2)
        if empty:
            warnings.warn(f"corpus: {empty} record(s) with empty or missing {text_field!r} were skipped",
                          stacklevel=2)
        self.index = {k: np.concatenate([x[k] for x in parts]) for k in ("start", "end", "part", "bytes", "chars")}
        self.index["file"] = np.concatenate([np.full(len(x["start"]), i, np.int32) for i, x in enumerate(parts)])
        if self.num_docs == 0:
            raise CorpusError(f"corpus {', '.join(given)} holds no text")
        if sentences and any(f != "text" for f in self.formats):
            self._segmenter()  # fail now, not in a DataLoader worker
            # sentencex splits a language it has no rules for by the English ones, silently: say so
            known = {re.split(r"[_.@]", name)[0] for name in locale.locale_alias}
            if language.split("-")[0].lower() not in known:
                warnings.warn(f"--language {language} is not an ISO 639 language code this machine knows; "
                              "sentences are split by sentencex's fallback (English) rules", stacklevel=2)
        self._pid, self._open = None, {}

    def __getstate__(self):  # open files are per process (_handle): a worker opens its own
        return {**self.__dict__, "_pid": None, "_open": {}}

    @property
    def num_docs(self):
        return len(self.index["start"])

    def doc_bytes(self):
        return self.index["bytes"]

    def fingerprint(self):
        """What must be equal on every rank and across a resume: documents, bytes, the offset index."""
        digest = hashlib.sha256()
        for key in ("file", "start", "end", "part", "bytes"):
            digest.update(np.ascontiguousarray(self.index[key]).tobytes())
        return {"documents": self.num_docs, "bytes": int(self.doc_bytes().sum()), "index": digest.hexdigest()[:16]}

    def identity(self):
        """This machine's files and reading settings: what a cache of their tokens is keyed by."""
        files = [file_identity(p) for p in self.files]
        split = self.sentences and any(f != "text" for f in self.formats)  # text reads the same either way
        return [files, self.text_field, self.max_doc_bytes, split, self.language, self.fingerprint()]

    def _segmenter(self):
        try:
            import sentencex
        except ImportError:
            raise CorpusError("--objective nsp on jsonl/parquet/arrow records splits them into sentences: "
                              "pip install sentencex (or use --objective mlm)") from None
        return sentencex.segment

    def _handle(self, file_id):
        """Open files are per process: a forked DataLoader worker must not share a file offset."""
        if self._pid != os.getpid():
            self._pid, self._open = os.getpid(), {}
        if file_id not in self._open:
            path, fmt = self.files[file_id], self.formats[file_id]
            if fmt in ("text", "jsonl"):
                self._open[file_id] = open(path, "rb")
            else:
                self._open[file_id] = _arrow_corpus(path).open_records(path, fmt, self.text_field)
        return self._open[file_id]

    def _record_text(self, doc_id):
        file_id = int(self.index["file"][doc_id])
        start, end = int(self.index["start"][doc_id]), int(self.index["end"][doc_id])
        fmt, handle = self.formats[file_id], self._handle(file_id)
        if fmt == "jsonl":
            handle.seek(start)
            return _json_text(handle.read(end - start), self.files[file_id], "?", self.text_field)
        return _arrow_corpus(self.files[file_id]).record_text(handle, fmt, start, end, self.text_field)

    def read(self, doc_id):
        """A document's non-blank sentences (text: its lines), long lines cut into pieces."""
        file_id = int(self.index["file"][doc_id])
        if self.formats[file_id] == "text":
            f = self._handle(file_id)
            f.seek(int(self.index["start"][doc_id]))
            raw = f.read(int(self.index["end"][doc_id] - self.index["start"][doc_id]))
            return _cut_lines(raw.decode("utf-8", errors="replace").split("\n"))
        text, part = self._record_text(doc_id), int(self.index["part"][doc_id])
        if len(text) > self.max_doc_bytes:
            m = self.max_doc_bytes
            lo = _whitespace_after(text, part * m) if part else 0
            hi = _whitespace_after(text, (part + 1) * m) if (part + 1) * m < len(text) else len(text)
            text = text[lo:hi]
        if not self.sentences:
            return _cut_lines(text.split("\n"))
        segment = self._segmenter()
        # a blank line is a paragraph break: no sentence spans it
        return _cut_lines([s for para in re.split(r"\n\s*\n", text) if para.strip()
                           for s in segment(self.language, para.replace("\n", " "))])


def open_corpus(spec, split="train", objective="nsp", text_field="text", max_doc_bytes=MAX_DOC_BYTES, language="en"):
    """A Corpus read as `objective` needs it: sentences for nsp pairs, lines for packed mlm."""
    return spec if isinstance(spec, Corpus) else Corpus(spec, split, text_field, max_doc_bytes,
                                                        objective == "nsp", language)


# ============================================================================= 2. tokenizer

def tokenizer_sample(corpus, sample_bytes):
    """Documents to train the tokenizer on: all, or a seeded random set spread over the whole
    corpus (every file) with about sample_bytes of text, in corpus order (files read forward)."""
    sizes = corpus.doc_bytes()
    if sizes.sum() <= sample_bytes:
        return np.arange(len(sizes))
    order = np.random.default_rng(11).permutation(len(sizes))
    take = int(np.searchsorted(np.cumsum(sizes[order]), sample_bytes)) + 1
    return np.sort(order[:take])


def train_tokenizer(corpus, doc_ids, vocab_size, out_dir):
    """Train a lower-cased BERT WordPiece tokenizer on the given documents, on all cores."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def batches():
        for k in range(0, len(doc_ids), 256):
            yield [s for d in doc_ids[k:k + 256] for s in corpus.read(int(d))]

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(batches(), trainers.WordPieceTrainer(
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


def get_tokenizer(tokenizer_dir=None, corpus=None, vocab_size=8192, sample_mb=TOKENIZER_SAMPLE_MB):
    """Load a local Hugging Face tokenizer folder, or train one on `corpus` (a Corpus, a --corpus
    spec or a list of files): on at most sample_mb of its text, cached and reused."""
    from transformers import AutoTokenizer
    if tokenizer_dir is None:
        corpus = corpus if isinstance(corpus, Corpus) else Corpus(corpus, sentences=False)
        key = cache_key([corpus.identity()[:3], vocab_size, sample_mb], 16)
        tokenizer_dir = os.path.join(CACHE_DIR, "tokenizers", f"wordpiece-{vocab_size}-{key}")
        if not os.path.isdir(tokenizer_dir):
            os.makedirs(os.path.dirname(tokenizer_dir), exist_ok=True)
            train_tokenizer(corpus, tokenizer_sample(corpus, sample_mb * 1e6), vocab_size, tokenizer_dir)
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


def tokenizer_hash(tokenizer):
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def tokenize_lines(tokenizer, lines):
    """Sentences -> (token ids, sentence bounds): ids of sentence i are ids[bounds[i]:bounds[i+1]].
    Sentences that tokenize to nothing stay, empty: a random next segment's start counts them."""
    encoded = tokenizer.backend_tokenizer.encode_batch(lines, add_special_tokens=False)
    lengths = [len(e.ids) for e in encoded]
    ids = np.fromiter((t for e in encoded for t in e.ids), np.int32, sum(lengths))
    return ids, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


# ============================================================================= 3. token cache

class TokenCache:
    """Token ids of documents on disk, shared by every process of a machine, keyed by the corpus
    and tokenizer. Each process appends the documents it tokenized as its own pieces (written to a
    temporary name, fsynced, renamed: a crash never leaves a piece that reads as valid); a piece
    carries a checksum, verified the first time a process reads it. A piece that fails is deleted
    and its documents are tokenized again. Two processes that tokenize the same document write
    identical ids, so whichever piece a reader finds is right.

    Piece layout: a JSON header line, then int64 document ids, int64 sentence-count offsets,
    int64 token offsets, and the tokens (uint16 when the vocabulary fits, else uint32)."""

    def __init__(self, root, key, vocab_size):
        self.dir = os.path.join(root, key)
        self.dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
        self.where = None  # document -> (piece, place in it), -1: not cached; set by refresh
        self.pieces = []
        self.pending = []  # (doc_id, ids, bounds) tokenized by this process, not written yet
        self.pending_tokens = 0
        self.writable, self.pid = True, os.getpid()

    def __getstate__(self):
        """What a DataLoader worker started by a forkserver receives: no mappings (it maps the pieces
        itself at its first refresh) and nothing pending (the parent's to write)."""
        return {**self.__dict__, "where": None, "pieces": [], "pending": [], "pending_tokens": 0}

    def refresh(self, num_docs):
        """Find the pieces written so far (by any process); called at the start of every pass."""
        if self.pid != os.getpid():  # a forked worker: what its parent had pending is the parent's
            self.pid = os.getpid()
            self.pending, self.pending_tokens = [], 0
        self.where, self.pieces = np.full((num_docs, 2), -1, np.int64), []
        if not os.path.isdir(self.dir):
            return
        # every mapped piece holds a file descriptor: allow as many as the system lets this process have
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".piece"):
                self._add_piece(os.path.join(self.dir, name))

    def _add_piece(self, path):
        try:
            with open(path, "rb") as f:
                header = json.loads(f.readline())
                offset = f.tell()
            n_docs = header["docs"]
            arrays = (("docs", n_docs, np.int64), ("doc_sents", n_docs + 1, np.int64),
                      ("bounds", header["sentences"] + 1, np.int64),
                      ("tokens", header["tokens"], np.dtype(header["dtype"])))  # the layout of the class docstring
            if os.path.getsize(path) != offset + sum(count * np.dtype(dt).itemsize for _, count, dt in arrays):
                raise ValueError("truncated")
        except FileNotFoundError:  # removed by another process since the listing
            return
        except OSError as e:  # e.g. out of file descriptors: the piece may be fine; leave it
            warnings.warn(f"token cache: cannot read {path} ({e}); its documents are tokenized", stacklevel=3)
            return
        except (ValueError, KeyError, TypeError):
            self._drop(path, "unreadable or truncated")
            return
        try:
            with open(path, "rb") as f:  # plain arrays over the mapping: numpy's memmap slices are slow
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:  # e.g. out of file descriptors: the piece is fine, this process goes without it
            warnings.warn(f"token cache: cannot map {path} ({e}); its documents are tokenized", stacklevel=3)
            return
        views, pos = {}, offset
        for name, count, dt in arrays:
            views[name] = np.frombuffer(mm, dt, count, pos)
            pos += count * np.dtype(dt).itemsize
        piece_id = len(self.pieces)
        self.pieces.append({"path": path, "checksum": header["checksum"], "verified": False, "mm": mm,
                            "offset": offset, **views})
        valid = np.flatnonzero((views["docs"] >= 0) & (views["docs"] < len(self.where)))
        self.where[views["docs"][valid]] = np.stack([np.full(len(valid), piece_id), valid], 1)

    def _drop(self, path, why):
        warnings.warn(f"token cache: {path} is {why}; its documents will be tokenized again", stacklevel=3)
        with contextlib.suppress(OSError):
            os.remove(path)

    def get(self, doc_id):
        """(ids, sentence bounds) of a cached document, or None."""
        piece_id, k = self.where[doc_id] if self.where is not None else (-1, -1)
        if piece_id < 0:
            return None
        piece = self.pieces[piece_id]
        if not piece["verified"]:
            if hashlib.blake2b(memoryview(piece["mm"])[piece["offset"]:], digest_size=16).hexdigest() \
                    != piece["checksum"]:
                self._drop(piece["path"], "corrupt (checksum)")
                self.where[self.where[:, 0] == piece_id] = -1
                return None
            piece["verified"] = True
        s0, s1 = int(piece["doc_sents"][k]), int(piece["doc_sents"][k + 1])
        bounds = piece["bounds"][s0:s1 + 1]
        return piece["tokens"][bounds[0]:bounds[-1]], bounds - bounds[0]

    def add(self, doc_id, ids, bounds):
        if not self.writable:
            return
        self.pending.append((doc_id, ids, bounds))
        self.pending_tokens += len(ids)
        if self.pending_tokens >= PIECE_TOKENS:
            self.flush()

    def flush(self):
        if not self.pending or not self.writable:
            self.pending, self.pending_tokens = [], 0
            return
        docs = np.array([d for d, _, _ in self.pending], np.int64)
        doc_sents = np.concatenate([[0], np.cumsum([len(b) - 1 for _, _, b in self.pending])]).astype(np.int64)
        offsets = np.cumsum([0] + [len(i) for _, i, _ in self.pending[:-1]])
        bounds = np.concatenate([b[:-1] + o for (_, _, b), o in zip(self.pending, offsets, strict=True)]
                                + [[offsets[-1] + len(self.pending[-1][1])]]).astype(np.int64)
        tokens = np.concatenate([i for _, i, _ in self.pending]).astype(self.dtype)
        payload = b"".join(a.tobytes() for a in (docs, doc_sents, bounds, tokens))
        header = {"docs": len(docs), "sentences": len(bounds) - 1, "tokens": len(tokens),
                  "dtype": np.dtype(self.dtype).name, "version": CACHE_VERSION,
                  "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest()}
        self.pending, self.pending_tokens = [], 0
        path = os.path.join(self.dir, f"{uuid.uuid4().hex}.piece")
        failed = try_write(lambda: os.makedirs(self.dir, exist_ok=True) or atomic_write(
            path, lambda f: f.writelines([json.dumps(header).encode() + b"\n", payload])), self.dir, self.dir)
        if failed:
            self.writable = False
            warnings.warn(f"token cache: {failed}; going on without it", stacklevel=2)


def token_cache_for(setting, corpus, tokenizer):
    """--token-cache: 'auto' (under the cache directory), a directory, or 'none' (None)."""
    if setting in (None, "none"):
        return None
    root = os.path.join(CACHE_DIR, "tokens") if setting == "auto" else setting
    key = cache_key([corpus.identity(), tokenizer_hash(tokenizer), CACHE_VERSION], 24, hashlib.sha256)
    return TokenCache(root, key, len(tokenizer))


def document_tokens(corpus, tokenizer, cache, doc_id):
    """(ids, sentence bounds) of a document, from the token cache or tokenized (and cached) now."""
    if cache is not None and cache.where is None:
        cache.refresh(corpus.num_docs)
    hit = cache.get(doc_id) if cache is not None else None
    if hit is not None:
        return hit
    ids, bounds = tokenize_lines(tokenizer, corpus.read(doc_id))
    if cache is not None:
        cache.add(doc_id, ids, bounds)
    return ids, bounds


# ============================================================================= 4. samples

def doc_rng(seed, epoch, doc_id, *purpose):
    """Independent RNG per (seed, epoch, document, purpose): same samples on any rank/worker."""
    return np.random.default_rng([seed, epoch, doc_id, *purpose])


def plan_pairs(seg_lens, max_num_tokens, short_seq_prob, doc_id, num_docs, rng):
    """Google's create_instances_from_document, structure only (shared with estimate_steps.py).

    Returns one (a_start, a_end, b_end, random_doc, random_frac, target_len) per sample. Segment A
    is segments a_start:a_end; B is segments a_end:b_end, or (random_doc >= 0) sentences of another
    document from random_frac of its length on, until B holds target_len - len(A) tokens (Google's
    target_b_length: a document drawn short gets short random pairs too). The RNG draws here never
    depend on other documents, so the count of samples needs only this document's lengths.
    """
    target_len = max_num_tokens
    if rng.random() < short_seq_prob:
        target_len = int(rng.integers(2, max_num_tokens + 1))
    plans = []
    chunk_start = 0  # the sample's first segment, and the tokens from it to segment i
    chunk_len = 0
    i = 0
    while i < len(seg_lens):
        chunk_len += seg_lens[i]
        if i == len(seg_lens) - 1 or chunk_len >= target_len:
            n = i + 1 - chunk_start
            a_end = chunk_start + (int(rng.integers(1, n)) if n >= 2 else 1)
            if n == 1 or rng.random() < 0.5:
                random_doc = int(rng.random() * (num_docs - 1)) if num_docs > 1 else doc_id
                random_doc += num_docs > 1 and random_doc >= doc_id  # any document but this one
                plans.append((chunk_start, a_end, a_end, random_doc, rng.random(), target_len))
                i = a_end - 1  # the unused segments go back for the next sample
            else:
                plans.append((chunk_start, a_end, i + 1, -1, 0.0, target_len))
            chunk_start, chunk_len = i + 1, 0
        i += 1
    return plans


def truncate_pair(a, b, max_num_tokens, rng):
    """BERT's truncate_seq_pair in closed form: the same lengths as trimming the longer side one
    token at a time, and the same distribution of front/back cuts, without a per-token loop."""
    m = max_num_tokens
    la, lb = len(a), len(b)
    if la + lb > m:
        if la > lb:
            la = max(lb, m - lb)
        else:
            lb = max(la, m - la)
        if la + lb > m:  # both sides equal and still too long: they alternate, A keeps the odd one
            la, lb = (m + 1) // 2, m // 2
    front_a, front_b = rng.binomial(len(a) - la, 0.5), rng.binomial(len(b) - lb, 0.5)
    return a[front_a:front_a + la], b[front_b:front_b + lb]


def random_segment(ids, bounds, frac, target_len):
    """Google's random next segment: whole sentences from frac of the document on (at least one),
    until target_len tokens are reached."""
    n = len(bounds) - 1
    start = min(int(frac * n), n - 1)
    end = int(np.searchsorted(bounds, bounds[start] + max(target_len, 1), side="left"))
    return ids[bounds[start]:bounds[min(max(end, start + 1), n)]]


def random_segment_of_lines(tokenizer, lines, frac, target_len):
    """random_segment of a document that is not in the token cache: only the sentences needed are
    tokenized (from frac of its lines on), not the whole document."""
    start = min(int(frac * len(lines)), len(lines) - 1)
    step = 2  # lines tokenized at a time, doubling: most random segments need a few sentences
    ids = []
    bounds = [np.zeros(1, np.int64)]
    have = 0  # tokens in ids
    while 0 <= start < len(lines) and have < max(target_len, 1):
        i, bd = tokenize_lines(tokenizer, lines[start:start + step])
        ids.append(i), bounds.append(bd[1:] + have)
        have, start, step = have + len(i), start + step, 2 * step
    return random_segment(np.concatenate(ids), np.concatenate(bounds), 0.0, target_len) if ids else []


def random_next_segment(corpus, tokenizer, cache, doc_id, frac, target_len):
    """B of a random next sentence. A cached document is sliced; otherwise only the sentences
    needed are tokenized (and not cached: they are part of another worker's document)."""
    hit = cache.get(doc_id) if cache is not None else None
    if hit is not None and len(hit[1]) > 1:
        b = random_segment(*hit, frac, target_len)
    else:
        b = random_segment_of_lines(tokenizer, corpus.read(doc_id), frac, target_len)
    return b if len(b) else np.array([tokenizer.unk_token_id], np.int32)


def pair_sample(units, k, seed, epoch, random_b, cls_id, sep_id, max_num_tokens):
    """Sample k of a document, [CLS] A [SEP] B [SEP], from its units (doc_id, ids, starts, ends, plans of
    plan_pairs; sentence i is ids[starts[i]:ends[i]]), built when it is drawn: its random next segment,
    random_b(doc_id, frac, target_len), is read then, so a long document's samples cost nothing until they
    are used. Its RNG is its own (keyed by k): a resumed stream builds sample k without building the ones
    before it. Returns (ids, masking draws, (doc_id,), where B starts, next-sentence label)."""
    doc_id, ids, starts, ends, plans = units
    a_start, a_end, b_end, random_doc, frac, target_len = plans[k]
    rng = doc_rng(seed, epoch, doc_id, 1, k)
    a = ids[starts[a_start]:ends[a_end - 1]]
    b = random_b(random_doc, frac, target_len - len(a)) if random_doc >= 0 else ids[starts[a_end]:ends[b_end - 1]]
    a, b = truncate_pair(a, b, max_num_tokens, rng)
    sample = np.concatenate([[cls_id], a, [sep_id], b, [sep_id]]).astype(np.int64)
    return sample, rng.random((3, len(sample)), dtype=np.float32), (doc_id,), len(a) + 2, int(random_doc >= 0)


def packed_window(parts, cls_id, sep_id):
    """An mlm sample from (ids, draws, doc_id) parts: [CLS] parts [SEP]; the edges are never masked."""
    ids = np.concatenate([[cls_id], *[p[0] for p in parts], [sep_id]]).astype(np.int64)
    edge = np.ones((3, 1), np.float32)
    draws = np.concatenate([edge, *[p[1] for p in parts], edge], axis=1)
    return ids, draws, tuple(sorted({p[2] for p in parts})), len(ids), 0


def token_tables(tokenizer):
    """What mask_batch looks ids up in: special tokens, ## continuation pieces, the random ids."""
    special_table = np.zeros(len(tokenizer), bool)
    special_table[sorted(set(tokenizer.all_special_ids))] = True
    continuation_table = np.zeros(len(tokenizer), bool)
    for token, i in tokenizer.get_vocab().items():
        continuation_table[i] = token.startswith("##")
    return special_table, continuation_table, np.flatnonzero(~special_table)


def mask_batch(ids, draws, special_table, continuation_table, mask_id, random_ids, mask_prob, whole_word):
    """BERT dynamic masking of a padded batch in place; returns the labels (-100: not predicted).

    draws[0] chooses (mask_prob of the non-special tokens; with whole_word, a word's first piece
    decides for every piece of it), draws[1] picks 80% [MASK] / 10% random token / 10% kept,
    draws[2] picks the random token from random_ids (the vocabulary less its special tokens)."""
    special = special_table[ids]
    choose = draws[0]
    if whole_word:
        starts = ~continuation_table[ids] | special
        starts[:, 1:] |= special[:, :-1]
        first = np.maximum.accumulate(np.where(starts, np.arange(ids.shape[1]), 0), axis=1)
        choose = np.take_along_axis(choose, first, axis=1)
    chosen = (choose < mask_prob) & ~special
    labels = np.where(chosen, ids, -100)
    ids[chosen & (draws[1] < 0.8)] = mask_id
    replace = chosen & (draws[1] >= 0.8) & (draws[1] < 0.9)
    ids[replace] = random_ids[(draws[2][replace] * len(random_ids)).astype(np.int64)]
    return labels


def pack_rows(lengths, width):
    """First-fit decreasing: the (row, offset) of each sample in rows of `width` tokens (rows from 0 on)."""
    rows, offsets, free = (np.zeros(len(lengths), np.int64) for _ in range(3))
    free += width
    for i in np.argsort(-lengths, kind="stable"):
        rows[i] = row = int(np.argmax(free >= lengths[i]))  # the first row with room: an empty one at worst
        offsets[i], free[row] = width - free[row], free[row] - lengths[i]
    return rows, offsets


def collate(samples, cursor, pad_id, max_seq_len, mask, nsp, pack=False):
    """(ids, draws, doc ids, type_start, nsp label) samples -> a batch of tensors; mask(ids, draws)
    masks the padded ids in place and returns the labels (mask_batch). pack: samples share rows
    (pack_rows), each with its own 'position_ids' (from 0) and 'sequence_ids' (its number in the
    batch, -1 on padding), and 'cls_pos' says where each sample's [CLS] is in the flattened rows: a
    model must let a token attend only to tokens of its own sequence (pretrain_ddp.py does; a stock
    Hugging Face model reading only 'attention_mask' would mix the samples of a row)."""
    lengths = np.array([len(s[0]) for s in samples])
    rows, offsets = pack_rows(lengths, max_seq_len) if pack else (np.arange(len(samples)), np.zeros_like(lengths))
    # Pad to a multiple of 8 (tensor cores), not to max_seq_len: less wasted compute.
    width = min(max_seq_len, -(-int((offsets + lengths).max()) // 8) * 8)
    shape = (int(rows.max()) + 1, width)
    ids = np.full(shape, pad_id, np.int64)
    types = np.zeros(shape, np.int64)
    positions = np.zeros(shape, np.int64)
    draws = np.ones((3, *shape), np.float32)  # draws 1.0: never chosen
    sequence = np.full(shape, -1, np.int64)
    for i, (sample_ids, sample_draws, _, type_start, _) in enumerate(samples):
        row, cols = rows[i], slice(offsets[i], offsets[i] + lengths[i])
        ids[row, cols] = sample_ids
        draws[:, row, cols] = sample_draws
        sequence[row, cols] = i
        types[row, offsets[i] + type_start:cols.stop] = 1
        positions[row, cols] = np.arange(lengths[i])
    labels = mask(ids, draws)
    batch = {"input_ids": torch.from_numpy(ids), "token_type_ids": torch.from_numpy(types),
             "attention_mask": torch.from_numpy((sequence >= 0).astype(np.int64)), "labels": torch.from_numpy(labels),
             "cursor": cursor}
    if pack:
        batch.update(position_ids=torch.from_numpy(positions), sequence_ids=torch.from_numpy(sequence),
                     cls_pos=torch.from_numpy(rows * width + offsets))
    if nsp:
        batch["next_sentence_label"] = torch.tensor([s[4] for s in samples], dtype=torch.long)
    return batch


# ============================================================================= 5. order and shards

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


def fresh_position(num_open, shard_size, block_size):
    """A shard's cursor before its first sample: 'pool' is the pool's cursor where the block being read began
    (draw_units; at first: the first num_open documents open, none read), 'block' its number, 'used' its samples
    consumed, 'block_size' the --shuffle-block the epoch began with (a resume with another one goes on with it);
    'leftover_used': samples consumed of the shard's share of a resize's leftover (read first)."""
    k = min(num_open, shard_size)
    pool = {"next": k, "draw": 0, "open": list(range(k)), "taken": [0] * k, "size": [-1] * k}
    return {"pool": pool, "block": 0, "used": 0, "block_size": block_size, "leftover_used": 0}


def empty_state(epoch):
    """The cursor state of an epoch nothing of which was consumed."""
    return {"epoch": epoch, "num_shards": None, "positions": {}, "last_shard": None, "exclude": [], "partial": {},
            "leftover": []}


def reshard_pools(state, pools, num_shards, doc_bytes, seed, shuffle):
    """A state written for state["num_shards"] shards, for num_shards, from the pool cursors of all
    old shards (pools: shard -> the pool's cursor after what was read, or given to 'leftover').

    Documents the old sharding finished are left out, a partly read one goes on from the unit
    where it stopped ('partial'), the rest is cut into new shards. Both accumulate, so a chain of
    resizes reads every sample of a document once."""
    old = shard_documents(doc_bytes, seed, state["epoch"], state["num_shards"], shuffle,
                          np.array(state["exclude"], np.int64))
    exclude, partial = set(state["exclude"]), dict(state["partial"])
    for s, pos in pools.items():
        shard = old[int(s)]
        still_open = {p for p in pos["open"] if p >= 0}
        exclude.update(int(shard[p]) for p in range(pos["next"]) if p not in still_open)
        partial.update({str(int(shard[p])): t for p, t in zip(pos["open"], pos["taken"], strict=True)
                        if p >= 0 and t > 0})
    return {"epoch": state["epoch"], "num_shards": num_shards, "positions": {}, "last_shard": None,
            "exclude": sorted(exclude), "partial": {d: t for d, t in partial.items() if int(d) not in exclude}}


def block_order(num_samples, seed, epoch, shard, num_shards, block, shuffle):
    """The order a block's samples are read in: a permutation keyed by the block (no RNG state: a
    resume at sample n of a block orders it the same)."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch, 7, shard, num_shards, block]).permutation(num_samples)


def worker_shard(rank, num_workers, worker_id, last_shard):
    """The shard a DataLoader worker reads. DataLoader takes batches round-robin from worker 0; after
    a resume the old run's next batch was due from the worker after the last one consumed
    (last_shard), so new worker 0 plays that role."""
    rotate = 0 if last_shard is None else (last_shard - rank * num_workers + 1) % num_workers
    return rank * num_workers + (worker_id + rotate) % num_workers


def shard_draws(seed, epoch, shard, num_shards):
    """Uniform number n in [0, 1) of a shard (it picks the open document that gives the next
    unit), made in blocks keyed by position: a resume at draw n needs no RNG state."""
    block = {}

    def draw(n):
        if n // 4096 not in block:
            block.clear()
            block[n // 4096] = np.random.default_rng([seed, epoch, 6, shard, num_shards, n // 4096]).random(4096)
        return block[n // 4096][n % 4096]
    return draw


def draw_units(shard_docs, position, draw, open_units, take, size, per_draw, partial, guess):
    """Units of one shard, each from an open document drawn with probability proportional to
    the draws it has left: open_units(doc_id) -> a document's units, take(units, k) -> (unit,
    next k) takes what follows index k of them (one draw), size(units) is where they end, per_draw
    the units a draw takes at most, guess(doc_id) the draws of a document not read yet (from the
    index); draw(n) is the shard's n-th uniform number (shard_draws) and `partial` how far documents
    were read before a resize (reshard_state). `position` (the cursor) is updated in place: which
    shard documents are open ('open': places in the shard, -1 once none is left), how far each is
    read ('taken'), its units once read ('size', -1 before), the next place to open, the draws made.

    Weighted, not uniform, so the pool drains evenly and a batch mixes documents alike all epoch, as a
    global shuffle does (a uniform draw empties the short documents first and ends every shard on its
    few longest ones). A document is read when it is first drawn, so the first batch waits for the
    documents it holds, not for --shuffle-docs of them (30 books: 1 s, not 14 s); until then its weight
    is guessed from its length in the index, then it is its units left, kept in the cursor: the weights
    are a pure function of the cursor and the corpus, and a resume draws the same documents."""
    opened = position["open"]  # the cursor's lists, one place a slot
    taken = position["taken"]
    sizes = position["size"]
    live = {}  # slot -> the open document's units; memory: --shuffle-docs documents

    def weight(slot):
        """The draws left in a slot (0: closed; an empty document 1, so that a draw replaces it)."""
        if opened[slot] < 0:
            return 0
        if sizes[slot] < 0:
            return guess(int(shard_docs[opened[slot]]))
        return max(-(-(sizes[slot] - taken[slot]) // per_draw), 1)

    weights = np.array([weight(s) for s in range(len(opened))], np.int64)
    while weights.any():
        cum = np.cumsum(weights)
        slot = int(np.searchsorted(cum, draw(position["draw"]) * cum[-1], side="right"))
        if slot not in live:
            doc_id = int(shard_docs[opened[slot]])
            live[slot] = open_units(doc_id)
            sizes[slot] = size(live[slot])
            # a document partly read before a resize goes on from where it stopped
            taken[slot] = max(taken[slot], partial.get(str(doc_id), 0))
        k = taken[slot]
        end = sizes[slot]
        if k < end:  # else an empty document: replaced, and the same draw used again
            unit, taken[slot] = take(live[slot], k)
            position["draw"] += 1
        if taken[slot] >= end:
            del live[slot]
            if position["next"] < len(shard_docs):
                opened[slot] = position["next"]
                taken[slot] = 0
                sizes[slot] = -1
                position["next"] += 1
            else:
                opened[slot] = -1
        weights[slot] = weight(slot)
        if k < end:
            yield unit


def packed_windows(shard_docs, position, draw, open_units, partial, guess, width, cls_id, sep_id, specs):
    """The mlm samples of a shard, each with its parts ([doc_id, from, to]; None unless `specs`): a window of `width`
    tokens is filled from a drawn document up to the window's end or the document's (its [SEP]),
    then from the next drawn one: documents change only at a [SEP], every window ends at a draw
    (the cursor needs nothing else), and every token of the shard is in one window."""
    parts, need = [], [width]

    def take(units, k):
        ids, draws, doc_id = units
        end = min(k + need[0], len(ids))
        return (ids[k:end], draws[:, k:end], doc_id, k, end), end

    def window():  # the sample, and what it is made of ([doc_id, from, to] per part)
        return packed_window(parts, cls_id, sep_id), [[p[2], p[3], p[4]] for p in parts] if specs else None

    for part in draw_units(shard_docs, position, draw, open_units, take, lambda units: len(units[0]), width, partial,
                           guess):
        parts.append(part)
        need[0] -= len(part[0])
        if need[0] == 0:
            yield window()
            parts, need[0] = [], width
    if parts:
        yield window()


def shard_samples(position, leftover, rebuild, samples_from, seed, epoch, shard, num_shards, shuffle):
    """The samples of a shard from `position` (its cursor, updated in place) on: first `leftover`,
    its share of a resize's leftover (specs: rebuild(spec, opened) builds one, opened: doc_id ->
    units), then the pool's samples, samples_from(pool) -> (sample, spec) from a pool cursor on
    (updated in place), in blocks of --shuffle-block, each block in a random order (block_order).

    The pool mixes documents and keeps the mixture the same all epoch, but gives each document's
    samples in the order of its text; the block shuffles them. Both matter on a corpus of few long
    documents (the pydoc topics alone, 27 epochs in 1,200 steps: the pool alone ends 0.06 nats worse
    than pool + block, BENCHMARKS section 11; a shuffle of windows in document order, 0.14 worse).
    The next block is built one sample per sample used of this one, so a worker's work stays even;
    memory: two blocks (+40 MB at --max-seq-len 128). Blocks grow from FIRST_BLOCK samples to
    --shuffle-block (block_length), so the first batch does not wait for a block of 8,192 samples (on
    30 books: 1 s, not 14 s); the rest of a block twice as big as the one read is built at its end,
    eight times an epoch, and the second block after the first is read."""
    opened = {}
    last_use = {doc_id: i for i, spec in enumerate(leftover) for doc_id, _, _ in spec}
    for i in range(position["leftover_used"], len(leftover)):
        position["leftover_used"] = i + 1
        yield rebuild(leftover[i], opened)
        for doc_id, _, _ in leftover[i]:  # memory: only the documents still to be used
            if last_use[doc_id] == i:
                opened.pop(doc_id, None)
    pool = copy.deepcopy(position["pool"])
    block = position["block"]
    samples = samples_from(pool)
    chunk = list(itertools.islice(samples, block_length(block, position["block_size"])))
    while chunk:
        after = copy.deepcopy(pool)  # where the next block begins
        order = block_order(len(chunk), seed, epoch, shard, num_shards, block, shuffle)
        following, size = [], block_length(block + 1, position["block_size"])
        for j in range(position["used"], len(chunk) - 1):
            following += itertools.islice(samples, 1 if block else 0)  # the first batch: its own samples only
            position["used"] = j + 1
            yield chunk[order[j]][0]
        if position["used"] < len(chunk):  # the block's last sample: the cursor moves to the next block
            following += itertools.islice(samples, 1)
            position.update({"pool": after, "block": block + 1, "used": 0})
            yield chunk[order[-1]][0]
        following += itertools.islice(samples, size - len(following))
        position.update({"pool": after, "block": block + 1, "used": 0})
        chunk, block = following, block + 1


def block_length(block, block_size):
    """Samples in block number `block` of a shard: FIRST_BLOCK, doubling up to --shuffle-block."""
    return min(block_size, FIRST_BLOCK << min(block, 40))


def reshard_state(state, num_shards, doc_bytes, seed, shuffle, num_open, block_size, pool_samples):
    """A state written for state["num_shards"] shards (merged over every rank), for num_shards:
    what each old shard had not read of its share of 'leftover' and of the block it was reading
    becomes the new 'leftover' (as specs: the samples themselves, shared round-robin by the new
    shards, which read them first); the rest of the documents is resharded (reshard_pools).
    pool_samples(shard, num_shards, shard_docs, pool, partial, specs) -> (sample, spec) of each
    sample a shard's pool gives from its cursor `pool` on (updated in place), in state's epoch.
    Costs of a resize mid-epoch: every rank rebuilds each old shard's block here (up to
    --shuffle-block samples each), and the specs (up to old shards x --shuffle-block of them)
    ride in every checkpoint until the epoch ends."""
    old_shards = state["num_shards"]
    docs = shard_documents(doc_bytes, seed, state["epoch"], old_shards, shuffle,
                           np.array(state["exclude"], np.int64) if state["exclude"] else None)
    leftover, pools = [], {}
    for s in range(old_shards):
        pos = state["positions"].get(str(s)) or fresh_position(num_open, len(docs[s]), block_size)
        leftover += state["leftover"][s::old_shards][pos["leftover_used"]:]
        pools[s] = copy.deepcopy(pos["pool"])
        if pos["used"]:  # the block it was reading: the rest of it is leftover
            samples = pool_samples(s, old_shards, docs[s], pools[s], state["partial"], True)
            chunk = list(itertools.islice(samples, block_length(pos["block"], pos["block_size"])))
            order = block_order(len(chunk), seed, state["epoch"], s, old_shards, pos["block"], shuffle)
            leftover += [chunk[i][1] for i in order[pos["used"]:]]
    new = reshard_pools(state, pools, num_shards, doc_bytes, seed, shuffle)
    return {**new, "leftover": leftover}


# ============================================================================= 6. the stream

def merge_states(states):
    """The states (BertPretrainStream.state_dict) of all ranks as one, for a resume on another world size: every
    shard's position."""
    return {**states[0], "positions": {k: v for s in states for k, v in s["positions"].items()}, "last_shard": None}


@dataclass(frozen=True)
class StreamSettings:
    """What a stream makes of its corpus: the samples, their masking and order, and how the corpus is read.
    The trainer and the estimator build one from the data flags (settings_from_args), tests directly."""
    objective: str = "nsp"         # nsp: sentence pairs + next-sentence labels; mlm: packed, RoBERTa-style
    max_seq_len: int = 128         # tokens per sample (row), [CLS]/[SEP] included
    batch_size: int = 32           # samples per batch (nsp with pack_pairs: pairs, several a row)
    mask_prob: float = 0.15
    whole_word_mask: bool = False
    short_seq_prob: float = 0.1    # nsp: a document's samples aim at a shorter random length
    pack_pairs: bool = False       # nsp: pairs share rows (collate; --packing, on by default); mlm packs anyway
    seed: int = 0                  # document order, pairs and masking
    shuffle: bool = True           # False: documents in corpus order, one open at a time (eval)
    shuffle_docs: int = SHUFFLE_DOCS
    shuffle_block: int = SHUFFLE_BLOCK
    # how a corpus named by a path is read, and the tokenizer trained on it when none is given
    text_field: str = "text"
    max_doc_bytes: int = MAX_DOC_BYTES
    language: str = "en"
    vocab_size: int = 8192
    token_cache: str = "auto"      # 'auto', a directory or 'none'

    def __post_init__(self):
        if self.objective not in ("nsp", "mlm"):
            raise CorpusError(f"--objective must be nsp or mlm, not {self.objective!r}")
        if self.max_seq_len < (5 if self.objective == "nsp" else 3):
            raise CorpusError(f"--max-seq-len {self.max_seq_len} is too small for a {self.objective} sample")
        for flag, value in (("--batch-size", self.batch_size), ("--shuffle-docs", self.shuffle_docs),
                            ("--shuffle-block", self.shuffle_block)):
            if value < 1:
                raise CorpusError(f"{flag} must be at least 1, not {value}")


class BertPretrainStream(IterableDataset):
    """Batches (dicts of tensors) of BERT pretraining samples, one shard per (rank, worker).

    objective 'nsp': original BERT sentence pairs with next-sentence labels (pack_pairs: several pairs
    a row, see collate); 'mlm': RoBERTa-style, sentences packed into full sequences, documents separated
    by [SEP], no padding but at the very end of a shard. corpus: a spec (open_corpus) or a Corpus;
    tokenizer: None trains (or finds cached) a WordPiece on the corpus; rank/world_size: None reads them
    from torch.distributed. State: the epoch, the cursor to resume from, what the trainer consumed."""

    def __init__(self, corpus="builtin", tokenizer=None, settings=None, split="train", rank=None, world_size=None):
        self.settings = settings = settings or StreamSettings()
        self.corpus = open_corpus(corpus, split, settings.objective, settings.text_field, settings.max_doc_bytes,
                                  settings.language)
        self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer(None, self.corpus, settings.vocab_size)
        self.num_open = settings.shuffle_docs if settings.shuffle else 1  # unshuffled: documents in order
        if rank is None:
            dist = torch.distributed
            rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.rank, self.world_size = rank, world_size
        tok = self.tokenizer
        self.cls_id = tok.cls_token_id
        self.sep_id = tok.sep_token_id
        self.pad_id = tok.pad_token_id
        self.mask_id = tok.mask_token_id
        self.vocab_size = len(tok)
        self.special_table, self.continuation_table, self.random_ids = token_tables(tok)
        self.cache = token_cache_for(settings.token_cache, self.corpus, tok)
        self._random_b = functools.partial(random_next_segment, self.corpus, self.tokenizer, self.cache)
        self.set_epoch(0)

    def __len__(self):  # DataLoader must not guess; the estimator answers this question
        raise TypeError("a stream has no length: use estimate_steps.py")

    @property
    def num_docs(self):
        return self.corpus.num_docs

    def fingerprint(self):
        return self.corpus.fingerprint()

    # --- epochs and cursors (main process)
    def set_epoch(self, epoch):
        self.epoch = epoch
        self.resume = None  # a state to go on from (load_state_dict)
        self._consumed = None  # what the trainer used of the epoch (consumed): the next state_dict

    def consumed(self, cursor):
        """Record that the trainer used the batch with this cursor (call for every batch it trains on)."""
        shard, position, num_shards = cursor
        if self._consumed is None:
            self._consumed = {**empty_state(self.epoch), "num_shards": num_shards}
        self._consumed["positions"][str(shard)] = position
        self._consumed["last_shard"] = shard

    def state_dict(self):
        """Where the consumed part of this epoch ends: JSON-serialisable. `positions` are per shard of
        a sharding into `num_shards` of the epoch's documents less `exclude` (read before a resize);
        `partial`: units of documents read before a resize (they go on from there)."""
        return empty_state(self.epoch) if self._consumed is None else copy.deepcopy(self._consumed)

    def load_state_dict(self, state, num_workers=None):
        """The next iteration (with `num_workers` DataLoader workers; None: as many as `state` was
        written with) continues after what `state` says was consumed, also when the number of
        shards (ranks x workers) changed: then `state` must be merge_states() of every rank's."""
        state = {**empty_state(state["epoch"]), **copy.deepcopy(state)}
        if any("size" not in pos.get("pool", {}) for pos in state["positions"].values()):
            raise CorpusError("the checkpoint's data cursor was written by an older data_stream.py (another sample "
                              "order): resume it with that version, or start the epoch again (--resume none)")
        num_shards = state["num_shards"] if num_workers is None else self.world_size * max(num_workers, 1)
        if state["num_shards"] and state["num_shards"] != num_shards:
            self.epoch = state["epoch"]  # the old shards' blocks are built again, in their epoch
            state = reshard_state(state, num_shards, self.corpus.doc_bytes(), self.settings.seed,
                                  self.settings.shuffle, self.num_open, self.settings.shuffle_block,
                                  self._pool_samples)
        self.epoch, self.resume = state["epoch"], state
        self._consumed = copy.deepcopy(state) if state["num_shards"] else None

    # --- documents: token ids, from the cache or tokenized now (worker process)
    def document(self, doc_id):
        """(ids, sentence bounds) of a document (document_tokens)."""
        return document_tokens(self.corpus, self.tokenizer, self.cache, doc_id)

    def segment_lengths(self, doc_id):
        """Token counts of a document's sentences, empty ones dropped: what pairs are planned on."""
        lengths = np.diff(self.document(doc_id)[1])
        return lengths[lengths > 0]

    def flush_cache(self):
        if self.cache is not None:
            self.cache.flush()

    def pair_plans(self, seg_lens, doc_id, epoch):
        """The nsp samples of a document in an epoch (plan_pairs); estimate_steps.py counts these."""
        s = self.settings
        return plan_pairs(seg_lens.tolist(), s.max_seq_len - 3, s.short_seq_prob, doc_id, self.num_docs,
                          doc_rng(s.seed, epoch, doc_id, 0))

    # --- units: what a draw from an open document takes (nsp: a sample; mlm: tokens of its stream)
    def _units(self, doc_id):
        """nsp: the document's planned pairs (built when drawn); mlm: its tokens and a [SEP], with
        per-token masking draws."""
        ids, bounds = self.document(doc_id)
        if self.settings.objective == "mlm":
            ids = np.concatenate([ids, [self.sep_id]]).astype(np.int64)
            draws = doc_rng(self.settings.seed, self.epoch, doc_id, 4).random((3, len(ids)), dtype=np.float32)
            return ids, draws, doc_id
        lengths = np.diff(bounds)
        starts, lengths = bounds[:-1][lengths > 0], lengths[lengths > 0]
        return doc_id, ids, starts, starts + lengths, self.pair_plans(lengths, doc_id, self.epoch)

    def _nsp_sample(self, units, k):
        """Sample k of a document, from its units (pair_sample)."""
        return pair_sample(units, k, self.settings.seed, self.epoch, self._random_b, self.cls_id, self.sep_id,
                           self.settings.max_seq_len - 3)  # room for [CLS] A [SEP] B [SEP]

    def _pool_samples(self, shard, num_shards, shard_docs, pool, partial, specs=False):
        """(sample, its spec) of each sample the pool of a shard gives from its cursor `pool` on
        (updated in place). A sample is (ids, draws, doc ids, type_start, nsp label); its spec the
        [doc_id, from, to] units it is made of, to rebuild it alone (_from_spec), if `specs` (a
        resize needs them; reading does not, and fewer objects kept alive in a block keep Python's
        garbage collector from costing a third of the data rate)."""
        draw = shard_draws(self.settings.seed, self.epoch, shard, num_shards)
        if self.settings.objective == "nsp":
            return draw_units(shard_docs, pool, draw, self._units,
                              lambda units, k: ((self._nsp_sample(units, k), [[units[0], k, k + 1]] if specs else None),
                                                k + 1),
                              lambda units: len(units[4]), 1, partial, self._guess)
        return packed_windows(shard_docs, pool, draw, self._units, partial, self._guess, self.settings.max_seq_len - 2,
                              self.cls_id, self.sep_id, specs)

    def _guess(self, doc_id):
        """The draws of a document not read yet, from its characters in the index (~4 a token); the
        pool's weight until its first draw reads it."""
        return 1 + int(self.corpus.index["chars"][doc_id]) // (4 * (self.settings.max_seq_len - 2))

    def _from_spec(self, spec, opened):
        """The sample a spec describes (a resize's leftover); opened: doc_id -> units, filled here."""
        for doc_id, _, _ in spec:
            if doc_id not in opened:
                opened[doc_id] = self._units(doc_id)
        if self.settings.objective == "nsp":
            return self._nsp_sample(opened[spec[0][0]], spec[0][1])
        parts = [(opened[d][0][a:b], opened[d][1][:, a:b], d) for d, a, b in spec]
        return packed_window(parts, self.cls_id, self.sep_id)

    def __iter__(self):
        for batch, _ in self.batches():
            yield batch

    def batches(self):
        """(batch, the documents each of its samples came from): what __iter__ yields, plus the
        documents, for measuring how well batches mix (bench/stream_bench.py)."""
        info = get_worker_info()
        num_workers, worker_id = (info.num_workers, info.id) if info else (1, 0)
        num_shards = self.world_size * num_workers
        resume = self.resume or empty_state(self.epoch)
        if resume["num_shards"] not in (None, num_shards):
            raise RuntimeError(f"the stream was resumed for {resume['num_shards']} shards but is read as "
                               f"{num_shards}: pass the DataLoader's num_workers to load_state_dict")
        exclude = np.array(resume["exclude"], np.int64) if resume["exclude"] else None
        shard = worker_shard(self.rank, num_workers, worker_id, resume["last_shard"])
        s = self.settings
        shard_docs = shard_documents(self.corpus.doc_bytes(), s.seed, self.epoch, num_shards, s.shuffle, exclude)[shard]
        position = dict(resume["positions"].get(str(shard))
                        or fresh_position(self.num_open, len(shard_docs), s.shuffle_block))
        if self.cache is not None:
            self.cache.refresh(self.num_docs)
        samples = shard_samples(position, resume["leftover"][shard::num_shards], self._from_spec,
                                lambda pool: self._pool_samples(shard, num_shards, shard_docs, pool, resume["partial"]),
                                s.seed, self.epoch, shard, num_shards, s.shuffle)
        batch = []
        try:
            for sample in samples:
                batch.append(sample)
                if len(batch) == s.batch_size:
                    yield self._cursor_batch(batch, shard, position, num_shards)
                    batch = []
            if batch:
                yield self._cursor_batch(batch, shard, position, num_shards)
        except GeneratorExit:  # a loop left early: keep what was tokenized
            try:
                self.flush_cache()
            except Exception:  # the generator collected at interpreter exit, numpy gone: only a cache is lost
                pass
            raise
        self.flush_cache()

    def _cursor_batch(self, samples, shard, position, num_shards):
        """A batch of tensors (masked now: new masks every epoch) with the cursor after its last sample."""
        cursor = (shard, dict(position), num_shards)  # position["pool"] is replaced, never changed
        nsp = self.settings.objective == "nsp"
        return collate(samples, cursor, self.pad_id, self.settings.max_seq_len, self._mask, nsp,
                       nsp and self.settings.pack_pairs), [s[2] for s in samples]

    def _mask(self, ids, draws):
        return mask_batch(ids, draws, self.special_table, self.continuation_table, self.mask_id, self.random_ids,
                          self.settings.mask_prob, self.settings.whole_word_mask)


# ============================================================================= 7. CLI

# The oldest versions verified to work (bench/compat.sh, BENCHMARKS.md section 13), as requirements.txt states;
# transformers 5.17 itself requires tokenizers >= 0.23.1
MIN_VERSIONS = {"torch": (2, 11), "transformers": (5, 17), "tokenizers": (0, 23), "numpy": (1, 26)}


def check_versions(prog):
    """Exit with one line if an installed library is older than the oldest verified one (checked
    from the installed metadata, before an old API fails somewhere deep in a run)."""
    from importlib.metadata import PackageNotFoundError, version
    for name, floor in MIN_VERSIONS.items():
        try:
            found = version(name)
        except PackageNotFoundError:
            continue  # its import fails with its own message
        if tuple(int(x) for x in re.findall(r"\d+", found)[:2]) < floor:
            needed = ".".join(map(str, floor))
            sys.exit(f"{prog}: error: {name} {found} is installed, this needs {name} >= {needed}: "
                     f"pip install '{name}>={needed}'")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the flag (not the usage block of every flag above it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def number(kind, low=None, high=None, low_open=False, high_open=False):
    """An argparse type: a number of `kind` (int or float) in the range given (None: unbounded on
    that side; *_open: the bound itself excluded). Every numeric flag of the three scripts uses one,
    so a value out of range fails at parse time, on every rank alike, in one line."""
    if low is not None and high is not None:
        allowed = f"{low} {'<' if low_open else '<='} x {'<' if high_open else '<='} {high}"
    elif low is not None:
        allowed = f"x {'>' if low_open else '>='} {low}"
    else:
        allowed = f"x {'<' if high_open else '<='} {high}"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value != value or (low is not None and (value <= low if low_open else value < low)) or \
                (high is not None and (value >= high if high_open else value > high)):
            raise argparse.ArgumentTypeError(f"{text} is out of range (allowed: {allowed})")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


def add_data_args(parser):
    """The corpus/tokenizer/sample flags, shared by every script of the project."""
    group = parser.add_argument_group("data")
    group.add_argument("--corpus", default="builtin",
                       help="'builtin' (prose shipped with Python), a file, a directory, a glob, or a comma list. "
                            "Text (.txt, .txt.gz): one sentence per line, a blank line between documents; "
                            ".jsonl(.gz), .parquet, or a datasets save_to_disk folder: one record per document")
    group.add_argument("--text-field", default="text", help="the field/column that holds a record's text")
    group.add_argument("--tokenizer", default=None,
                       help="a local Hugging Face tokenizer folder; default: train a WordPiece on the corpus "
                            f"(cached under {CACHE_DIR})")
    group.add_argument("--vocab-size", type=number(int, 2 * len(SPECIAL_TOKENS)), default=8192,
                       help="vocabulary of a trained tokenizer")
    group.add_argument("--tokenizer-sample-mb", type=number(float, 0, low_open=True), default=TOKENIZER_SAMPLE_MB,
                       help="a trained tokenizer sees at most this much text, spread evenly over the corpus")
    group.add_argument("--objective", default="nsp", choices=["nsp", "mlm", "electra"],
                       help="nsp: original BERT sentence pairs + next-sentence labels; mlm: packed, RoBERTa-style; "
                            "electra: mlm's samples, a small generator fills the masks, the model learns which "
                            "tokens were replaced (Clark et al. 2020)")
    group.add_argument("--max-seq-len", type=number(int, 3), default=128,
                       help="tokens per sample, [CLS]/[SEP] included (nsp: at least 5)")
    group.add_argument("--short-seq-prob", type=number(float, 0, 1), default=0.1,
                       help="probability that a document's samples aim at a shorter random length (BERT: 0.1)")
    group.add_argument("--mask-prob", type=number(float, 0, 1, low_open=True), default=0.15,
                       help="fraction of tokens masked for MLM")
    group.add_argument("--whole-word-mask", action="store_true",
                       help="mask all WordPiece pieces of a chosen word together (BERT's whole-word masking)")
    group.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                       help="nsp: sentence pairs share rows of --max-seq-len (first-fit decreasing), each attending "
                            "only to itself, with its own positions: the same math with far less padding (at 512 "
                            "tokens 68%% of a row was padding); --no-packing gives each pair a padded row")
    group.add_argument("--shuffle-docs", type=number(int, 1), default=SHUFFLE_DOCS,
                       help="documents each DataLoader worker keeps open and draws samples from (the shuffle); "
                            "worker memory is at most about this x --max-doc-bytes x 5")
    group.add_argument("--shuffle-block", type=number(int, 1), default=SHUFFLE_BLOCK,
                       help="samples each DataLoader worker shuffles together: it takes them from its open "
                            "documents in blocks of this many and reads each block in a random order (memory: "
                            "two blocks, ~40 MB at --max-seq-len 128)")
    group.add_argument("--max-doc-bytes", type=number(int, 1024), default=MAX_DOC_BYTES,
                       help="longer documents (books) are read as parts of about this size (characters for "
                            "jsonl/parquet/arrow records), each its own document")
    group.add_argument("--token-cache", default="auto",
                       help=f"where token ids are cached after the first read: 'auto' ({CACHE_DIR}/tokens), "
                            "a directory, or 'none'")
    group.add_argument("--language", default="en",
                       help="language of the sentence splitter (nsp on jsonl/parquet/arrow records), an ISO 639 "
                            "code such as en, de, zh")
    group.add_argument("--seed", type=number(int, 0), default=0, help="seeds document order, pairs and masking")
    return group


def settings_from_args(args, seed=None, shuffle=True):
    """The StreamSettings the data flags describe (seed: another than --seed, e.g. the eval set's)."""
    return StreamSettings(  # electra reads mlm's samples
        objective="nsp" if args.objective == "nsp" else "mlm", max_seq_len=args.max_seq_len,
        batch_size=args.batch_size, mask_prob=args.mask_prob,
        whole_word_mask=args.whole_word_mask, short_seq_prob=args.short_seq_prob, pack_pairs=args.packing,
        seed=args.seed if seed is None else seed, shuffle=shuffle, shuffle_docs=args.shuffle_docs,
        shuffle_block=args.shuffle_block, text_field=args.text_field, max_doc_bytes=args.max_doc_bytes,
        language=args.language, vocab_size=args.vocab_size, token_cache=args.token_cache)


def stream_from_args(args, corpus=None, split="train", tokenizer=None, seed=None, shuffle=True, rank=None,
                     world_size=None):
    """The stream that the data flags describe (every script builds it the same way)."""
    if tokenizer is None and args.tokenizer:  # a wrong folder fails before any corpus work
        tokenizer = get_tokenizer(args.tokenizer)
    corpus = open_corpus(corpus or args.corpus, split, args.objective, args.text_field, args.max_doc_bytes,
                         args.language)
    if tokenizer is None:
        tokenizer = get_tokenizer(args.tokenizer, corpus, args.vocab_size, args.tokenizer_sample_mb)
    return BertPretrainStream(corpus, tokenizer, settings_from_args(args, seed, shuffle), split, rank, world_size)


def build_cache(stream):
    """Tokenize every document not yet cached, in batches on all cores (the parent never forks)."""
    if stream.cache is None:
        raise CorpusError("--build-cache needs a token cache: drop --token-cache none")
    stream.cache.refresh(stream.num_docs)
    todo = np.flatnonzero(stream.cache.where[:, 0] < 0)
    t0 = time.perf_counter()
    tokens = 0
    batch_docs = 512
    for k in range(0, len(todo), batch_docs):
        docs = todo[k:k + batch_docs]
        lines = [stream.corpus.read(int(d)) for d in docs]
        ids, bounds = tokenize_lines(stream.tokenizer, [s for doc in lines for s in doc])
        first = 0
        for d, doc in zip(docs, lines, strict=True):
            b = bounds[first:first + len(doc) + 1]
            stream.cache.add(int(d), ids[b[0]:b[-1]], b - b[0])
            first += len(doc)
        tokens += len(ids)
    stream.flush_cache()
    if not stream.cache.writable:
        raise CorpusError(f"--build-cache: nothing could be written to {stream.cache.dir}")
    seconds = time.perf_counter() - t0
    print(f"token cache: {len(todo):,} documents tokenized ({stream.num_docs - len(todo):,} were cached), "
          f"{tokens:,} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} tokens/s) -> {stream.cache.dir}")


def show(stream, count):
    shown = 0
    for batch in stream:
        rows = torch.arange(len(batch["input_ids"]))[:, None]
        sequence = batch.get("sequence_ids", torch.where(batch["attention_mask"].bool(), rows, -1))
        nsp = batch.get("next_sentence_label")
        for i in range(int(sequence.max()) + 1):  # the samples, packed several a row or one a row
            if shown == count:
                return
            ids, labels = batch["input_ids"][sequence == i], batch["labels"][sequence == i]
            masked = labels[labels != -100]
            print(f"--- sample {shown}: {len(ids)} tokens, {len(masked)} masked"
                  + (f", B is {'random' if nsp[i] else 'the continuation'}" if nsp is not None else ""))
            print(stream.tokenizer.decode(ids.tolist()))
            print("  targets:", stream.tokenizer.decode(masked.tolist()))
            shown += 1


def main(argv=None):
    parser = Parser(prog="data_stream.py",
                    description="Stream BERT pretraining samples: show some, or fill the token cache "
                                "ahead of training (one worker's rate: bench/stream_bench.py).",
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_data_args(parser)
    parser.add_argument("--batch-size", type=number(int, 1), default=32, help="samples per batch")
    parser.add_argument("--show", type=number(int, 0), default=0, metavar="N",
                        help="print N decoded samples ([MASK] visible)")
    parser.add_argument("--build-cache", action="store_true", help="tokenize the whole corpus into the token cache now")
    args = parser.parse_args(argv)
    check_versions("data_stream.py")
    try:
        stream = stream_from_args(args, rank=0, world_size=1)
        print(f"corpus: {len(stream.corpus.files)} file(s), {stream.num_docs:,} documents; vocab {stream.vocab_size}")
        if args.build_cache:
            build_cache(stream)
        if args.show:
            show(stream, args.show)
    except CorpusError as e:
        sys.exit(f"data_stream.py: error: {e}")


if __name__ == "__main__":
    main()
