"""The token cache: a warm pass reads ids, never text, and yields the batches of a cold one; damaged
pieces are found and rebuilt; a changed tokenizer or corpus never reads a stale cache; two processes
can fill one cache at once; the estimator counts from it."""
import glob
import hashlib
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from conftest import ROOT, loader, make_stream, same_batches, write_corpus

import data_stream as ds
import estimate_steps as es


def no_tokenizing(*_):
    raise AssertionError("tokenize_lines called: a document was not read from the token cache")


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of ~3000 tokens: a pass over the session corpus writes several of them."""
    monkeypatch.setattr(ds, "PIECE_TOKENS", 3000)


def pieces(cache):
    return sorted(glob.glob(os.path.join(cache.dir, "*.piece")))


def piece_header(path):
    """(header, offset of the token ids, size the file must have), by the documented layout: a JSON
    line, then int64 document ids, sentence-count offsets and token offsets, then the tokens."""
    with open(path, "rb") as f:
        header = json.loads(f.readline())
        start = f.tell()
    tokens_at = start + 8 * (2 * header["docs"] + 1 + header["sentences"] + 1)
    return header, tokens_at, tokens_at + np.dtype(header["dtype"]).itemsize * header["tokens"]


def piece_ok(path):
    """Checked here, not by TokenCache: complete and its checksum right."""
    header, _, size = piece_header(path)
    with open(path, "rb") as f:
        f.readline()
        payload = f.read()
    return os.path.getsize(path) == size and hashlib.blake2b(payload, digest_size=16).hexdigest() == header["checksum"]


def tokenized(stream):
    """Every document's (ids, bounds), tokenized now."""
    return [ds.tokenize_lines(stream.tokenizer, stream.corpus.read(d)) for d in range(stream.num_docs)]


def assert_cache_complete(stream, fresh):
    """Every piece on disk verifies, no temporary file is left, and the cache serves every document
    with the ids a fresh tokenization gives: without tokenizing and without dropping a piece."""
    paths = pieces(stream.cache)
    assert paths and all(piece_ok(p) for p in paths), [p for p in paths if not piece_ok(p)]
    assert not [p for p in os.listdir(stream.cache.dir) if ".tmp" in p]  # no write left half done
    stream.cache.refresh(stream.num_docs)  # document() consults only what the last refresh found
    assert (stream.cache.where[:, 0] >= 0).all()
    real, ds.tokenize_lines = ds.tokenize_lines, no_tokenizing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a piece dropped now would be a warning
            for d, (ids, bounds) in enumerate(fresh):
                got_ids, got_bounds = stream.document(d)
                assert np.array_equal(got_ids, ids) and np.array_equal(got_bounds, bounds), d
    finally:
        ds.tokenize_lines = real
    assert not stream.cache.pending


@pytest.mark.parametrize("objective,num_workers", [("nsp", 0), ("mlm", 0), ("nsp", 2)])
def test_a_warm_cache_reads_no_text_and_yields_the_batches_of_a_cold_one(corpus, tokenizer, tmp_path, monkeypatch,
                                                                         small_pieces, objective, num_workers):
    kw = dict(objective=objective, seed=3)

    def epoch_1(token_cache):
        stream = make_stream(corpus, tokenizer, token_cache=token_cache, **kw)
        stream.set_epoch(1)
        return stream, list(loader(stream, num_workers))

    _, plain = epoch_1("none")
    cold_stream, cold = epoch_1(str(tmp_path / "tc"))
    assert cold_stream.cache.dir.startswith(str(tmp_path / "tc"))
    written = pieces(cold_stream.cache)
    assert len(written) >= 3  # several pieces (and, with 2 workers, from two processes)
    same_batches(cold, plain)
    monkeypatch.setattr(ds, "tokenize_lines", no_tokenizing)  # forked workers inherit it
    warm_stream, warm = epoch_1(str(tmp_path / "tc"))
    same_batches(warm, cold)
    assert pieces(warm_stream.cache) == written  # nothing was tokenized, so nothing new was written
    monkeypatch.undo()
    assert_cache_complete(warm_stream, tokenized(warm_stream))


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_piece_is_detected_and_rebuilt(corpus, tokenizer, tmp_path, small_pieces, damage):
    cold_stream = make_stream(corpus, tokenizer, token_cache=str(tmp_path / "tc"))
    cold = list(cold_stream)
    fresh = tokenized(cold_stream)
    written = pieces(cold_stream.cache)
    assert len(written) >= 3
    victim = max(written, key=os.path.getsize)
    header, tokens_at, size = piece_header(victim)
    if damage == "truncate":
        os.truncate(victim, (tokens_at + size) // 2)
        why = "unreadable or truncated"
    else:
        with open(victim, "r+b") as f:  # the low bit of some token ids: still ids of the vocabulary
            for k in range(0, header["tokens"], max(1, header["tokens"] // 50)):
                f.seek(tokens_at + 2 * k)
                low = f.read(1)[0]
                f.seek(tokens_at + 2 * k)
                f.write(bytes([low ^ 1]))
        assert os.path.getsize(victim) == size and not piece_ok(victim)
        why = r"corrupt \(checksum\)"
    stream = make_stream(corpus, tokenizer, token_cache=str(tmp_path / "tc"))
    with pytest.warns(UserWarning, match=f"token cache: {victim} is {why}"):
        again = list(stream)
    same_batches(again, cold)  # never read as valid
    assert not os.path.exists(victim)
    assert set(pieces(stream.cache)) - set(written)  # its documents went into new pieces
    assert_cache_complete(stream, fresh)  # covers every document again


def test_other_tokenizer_never_reads_the_cache(corpus, tokenizer, tmp_path):
    other_tokenizer = ds.get_tokenizer(None, [write_corpus(tmp_path / "other.txt", 40, seed=7)], 300)
    assert other_tokenizer.get_vocab() != tokenizer.get_vocab()
    first = make_stream(corpus, tokenizer, token_cache=str(tmp_path / "tc"))
    list(first)
    assert pieces(first.cache)
    other = make_stream(corpus, other_tokenizer, token_cache=str(tmp_path / "tc"))
    assert other.cache.dir != first.cache.dir and not pieces(other.cache)
    same_batches(list(other), list(make_stream(corpus, other_tokenizer, token_cache="none")))


@pytest.mark.parametrize("change", ["rewrite", "touch", "rewrite-keeping-mtime"])
def test_changed_corpus_file_never_reads_the_cache(corpus, tokenizer, tmp_path, change):
    path = tmp_path / "corpus.txt"
    with open(corpus) as f:
        text = f.read()
    path.write_text(text)
    first = make_stream(str(path), tokenizer, token_cache=str(tmp_path / "tc"))
    cold = list(first)
    assert pieces(first.cache)
    before = os.stat(path).st_mtime_ns
    time.sleep(0.02)  # past the file system's timestamp granularity
    if change.startswith("rewrite"):  # other words, the same size and document layout: only the mtime tells
        swapped = text.replace("river", "\0").replace("stone", "river").replace("\0", "stone")
        assert swapped != text and len(swapped) == len(text)
        path.write_text(swapped)
    else:
        os.utime(path)
    if change == "rewrite-keeping-mtime":  # what cp -p, rsync -t and tar do: only the ctime tells
        os.utime(path, ns=(before, before))
    assert (os.stat(path).st_mtime_ns == before) == (change == "rewrite-keeping-mtime")
    stream = make_stream(str(path), tokenizer, token_cache=str(tmp_path / "tc"))
    assert stream.cache.dir != first.cache.dir and not pieces(stream.cache)
    batches = list(stream)
    same_batches(batches, list(make_stream(str(path), tokenizer, token_cache="none")))
    if change.startswith("rewrite"):
        with pytest.raises(AssertionError):
            same_batches(batches, cold)  # the new text really gives other batches


FILL = """
import os, sys, time
sys.path.insert(0, {root!r})
import data_stream as ds
ds.PIECE_TOKENS = 500
tok = ds.get_tokenizer({tok_dir!r})
open({ready!r}, "w").close()
while not os.path.exists({go!r}):
    time.sleep(0.005)
for seed, epoch in {passes!r}:
    settings = ds.StreamSettings(objective="nsp", batch_size=4, max_seq_len=32, seed=seed, token_cache={cache!r})
    stream = ds.BertPretrainStream({corpus!r}, tok, settings, rank=0, world_size=1)
    stream.set_epoch(epoch)
    for batch in stream:
        pass
"""


@pytest.mark.slow  # subprocesses, or seconds of work
def test_two_processes_fill_one_cache_at_once_without_damage(corpus, tokenizer, tok_dir, tmp_path, monkeypatch):
    cache, go = str(tmp_path / "tc"), str(tmp_path / "go")
    procs, ready = [], []
    # First the same documents in the same order (identical pieces at the same moments), then in
    # other orders while the other process may still be writing.
    for k, passes in enumerate(([(0, 0), (1, 1)], [(0, 0), (2, 1)])):
        ready.append(str(tmp_path / f"ready{k}"))
        script = FILL.format(root=ROOT, tok_dir=tok_dir, ready=ready[-1], go=go, passes=passes, corpus=corpus,
                             cache=cache)
        procs.append(subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    deadline = time.time() + 120
    while not all(os.path.exists(r) for r in ready) and time.time() < deadline:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    open(go, "w").close()  # both start at once
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "Traceback" not in err, err
        assert "token cache:" not in err, err  # no piece was found damaged, no write failed
    stream = make_stream(corpus, tokenizer, token_cache=cache)
    assert len(pieces(stream.cache)) >= 20  # both processes wrote many small pieces
    assert_cache_complete(stream, tokenized(stream))
    plain = list(make_stream(corpus, tokenizer, token_cache="none"))
    monkeypatch.setattr(ds, "tokenize_lines", no_tokenizing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same_batches(list(make_stream(corpus, tokenizer, token_cache=cache)), plain)


@pytest.mark.parametrize("objective", ["nsp", "mlm"])
def test_estimator_counts_from_the_warm_cache(corpus, tokenizer, tmp_path, monkeypatch, objective):
    kw = dict(world_size=2, num_workers=2, batch_size=4, accum_steps=2, epochs=2, mode="exact")

    def estimate(token_cache):
        r = es.estimate(make_stream(corpus, tokenizer, objective=objective, token_cache=token_cache), **kw)
        assert r["mode"] == "exact" and r["total_steps"] > 10
        return {k: v for k, v in r.items() if k != "seconds"}

    plain = estimate("none")
    assert estimate(str(tmp_path / "tc")) == plain  # cold: it tokenizes, and fills the cache
    monkeypatch.setattr(ds, "tokenize_lines", no_tokenizing)
    assert estimate(str(tmp_path / "tc")) == plain  # warm: ids only
