"""
Data rate of one process (BENCHMARKS.md section 10): tokens/s the stream delivers (nsp and mlm: cold token cache,
warm, cache off) next to the bare fast tokenizer and to the Hugging Face datasets pipeline of run_mlm.py, same
corpus and batch shape; with --formats, the same text as .jsonl and .parquet too.

    python bench/data_rate.py                            # 3,000 documents (~7.4 MB), batch 32 x 128, <= 60 s a row
    python bench/data_rate.py --before /tmp/old/data_stream.py    # + another commit's stream (section 10's table)
    python bench/data_rate.py --formats txt,jsonl,parquet --seconds 30     # section 10's formats
    python bench/data_rate.py --docs 200 --seconds 2 --formats txt,jsonl   # a smoke run

Corpus: bench/common.py's write_corpus (words='prose'), BERT format (one sentence per line, a blank line between
documents). Each document is a run of 5-45 consecutive sentences (25 on average, ~2.5 kB) taken from a random
place of the builtin corpus (English prose shipped with CPython: pydoc topics and stdlib docstrings), so the text
is real English, repeated and reshuffled. --formats jsonl, parquet: the same documents as records, a document's
sentences joined by spaces (paragraphs, as such corpora hold them), so nsp splits them again with sentencex (its
rate on that text is printed); parquet in row groups of 1,000. A WordPiece (--vocab-size) is trained on it first
(untimed). BERT_DDP_CACHE points at a fresh temporary folder, set before data_stream is imported, so "cold" has no
token cache from before.
Everything runs with TOKENIZERS_PARALLELISM=false (a DataLoader worker's setting; pretrain_ddp.py sets it
when it has workers) except the "all cores" tokenizer row: per-process numbers, one core each.

Rows (tokens = non-pad tokens, i.e. the sum of attention_mask; the bare tokenizer counts the ids it returns):
- bare tokenizer: tokenizer.backend_tokenizer.encode_batch(lines, add_special_tokens=False) over the corpus's
  non-blank lines in chunks of 4,096 lines, in a subprocess (the Rust library reads TOKENIZERS_PARALLELISM
  itself): once with TOKENIZERS_PARALLELISM=false (1 thread: the note counts the threads encode_batch started,
  0 here, and CPU/wall stays <= 1), once =true (all cores: its thread pool, one thread a core).
- stream nsp / mlm, `for batch in stream` in this process (what a num_workers=0 DataLoader does), default
  --shuffle-docs: cold = epoch 0 on an empty token cache (it fills the cache); warm = set_epoch(1) on the same
  stream, cache full; cache off = token_cache='none', epoch 0. Each objective gets a token cache folder of its
  own (token_cache=<folder>; 'auto' is the same code on a folder under BERT_DDP_CACHE): on a text corpus nsp
  and mlm may share cached ids, which would make the second "cold" warm. The offset index of the corpus file
  already exists (training the tokenizer built it): cold means the token cache, not the index.
- HF pipeline, run_mlm.py's recipe (line_by_line=False): datasets.load_dataset("text") -> map(tokenize,
  batched=True) -> map(group_texts, batched=True) into blocks of --max-seq-len -> torch DataLoader(batch_size,
  num_workers=0, collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)). special_tokens_mask
  is dropped before the DataLoader, as Trainer does (BertForMaskedLM.forward does not take it), so the collator
  recomputes it. "prep (cold)": load + both maps on an empty datasets cache, its rate = block tokens / seconds;
  "DataLoader (warm)": one pass over the prepared blocks. Needs `pip install datasets` (bench only).

nsp delivers more tokens than the corpus holds (random next segments come from other documents, and each
sample adds [CLS]/[SEP]/[SEP]); the notes give tokens delivered per corpus token (corpus: the bare tokenizer's count).

Columns: tokens/s; that rate over the bare 1-thread tokenizer's and over the HF DataLoader's; CPU/wall (process
CPU seconds, all threads, over wall seconds: ~1.0 is one core busy, less: other processes took the core);
tokens per CPU s (steadier than tokens/s on a busy machine, for the one-thread rows); first batch: cold stream rows from
BertPretrainStream(...) to the first batch, warm and cache-off rows from iter(); HF prep row: prep + the first
DataLoader batch. Each timed row stops after --seconds (a cut cold epoch is marked; the rest of the cache is
then filled with data_stream.build_cache, untimed, so warm is warm).
"""

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402  (imports no data_stream: BERT_DDP_CACHE is set first)

ROOT = common.ROOT
CHUNK_LINES = 4096


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--docs", type=int, default=3000, help="documents in the generated corpus (~2.5 kB each)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=8192, help="WordPiece trained on the generated corpus")
    p.add_argument("--seconds", type=float, default=60, help="cap on each timed row")
    p.add_argument("--seed", type=int, default=0, help="corpus generation and stream seed")
    p.add_argument("--before", metavar="DATA_STREAM_PY",
                   help="also time epoch 0 of another data_stream.py on the same corpus (e.g. an older commit's: "
                        "git show 62a1403:data_stream.py > /tmp/before/data_stream.py)")
    p.add_argument("--formats", default="txt", help="comma list of txt, jsonl, parquet: the stream rows of each")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (corpus, caches) and print it")
    p.add_argument("--worker", choices=["bare"], help=argparse.SUPPRESS)  # internal: bare tokenizer subprocess
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def machine():
    model = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    versions = {}
    for name in ("torch", "transformers", "tokenizers", "numpy", "datasets"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    return {"cpu": model, "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
            "loadavg_start": os.getloadavg()[0],
            "python": platform.python_version(), **versions}


def formats(path, names):
    """{format: corpus file}: the text corpus, and its documents as .jsonl / .parquet records."""
    with open(path, encoding="utf-8") as f:
        texts = [" ".join(doc.split("\n")) for doc in f.read().strip("\n").split("\n\n")]
    paths = {"txt": path}
    if "jsonl" in names:
        paths["jsonl"] = os.path.splitext(path)[0] + ".jsonl"
        with open(paths["jsonl"], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    if "parquet" in names:
        import pyarrow as pa
        import pyarrow.parquet as pq
        paths["parquet"] = os.path.splitext(path)[0] + ".parquet"
        pq.write_table(pa.table({"text": texts}), paths["parquet"], row_group_size=1000)
    if len(paths) > 1:
        import sentencex
        t0 = time.perf_counter()
        count = sum(1 for t in texts for _ in sentencex.segment("en", t))
        mb = sum(map(len, texts)) / 1e6
        print(f"sentencex: {mb / (time.perf_counter() - t0):.1f} MB/s ({count:,} sentences of {mb:.1f} MB)", flush=True)
    return {name: paths[name] for name in names}


def corpus_lines(path):
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip()]


# ----------------------------------------------------------------------------- bare tokenizer (subprocess)

def os_threads():
    """Threads of this process now (Linux); the Rust tokenizer's pool shows up here when it starts."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("Threads:"))


def bare_worker(args):
    import data_stream
    backend = data_stream.get_tokenizer(args.tokenizer).backend_tokenizer
    lines = corpus_lines(args.corpus)
    threads_before = os_threads()
    backend.encode_batch(lines[:256], add_special_tokens=False)  # thread pool start, allocator: untimed
    tokens, done = 0, 0
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(0, len(lines), CHUNK_LINES):
        tokens += sum(len(e.ids) for e in backend.encode_batch(lines[k:k + CHUNK_LINES], add_special_tokens=False))
        done = min(k + CHUNK_LINES, len(lines))
        if time.perf_counter() - t0 > args.seconds:
            break
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"tokens": tokens, "seconds": wall, "cpu": cpu, "lines": done, "all_lines": len(lines),
                      "parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
                      "threads_started": os_threads() - threads_before}))


def run_bare(args, tok_dir, path, parallel):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true" if parallel else "false"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "bare", "--tokenizer", tok_dir,
                          "--corpus", path, "--seconds", str(args.seconds)], env=env, capture_output=True,
                         text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"bare tokenizer subprocess failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    cut = r["lines"] < r["all_lines"]
    return {"tokens": r["tokens"], "seconds": r["seconds"], "cpu": r["cpu"], "first_batch": None, "cut": cut,
            "note": f"TOKENIZERS_PARALLELISM={r['parallelism']}, {r['threads_started']} threads started by "
                    f"encode_batch; {r['lines']:,} lines"
                    + (f" of {r['all_lines']:,} (cut at --seconds)" if cut else "")}


# ----------------------------------------------------------------------------- the stream (this process)

def iterate(stream, seconds, t_start=None):
    """One epoch of `for batch in stream` (at most `seconds`): tokens, wall, CPU, first batch, cut."""
    t0, c0 = time.perf_counter(), time.process_time()
    t_start = t0 if t_start is None else t_start
    tokens, batches, first, cut = 0, 0, None, False
    it = iter(stream)
    for batch in it:
        first = first if first is not None else time.perf_counter() - t_start
        tokens += int(batch["attention_mask"].sum())
        batches += 1
        if time.perf_counter() - t0 > seconds:
            cut = True
            break
    if hasattr(it, "close"):
        it.close()  # a stream's generator flushes its token cache when it ends
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0,
            "first_batch": first, "batches": batches, "cut": cut}


def stream_rows(args, ds, tok, path, objective, work, fmt="txt"):
    settings = {"objective": objective, "max_seq_len": args.max_seq_len, "batch_size": args.batch_size,
                "seed": args.seed}
    name = f"stream {objective}" + ("" if fmt == "txt" else f" {fmt}")
    rows = {}
    # A token cache folder of its own per objective ('auto' is the same cache under BERT_DDP_CACHE/tokens):
    # on a text corpus nsp and mlm read the same token ids, so a shared cache would make mlm's "cold" warm.
    cache_dir = os.path.join(work, f"tokens-{objective}-{fmt}")
    assert not os.path.exists(cache_dir)
    t_start = time.perf_counter()
    stream = ds.BertPretrainStream(path, tok, ds.StreamSettings(token_cache=cache_dir, **settings), rank=0,
                                   world_size=1)
    stream.set_epoch(0)
    r = iterate(stream, args.seconds, t_start)
    note = f"epoch 0, fills the token cache; {r['batches']:,} batches"
    if r["cut"]:
        with contextlib.redirect_stdout(io.StringIO()):
            ds.build_cache(stream)
        note += " (cut at --seconds; rest of the cache filled untimed)"
    rows[f"{name}, cold"] = {**r, "note": note}

    def epoch(stream, number, note):
        stream.set_epoch(number)
        r = iterate(stream, args.seconds)
        return {**r, "note": f"{note}; {r['batches']:,} batches" + (" (cut at --seconds)" if r["cut"] else "")}
    rows[f"{name}, warm"] = epoch(stream, 1, "epoch 1, token cache full")
    off = ds.BertPretrainStream(path, tok, ds.StreamSettings(token_cache="none", **settings), rank=0, world_size=1)
    rows[f"{name}, cache off"] = epoch(off, 0, "token_cache='none', epoch 0")
    return rows


def before_rows(args, tok, path):
    """Epoch 0 of another version of the stream (its own module, same tokenizer and settings)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("data_stream_before", args.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    rows = {}
    for objective in ("nsp", "mlm"):
        settings = dict(objective=objective, max_seq_len=args.max_seq_len, batch_size=args.batch_size, seed=args.seed)
        if hasattr(before, "StreamSettings"):
            stream = before.BertPretrainStream(path, tok, before.StreamSettings(**settings), rank=0, world_size=1)
        else:  # a data_stream.py from before the settings record (issue 49) takes them as keywords
            stream = before.BertPretrainStream(path, tok, rank=0, world_size=1, **settings)
        stream.set_epoch(0)
        r = iterate(stream, args.seconds)
        rows[f"stream {objective}, before"] = {**r, "note": f"epoch 0 of {args.before}; {r['batches']:,} batches"}
    return rows


# ----------------------------------------------------------------------------- HF datasets pipeline (run_mlm.py)

def hf_rows(args, tok, path, work):
    try:
        import datasets
    except ImportError:
        print("HF pipeline rows skipped: the datasets package is missing (bench only): pip install datasets",
              flush=True)
        return {}
    import torch
    from torch.utils.data import DataLoader
    from transformers import DataCollatorForLanguageModeling
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    n = args.max_seq_len

    def tokenize_function(examples):  # run_mlm.py, line_by_line=False
        return tok(examples["text"], return_special_tokens_mask=True)

    def group_texts(examples):  # run_mlm.py: concatenate everything, cut into blocks of n, drop the remainder
        concatenated = {k: [t for e in examples[k] for t in e] for k in examples}
        total = len(concatenated["input_ids"]) // n * n
        return {k: [t[i:i + n] for i in range(0, total, n)] for k, t in concatenated.items()}

    t0, c0 = time.perf_counter(), time.process_time()
    raw = datasets.load_dataset("text", data_files={"train": path}, cache_dir=os.path.join(work, "hf_datasets"),
                                split="train")
    tokenized = raw.map(tokenize_function, batched=True, remove_columns=["text"])
    blocks = tokenized.map(group_texts, batched=True)
    prep_s, prep_cpu = time.perf_counter() - t0, time.process_time() - c0
    block_tokens = len(blocks) * n
    # Trainer(remove_unused_columns=True) drops what BertForMaskedLM.forward does not take
    blocks = blocks.remove_columns([c for c in blocks.column_names if c == "special_tokens_mask"])
    loader = DataLoader(blocks, batch_size=args.batch_size, num_workers=0,
                        collate_fn=DataCollatorForLanguageModeling(tok, mlm_probability=0.15))
    torch.manual_seed(args.seed)  # the collator masks with torch's global RNG
    r = iterate(loader, args.seconds)
    return {
        "HF pipeline prep (cold)": {
            "tokens": block_tokens, "seconds": prep_s, "cpu": prep_cpu, "first_batch": prep_s + (r["first_batch"] or 0),
            "note": f"load_dataset + tokenize map + group_texts map -> {len(blocks):,} blocks of {n}"},
        "HF pipeline DataLoader (warm)": {
            **r, "note": f"one pass, DataCollatorForLanguageModeling; {r['batches']:,} batches"
                         + (" (cut at --seconds)" if r["cut"] else "")},
    }


# ----------------------------------------------------------------------------- main

def table(rows, bare_key, hf_key):
    bare = rows[bare_key]["rate"] if bare_key in rows else None
    hf = rows[hf_key]["rate"] if hf_key in rows else None
    columns = ["row", "tokens/s", "vs bare tokenizer 1 thread", "vs HF DataLoader warm", "CPU/wall", "tokens per CPU s",
               "first batch s", "timed s", "tokens", "notes"]
    out = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for name, r in rows.items():
        first = "-" if r["first_batch"] is None else f"{r['first_batch']:.2f}"
        vs_bare = "-" if bare is None else f"{r['rate'] / bare:.2f}"
        vs_hf = "-" if hf is None else f"{r['rate'] / hf:.2f}"
        out.append(f"| {name} | {r['rate']:,.0f} | {vs_bare} | {vs_hf} | {r['cpu'] / r['seconds']:.2f} | "
                   f"{r['tokens'] / max(r['cpu'], 1e-9):,.0f} | {first} | {r['seconds']:.1f} | {r['tokens']:,} | "
                   f"{r['note']} |")
    return "\n".join(out)


def main(argv=None):
    args = parse_args(argv)
    if args.worker == "bare":
        return bare_worker(args)
    t_begin = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bert_ddp_data_rate_")
    # before data_stream is imported: it reads BERT_DDP_CACHE once, at import
    os.environ["BERT_DDP_CACHE"] = os.path.join(work, "cache")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["HF_DATASETS_CACHE"] = os.path.join(work, "hf_datasets")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import data_stream as ds
        info = machine()
        path = common.write_corpus(os.path.join(work, "corpus.txt"), docs=args.docs, seed=args.seed)
        lines = corpus_lines(path)
        t0 = time.perf_counter()
        tok = ds.get_tokenizer(None, [path], args.vocab_size)
        tok_dir = tok.name_or_path
        print(f"machine: {info['cpu']}, {info['nproc']} cores (nproc); python {info['python']}, torch "
              f"{info.get('torch')}, transformers {info.get('transformers')}, tokenizers {info.get('tokenizers')}, "
              f"datasets {info.get('datasets', 'missing')}; load average {os.getloadavg()[0]:.2f}", flush=True)
        print(f"corpus: {args.docs:,} documents, {len(lines):,} sentences, {os.path.getsize(path) / 1e6:.2f} MB "
              f"(builtin-corpus sentences, reshuffled); WordPiece {len(tok):,} trained in "
              f"{time.perf_counter() - t0:.1f} s; batch {args.batch_size} x {args.max_seq_len}, one process, "
              f"<= {args.seconds:g} s a row", flush=True)
        rows = {}

        def add(new):
            for name, r in new.items():
                r["rate"] = r["tokens"] / r["seconds"]
                rows[name] = r
                print(f"  {name}: {r['rate']:,.0f} tokens/s ({r['seconds']:.1f} s, CPU/wall "
                      f"{r['cpu'] / r['seconds']:.2f})", flush=True)

        add({"bare tokenizer, 1 thread": run_bare(args, tok_dir, path, parallel=False)})
        add({f"bare tokenizer, all {info['nproc']} cores": run_bare(args, tok_dir, path, parallel=True)})
        bare = rows["bare tokenizer, 1 thread"]
        corpus_tokens = None if bare["cut"] else bare["tokens"]
        paths = formats(path, args.formats.split(","))
        for objective, (fmt, corpus) in ((o, f) for o in ("nsp", "mlm") for f in paths.items()):
            new = stream_rows(args, ds, tok, corpus, objective, work, fmt)
            for r in new.values():
                if corpus_tokens and not r["cut"]:
                    r["note"] += f"; {r['tokens'] / corpus_tokens:.2f} tokens delivered per corpus token"
            add(new)
        if args.before:
            add(before_rows(args, tok, path))
        add(hf_rows(args, tok, path, work))
        print()
        print(table(rows, "bare tokenizer, 1 thread", "HF pipeline DataLoader (warm)"))
        total = time.perf_counter() - t_begin
        info["loadavg_end"] = os.getloadavg()[0]
        print(f"\n{total:.0f} s in all; load average at the end {info['loadavg_end']:.2f} (other processes on "
              f"these {info['nproc']} cores slow every row: see CPU/wall)")
        if args.json:
            print(json.dumps({"machine": info, "args": {k: v for k, v in vars(args).items() if v is not None},
                              "corpus": {"documents": args.docs, "sentences": len(lines),
                                         "bytes": os.path.getsize(path)},
                              "rows": rows, "wall_s": total}, indent=1))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
