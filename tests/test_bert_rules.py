"""BERT's data rules, checked against their definitions rather than against our own code:

1. NSP pairs follow google-research/bert create_pretraining_data.py (transcribed below), lengths
   included: compared statistically on the same documents; and the stream's samples are the pairs
   that comparison was made on.
2. A stream's batches mix many documents (--shuffle-docs, --shuffle-block), and reading one document at a time
   does not.
3. Whole-word masking masks every piece of a chosen word, and only whole words.
"""
import random

import numpy as np
import pytest
import torch
from conftest import WORDS, make_stream, write_corpus

import data_stream as ds

# ------------------------------------------------------------------ 1. Google's reference, lengths included
# Transcribed from google-research/bert create_pretraining_data.py (commit eedf5716, 2020-03-11):
# create_instances_from_document without the masking (TrainingInstance -> (tokens_a, tokens_b,
# is_random_next)), and truncate_seq_pair. Tokens are ints; `rng` is a random.Random, as there.


def google_truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng):
    """Truncates a pair of sequences to a maximum sequence length."""
    while True:
        total_length = len(tokens_a) + len(tokens_b)
        if total_length <= max_num_tokens:
            break

        trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        assert len(trunc_tokens) >= 1

        # We want to sometimes truncate from the front and sometimes from the
        # back to add more randomness and avoid biases.
        if rng.random() < 0.5:
            del trunc_tokens[0]
        else:
            trunc_tokens.pop()


def google_create_instances_from_document(all_documents, document_index, max_seq_length, short_seq_prob, rng):
    """Creates `TrainingInstance`s for a single document (here: (tokens_a, tokens_b, is_random_next))."""
    document = all_documents[document_index]

    # Account for [CLS], [SEP], [SEP]
    max_num_tokens = max_seq_length - 3

    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)

    instances = []
    current_chunk = []
    current_length = 0
    i = 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                # `a_end` is how many segments from `current_chunk` go into the `A`
                # (first) sentence.
                a_end = 1
                if len(current_chunk) >= 2:
                    a_end = rng.randint(1, len(current_chunk) - 1)

                tokens_a = []
                for j in range(a_end):
                    tokens_a.extend(current_chunk[j])

                tokens_b = []
                # Random next
                is_random_next = False
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)

                    # This should rarely go for more than one iteration for large
                    # corpora. However, just to be careful, we try to make sure that
                    # the random document is not the same as the document
                    # we're processing.
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break

                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    # We didn't actually use these segments so we "put them back" so
                    # they don't go to waste.
                    num_unused_segments = len(current_chunk) - a_end
                    i -= num_unused_segments
                # Actual next
                else:
                    is_random_next = False
                    for j in range(a_end, len(current_chunk)):
                        tokens_b.extend(current_chunk[j])
                google_truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)

                assert len(tokens_a) >= 1
                assert len(tokens_b) >= 1

                instances.append((tokens_a, tokens_b, is_random_next))
            current_chunk = []
            current_length = 0
        i += 1

    return instances


def synthetic_documents(num_docs, seed):
    """(ids, sentence bounds) per document: 1..40 sentences of 1..60 tokens; every token id unique."""
    gen = np.random.default_rng(seed)
    docs, next_id = [], 0
    for _ in range(num_docs):
        lengths = gen.integers(1, 61, gen.integers(1, 41))
        docs.append((np.arange(next_id, next_id + lengths.sum()), np.concatenate([[0], np.cumsum(lengths)])))
        next_id += int(lengths.sum())
    return docs


def our_pairs(docs, max_num_tokens, short_seq_prob, seed):
    """What BertPretrainStream._units does for nsp (epoch 0), on in-memory documents: per document,
    its (A, B, A truncated, B truncated, is random next) in order. The plans' RNG is the one
    estimate_steps.py counts with (pair_plans); truncation goes on with it, as the stream does."""
    out = []
    for doc_id, (ids, bounds) in enumerate(docs):
        out.append([])
        seg_lens = np.diff(bounds).tolist()
        rng = ds.doc_rng(seed, 0, doc_id, 0)
        plans = ds.plan_pairs(seg_lens, max_num_tokens, short_seq_prob, doc_id, len(docs), rng)
        # Google's structure: chunks cover the document in order, random-next ones put B's sentences back
        assert plans[0][0] == 0 and plans[-1][2] == len(seg_lens)
        assert all(p[0] == q[2] for q, p in zip(plans, plans[1:], strict=False))
        assert len({p[5] for p in plans}) == 1 and 2 <= plans[0][5] <= max_num_tokens  # one target per document
        for a_start, a_end, b_end, random_doc, frac, target_len in plans:
            assert a_start < a_end
            a = ids[bounds[a_start]:bounds[a_end]]
            if random_doc >= 0:
                assert b_end == a_end and random_doc != doc_id and 0 <= random_doc < len(docs) and 0 <= frac < 1
                b = ds.random_segment(*docs[random_doc], frac, target_len - len(a))
            else:
                assert b_end > a_end
                b = ids[bounds[a_end]:bounds[b_end]]
            ta, tb = ds.truncate_pair(a, b, max_num_tokens, rng)
            assert len(ta) >= 1 and len(tb) >= 1 and len(ta) + len(tb) <= max_num_tokens
            out[-1].append((a, b, ta, tb, random_doc >= 0))
    return out


def google_pairs(docs, max_seq_length, short_seq_prob, seed):
    all_documents = [[ids[bounds[k]:bounds[k + 1]].tolist() for k in range(len(bounds) - 1)] for ids, bounds in docs]
    rng = random.Random(seed)
    return [(len(a), len(b), r) for d in range(len(all_documents))
            for a, b, r in google_create_instances_from_document(all_documents, d, max_seq_length, short_seq_prob, rng)]


def pair_statistics(pairs, num_docs):
    x = np.array(pairs, dtype=np.float64)
    total, rnd = x[:, 0] + x[:, 1], x[:, 2] > 0
    return {"instances per document": len(x) / num_docs,
            "share random next": rnd.mean(),
            "mean length, random next": total[rnd].mean(),
            "mean length, actual next": total[~rnd].mean(),
            "share shorter than 64": (total < 64).mean(),
            "mean len(B), random next": x[rnd, 1].mean(),
            "mean len(A), actual next": x[~rnd, 0].mean()}


@pytest.mark.slow  # subprocesses, or seconds of work
def test_nsp_pairs_match_google_statistically():
    """8000 documents (max_seq_len 128, short_seq_prob 0.1), our pipeline vs Google's code.
    Noise, ours vs Google over 60 (document set, seed) draws, sd / largest: instances per document
    0.56% / 1.35%, mean length random next 0.54% / 2.1%, actual next 0.23% / 0.57%, len(B) random
    next 0.71% / 2.4%, len(A) actual next 0.50% / 1.3%; share random next 0.36 / 0.81 pt, share
    shorter than 64 0.38 / 1.46 pt (the tail: a document drawn short with a tiny target gives many
    pairs). Mean differences all ~0. Filling a random B to max_num_tokens - len(A) instead of
    target_len - len(A) moves the random-next length by +7%, its len(B) by +13% and the share of
    short pairs by -2.8 pt. With 2000 documents the noise is twice as large: too close to that."""
    num_docs, max_seq_length, short_seq_prob, seed = 8000, 128, 0.1, 11
    docs = synthetic_documents(num_docs, seed)
    pairs = [pair for doc in our_pairs(docs, max_seq_length - 3, short_seq_prob, seed) for pair in doc]
    assert all((np.diff(a) == 1).all() and (np.diff(b) == 1).all() for _, _, a, b, _ in pairs)  # one run each
    ours = pair_statistics([(len(a), len(b), r) for _, _, a, b, r in pairs], num_docs)
    google = pair_statistics(google_pairs(docs, max_seq_length, short_seq_prob, seed), num_docs)
    report = "\n".join(f"{k}: ours {ours[k]:.4f}, Google {google[k]:.4f}" for k in ours)
    relative = {"instances per document": 0.025, "mean length, random next": 0.03,
                "mean length, actual next": 0.02, "mean len(B), random next": 0.04, "mean len(A), actual next": 0.03}
    absolute = {"share random next": 0.02, "share shorter than 64": 0.02}
    for key, tol in relative.items():
        assert abs(ours[key] / google[key] - 1) < tol, f"{key}\n{report}"
    for key, tol in absolute.items():
        assert abs(ours[key] - google[key]) < tol, f"{key}\n{report}"
    assert 0.04 < google["share shorter than 64"] < 0.15 and 0.5 < google["share random next"] < 0.65  # the setup


def is_run_of(part, whole):
    """`part` is `whole` with some tokens cut from its front and back."""
    return len(part) <= len(whole) and any(
        np.array_equal(part, whole[k:k + len(part)]) for k in range(len(whole) - len(part) + 1))


def test_stream_nsp_samples_are_the_planned_pairs(corpus, tokenizer):
    """The stream builds its samples as our_pairs does (the pipeline compared with Google above):
    per document and in order (--shuffle-block 1: a shuffled block gives them in any order), the same plans (the
    ones estimate_steps.py counts), the same A and B before truncation (a random B filled to
    target_len - len(A)), the same lengths after it. Where truncation cuts (front or back) is the
    RNG's business: only checked to be a cut."""
    seed, max_seq_len, short_seq_prob = 5, 64, 0.3
    stream = make_stream(corpus, tokenizer, batch_size=16, max_seq_len=max_seq_len, mask_prob=0.0,
                         short_seq_prob=short_seq_prob, seed=seed, shuffle_block=1)
    docs = [stream.document(d) for d in range(stream.num_docs)]
    assert all((np.diff(bounds) > 0).all() for _, bounds in docs)  # no empty sentence: plans see every one
    expected = our_pairs(docs, max_seq_len - 3, short_seq_prob, seed)
    got = [[] for _ in docs]
    for b, sample_docs in stream.batches():
        for row, (doc_id,) in enumerate(sample_docs):
            ids = b["input_ids"][row][b["attention_mask"][row].bool()].numpy()
            type_start = int(b["token_type_ids"][row].argmax())
            got[doc_id].append((ids[1:type_start - 1], ids[type_start:-1], bool(b["next_sentence_label"][row])))
    assert [len(g) for g in got] == [len(e) for e in expected]
    assert sum(r for doc in got for _, _, r in doc) > 100  # many random B
    assert sum(len(a) + len(b) > max_seq_len - 3 for doc in expected for a, b, *_ in doc) > 50  # many truncated
    for doc_id, (g, e) in enumerate(zip(got, expected, strict=True)):
        for k, ((ga, gb, gr), (a, b, ta, tb, r)) in enumerate(zip(g, e, strict=True)):
            assert gr == r and (len(ga), len(gb)) == (len(ta), len(tb)), (doc_id, k)
            assert is_run_of(ga, a) and is_run_of(gb, b), (doc_id, k)


# ------------------------------------------------------------------ 2. batches mix documents


def mixing(stream):
    """(mean distinct documents per full batch, samples per document) of one epoch."""
    per_batch, samples = [], 0
    for _, docs in stream.batches():
        samples += len(docs)
        if len(docs) == stream.settings.batch_size:
            per_batch.append(len(set().union(*map(set, docs))))
    return float(np.mean(per_batch)), samples / stream.num_docs


@pytest.mark.slow  # subprocesses, or seconds of work
def test_shuffle_docs_mixes_documents_in_a_batch(tmp_path, tokenizer):
    """3000 documents of 10..40 sentences: ~5 nsp samples each at max_seq_len 128. A batch of 32
    drawn from 256 open documents holds ~30 of them; read one document at a time and unshuffled
    (--shuffle-docs 1 --shuffle-block 1), ~32 / 5 + 1."""
    path = write_corpus(tmp_path / "mix.txt", 3000, seed=1, min_sents=10, max_sents=40)
    # One Corpus for both objectives: a text file reads the same for either, and so the token
    # cache built here serves both (a path would be keyed per objective and tokenized twice).
    corpus = ds.open_corpus(path, objective="nsp")
    kw = dict(batch_size=32, max_seq_len=128, seed=3)
    ds.build_cache(make_stream(corpus, tokenizer, **kw))
    for objective in ("nsp", "mlm"):
        mixed, per_doc = mixing(make_stream(corpus, tokenizer, objective=objective, **kw))
        in_order, per_doc_1 = mixing(make_stream(corpus, tokenizer, objective=objective, shuffle_docs=1,
                                                 shuffle_block=1, **kw))
        assert per_doc == per_doc_1  # the same samples, only their order differs
        if objective == "nsp":
            assert 4.5 < per_doc < 5.5, per_doc
        assert mixed >= 28, (objective, mixed)
        # in order: a batch spans batch_size / (samples per document) documents, plus the one cut at its edge
        assert in_order <= 32 / per_doc + 2, (objective, in_order, per_doc)
        assert in_order < mixed / 2, (objective, in_order, mixed)


# ------------------------------------------------------------------ 3. whole-word masking


def compound_corpus(path, num_docs, seed=0):
    """Sentences of the tokenizer's words, a third of them glued in pairs ('riverstone'): words the
    vocabulary splits into several pieces ('river', '##st', '##one')."""
    rng = random.Random(seed)

    def word():
        return rng.choice(WORDS) + rng.choice(WORDS) if rng.random() < 1 / 3 else rng.choice(WORDS)

    docs = ["\n".join(" ".join(word() for _ in range(rng.randint(3, 20))) + " ." for _ in range(rng.randint(2, 20)))
            for _ in range(num_docs)]
    path.write_text("\n\n".join(docs) + "\n")
    return str(path)


def word_spans(ids, continuation, special):
    """Start index of every word of a batch, flattened row by row. A word is a piece that does not
    start with '##' and the '##' pieces after it; a special token is a word of its own, and a '##'
    piece right after one ([CLS]/[SEP], or a cut from the front) starts a word."""
    is_special, is_cont = special[ids], continuation[ids]
    starts = ~is_cont | is_special
    starts[:, 1:] |= is_special[:, :-1]
    starts[:, 0] = True
    return np.flatnonzero(starts.ravel())


def masking_counts(corpus, tokenizer, whole_word, objective):
    kw = dict(objective=objective, batch_size=64, max_seq_len=64, seed=7, whole_word_mask=whole_word)
    masked = make_stream(corpus, tokenizer, mask_prob=0.15, **kw)
    plain = make_stream(corpus, tokenizer, mask_prob=0.0, **kw)  # same samples, nothing masked
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    continuation = np.array([t.startswith("##") for t in tokens])
    special = np.zeros(len(tokenizer), bool)
    special[tokenizer.all_special_ids] = True
    n = dict(candidates=0, chosen=0, mask=0, same=0, multi_words=0, multi_chosen=0, split_words=0)
    for b, p in zip(masked, plain, strict=True):
        ids = p["input_ids"].numpy()
        assert torch.equal(b["attention_mask"], p["attention_mask"]) and (p["labels"] == -100).all()
        chosen = (b["labels"] != -100).numpy()
        assert not (chosen & special[ids]).any()
        assert np.array_equal(b["labels"].numpy()[chosen], ids[chosen])  # labels hold the original
        starts = word_spans(ids, continuation, special)
        flat = chosen.ravel().astype(np.int64)
        pieces = np.diff(np.append(starts, flat.size))
        chosen_pieces = np.add.reduceat(flat, starts)
        multi = pieces > 1
        n["split_words"] += int(((chosen_pieces > 0) & (chosen_pieces < pieces)).sum())
        n["multi_words"] += int(multi.sum())
        n["multi_chosen"] += int((multi & (chosen_pieces == pieces)).sum())
        n["candidates"] += int((~special[ids]).sum())
        n["chosen"] += int(chosen.sum())
        n["mask"] += int((b["input_ids"].numpy()[chosen] == tokenizer.mask_token_id).sum())
        n["same"] += int((b["input_ids"].numpy()[chosen] == ids[chosen]).sum())
    return n


@pytest.mark.parametrize("objective", ["mlm", "nsp"])
def test_whole_word_masking_takes_whole_words(tmp_path, tokenizer, objective):
    corpus = compound_corpus(tmp_path / "compounds.txt", 300)
    n = masking_counts(corpus, tokenizer, True, objective)
    assert n["multi_words"] > 5000, n  # the corpus has multi-piece words
    assert n["split_words"] == 0, n  # every word is masked whole or not at all
    assert n["multi_chosen"] > 500, n  # ... and many multi-piece words are masked whole
    assert n["chosen"] > 5000, n
    assert abs(n["chosen"] / n["candidates"] - 0.15) < 0.015, n
    assert abs(n["mask"] / n["chosen"] - 0.8) < 0.02, n  # 80% [MASK] per chosen piece
    assert abs(n["same"] / n["chosen"] - 0.1) < 0.02, n  # 10% kept (+ a few random hits on itself)
    # without whole-word masking the same samples do split words: this test would see it switched off
    per_piece = masking_counts(corpus, tokenizer, False, objective)
    assert per_piece["split_words"] > 0.1 * per_piece["multi_words"], per_piece
