"""
One DataLoader worker's rate: the stream next to the bare tokenizer on about the same text (BENCHMARKS.md sections
4, 7 and 10; bench/data_scale.py runs it on generated corpora and books).

    python bench/stream_bench.py --seconds 8                        # builtin corpus, nsp
    python bench/stream_bench.py --seconds 8 --objective mlm
    python bench/stream_bench.py --corpus wiki/ --objective mlm     # any corpus data_stream.py reads

Prints time to the first batch, samples/s and tokens/s, how many distinct documents a full batch
mixes, and the bare tokenizer's encode_batch on one thread (--json: also as one JSON line). Takes
every data flag of data_stream.py. Imports nothing of bench/: bench/data_ab.py runs a copy of it beside
an older commit's data_stream.py.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data_stream  # noqa: E402


def bench(stream, seconds):
    """One worker: time to the first batch, samples/s and tokens/s, distinct documents per batch,
    next to the bare tokenizer on about the same amount of text."""
    t0, samples, tokens, epoch, first, distinct, full = time.perf_counter(), 0, 0, 0, None, 0, 0
    while time.perf_counter() - t0 < seconds:  # whole epochs until the time budget is spent
        stream.set_epoch(epoch)
        for batch, docs in stream.batches():
            first = first or time.perf_counter() - t0
            samples += len(docs)  # a sample's documents each (packed nsp pairs share rows)
            tokens += int(batch["attention_mask"].sum())
            if len(docs) == stream.settings.batch_size:
                distinct, full = distinct + len({d for ds in docs for d in ds}), full + 1
            if time.perf_counter() - t0 > seconds:
                break
        epoch += 1
    stream_s = time.perf_counter() - t0
    lines, chars, docs, t0 = [], 0, 0, time.perf_counter()
    for doc_id in range(stream.num_docs):
        doc_lines = stream.corpus.read(doc_id)
        lines += doc_lines
        chars, docs = chars + sum(map(len, doc_lines)), docs + 1
        if chars > 4 * tokens:  # ~4 characters per token: about the same amount of text
            break
    t1 = time.perf_counter()
    encoded = stream.tokenizer.backend_tokenizer.encode_batch(lines, add_special_tokens=False)
    bare_tokens = sum(len(e.ids) for e in encoded)
    tok_s = time.perf_counter() - t1
    print(f"stream: {samples / stream_s:,.0f} samples/s, {tokens / stream_s:,.0f} tokens/s (one worker, "
          f"{stream_s:.1f} s, {epoch} epoch(s)); first batch after {first or 0:.2f} s; "
          f"{distinct / max(full, 1):.1f} distinct documents per batch of {stream.settings.batch_size}")
    print(f"bare tokenizer encode_batch, one thread: {bare_tokens / tok_s:,.0f} tokens/s on {docs} documents "
          f"(read {t1 - t0:.2f} s)")
    return {"samples_per_s": samples / stream_s, "tokens_per_s": tokens / stream_s, "first_batch_s": first or 0.0,
            "distinct_documents": distinct / max(full, 1), "tokenizer_tokens_per_s": bare_tokens / tok_s}


def main(argv=None):
    parser = data_stream.Parser(prog="stream_bench.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data_stream.add_data_args(parser)
    parser.add_argument("--batch-size", type=data_stream.number(int, 1), default=32, help="samples per batch")
    parser.add_argument("--seconds", type=data_stream.number(float, 0, low_open=True), default=20.0,
                        help="time budget: whole epochs until it is spent")
    parser.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    args = parser.parse_args(argv)
    data_stream.check_versions("stream_bench.py")
    # one worker's rate is one core's: a DataLoader worker tokenizes on one thread
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        stream = data_stream.stream_from_args(args, rank=0, world_size=1)
        print(f"corpus: {len(stream.corpus.files)} file(s), {stream.num_docs:,} documents; vocab {stream.vocab_size}")
        numbers = bench(stream, args.seconds)
        if args.json:
            print(json.dumps(numbers))
    except data_stream.CorpusError as e:
        sys.exit(f"stream_bench.py: error: {e}")


if __name__ == "__main__":
    main()
