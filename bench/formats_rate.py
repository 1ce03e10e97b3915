"""
The same text as .txt, .jsonl and .parquet: stream tokens/s of one process, cold (no token cache:
every document read, split into sentences where nsp needs it, tokenized) and warm (token cache
full), next to the sentence splitter's and the bare tokenizer's rates on that text.

    python bench/formats_rate.py                 # 3,000 documents (bench/data_rate.py's corpus)
    python bench/formats_rate.py --docs 1000 --seconds 10

jsonl and parquet records hold a document's sentences joined by spaces (paragraphs, as such
corpora do), so nsp splits them again with sentencex; text is one sentence per line already.
One thread throughout (TOKENIZERS_PARALLELISM=false, a DataLoader worker's setting).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def one_pass(stream, seconds):
    """Tokens/s of `for batch in stream` over at most one epoch or `seconds`."""
    t0, tokens = time.perf_counter(), 0
    for batch in stream:
        tokens += int(batch["attention_mask"].sum())
        if time.perf_counter() - t0 > seconds:
            break
    return tokens / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--docs", type=int, default=3000)
    p.add_argument("--seconds", type=float, default=30, help="cap on each timed pass")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bert_ddp_formats_")
    os.environ["BERT_DDP_CACHE"] = os.path.join(work, "cache")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencex
    from data_rate import generate

    import data_stream as ds
    try:
        txt = generate(os.path.join(work, "corpus.txt"), args.docs, 0)
        with open(txt, encoding="utf-8") as f:
            texts = [" ".join(doc.split("\n")) for doc in f.read().strip("\n").split("\n\n")]
        paths = {"txt": txt, "jsonl": os.path.join(work, "corpus.jsonl"), "parquet": os.path.join(work, "c.parquet")}
        with open(paths["jsonl"], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        pq.write_table(pa.table({"text": texts}), paths["parquet"], row_group_size=1000)
        tok = ds.get_tokenizer(None, [txt], 8192)
        t0 = time.perf_counter()
        sentences = [s for t in texts for s in sentencex.segment("en", t)]
        split_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        bare = sum(len(e.ids) for e in tok.backend_tokenizer.encode_batch(sentences, add_special_tokens=False))
        tok_s = time.perf_counter() - t0
        mb = sum(map(len, texts)) / 1e6
        print(f"{args.docs:,} documents, {mb:.1f} MB; sentencex {mb / split_s:.1f} MB/s "
              f"({len(sentences):,} sentences); bare tokenizer, one thread: {mb / tok_s:.2f} MB/s, "
              f"{bare / tok_s:,.0f} tokens/s\n")
        print("| format | objective | cold tokens/s (no cache) | warm tokens/s (cache full) |")
        print("| --- | --- | --- | --- |")
        for objective in ("nsp", "mlm"):
            for fmt, path in paths.items():
                common = dict(objective=objective, rank=0, world_size=1)
                cold = one_pass(ds.BertPretrainStream(path, tok, token_cache="none", **common), args.seconds)
                stream = ds.BertPretrainStream(path, tok, token_cache=os.path.join(work, f"tc-{fmt}"), **common)
                one_pass(stream, 1e9)  # epoch 0 fills the cache (untimed)
                stream.set_epoch(1)
                warm = one_pass(stream, args.seconds)
                print(f"| {fmt} | {objective} | {cold:,.0f} | {warm:,.0f} |", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
