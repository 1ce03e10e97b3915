"""Corpora as JSON lines (.jsonl, .jsonl.gz), parquet and `datasets` save_to_disk folders (Arrow):
the same documents as BERT's text format, read the same way, with one-line errors for bad records."""
import gzip
import json
import os
import random
import re
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import (
    ROOT,
    WORDS,
    Launch,
    check_against_stream,
    check_resume_from_cursor,
    corpus_tokens,
    make_stream,
    marker,
    plain,
    run_ranks,
    same_batches,
    tokens_per_shard,
    wait_for,
)

import data_stream as ds

MARKER = re.compile(r"docstart(?: (?:zero|one|two|three|four|five|six|seven|eight|nine))+")
RECORD_FORMATS = ["jsonl", "jsonl.gz", "parquet", "arrow"]


# ----------------------------------------------------------------------------- writers

def bert_documents(path):
    """A BERT-format file -> its documents, each a list of its lines (sentences)."""
    with open(path, encoding="utf-8") as f:
        return [doc.split("\n") for doc in f.read().strip("\n").split("\n\n")]


def write_text(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join("\n".join(doc) for doc in docs) + "\n")
    return str(path)


def write_jsonl(path, texts, field="text"):
    """One record per line; a .gz name is gzip-compressed."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, field: text}) + "\n")
    return str(path)


def write_parquet(path, texts, field="text", row_group_size=7):
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path, row_group_size=row_group_size)
    assert pq.ParquetFile(path).num_row_groups == -(-len(texts) // row_group_size)
    return str(path)


def write_arrow_folder(folder, texts, field="text"):
    """What datasets.Dataset.save_to_disk writes: the table in Arrow *stream* format (several record
    batches here), dataset_info.json and state.json."""
    os.makedirs(folder)
    table = pa.table({"id": list(range(len(texts))), field: texts})
    with pa.OSFile(os.path.join(folder, "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=16)
    features = {"id": {"dtype": "int64", "_type": "Value"}, field: {"dtype": "string", "_type": "Value"}}
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"citation": "", "description": "", "features": features, "homepage": "", "license": ""}, f)
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "5eed5eed5eed5eed",
                   "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                   "_output_all_columns": False, "_split": None}, f)
    return str(folder)


def write_dataset_dict(folder, splits):
    """What datasets.DatasetDict.save_to_disk writes: dataset_dict.json and one folder per split."""
    os.makedirs(folder)
    with open(os.path.join(folder, "dataset_dict.json"), "w") as f:
        json.dump({"splits": list(splits)}, f)
    for name, texts in splits.items():
        write_arrow_folder(os.path.join(folder, name), texts)
    return str(folder)


def write_records(path, fmt, texts, field="text"):
    if fmt.startswith("jsonl"):
        return write_jsonl(path, texts, field)
    if fmt == "parquet":
        return write_parquet(path, texts, field)
    return write_arrow_folder(path, texts, field)


def all_markers(corpus):
    """Every document marker a Corpus holds, read document by document."""
    return sorted(m for d in range(corpus.num_docs) for m in MARKER.findall(" ".join(corpus.read(d))))


@pytest.fixture(scope="module")
def formats(corpus, tmp_path_factory):
    """The session corpus (120 documents) as every record format: one record per document, its
    sentences joined by spaces."""
    root = tmp_path_factory.mktemp("formats")
    texts = [" ".join(doc) for doc in bert_documents(corpus)]
    assert len(texts) == 120
    out = {"txt": corpus}
    for fmt in RECORD_FORMATS:
        out[fmt] = write_records(root / ("corpus" if fmt == "arrow" else f"corpus.{fmt}"), fmt, texts)
    return out


# ----------------------------------------------------------------------------- the same documents

@pytest.mark.parametrize("fmt", RECORD_FORMATS)
def test_every_format_reads_the_documents_of_the_txt(formats, tokenizer, fmt):
    text, records = ds.Corpus(formats["txt"], sentences=False), ds.Corpus(formats[fmt], sentences=False)
    assert records.num_docs == text.num_docs == 120
    assert [" ".join(records.read(d)) for d in range(120)] == [" ".join(text.read(d)) for d in range(120)]
    # mlm packs tokens, so sentence boundaries do not matter: one shard gives the very same batches
    same_batches(list(make_stream(formats[fmt], tokenizer, objective="mlm", seed=2)),
                 list(make_stream(formats["txt"], tokenizer, objective="mlm", seed=2)))
    # two ranks (shards cut by bytes, which differ by format): every token of the corpus once
    expected = corpus_tokens(formats["txt"], tokenizer)
    for path in (formats["txt"], formats[fmt]):
        shards = {}
        for batches in run_ranks(path, tokenizer, 2, 0, objective="mlm", mask_prob=0.0):
            shards.update(tokens_per_shard(batches, tokenizer))
        assert Counter(t for ts in shards.values() for t in ts) == expected, path


def test_nsp_splits_records_into_sentences(tmp_path):
    texts = ["The river is wide. It runs to the sea! Does it ever stop?",
             "A first paragraph with no full stop\n\nThe second paragraph goes on. Then it ends.",
             "One line broken\nin the middle. Next one.\n \t\nLast paragraph here."]
    want = [["The river is wide.", "It runs to the sea!", "Does it ever stop?"],
            ["A first paragraph with no full stop", "The second paragraph goes on.", "Then it ends."],
            ["One line broken in the middle.", "Next one.", "Last paragraph here."]]
    for fmt in RECORD_FORMATS:
        path = write_records(tmp_path / ("ds" if fmt == "arrow" else f"r.{fmt}"), fmt, texts)
        nsp = ds.open_corpus(path, objective="nsp")
        assert [nsp.read(d) for d in range(3)] == want, fmt
        mlm = ds.open_corpus(path, objective="mlm")  # mlm does not split sentences: lines as they are
        assert [mlm.read(d) for d in range(3)] == [[t.strip() for t in text.split("\n") if t.strip()]
                                                   for text in texts], fmt


def prose_documents(num_docs, seed=0):
    """Documents whose sentences the sentence splitter finds exactly (capitalised, ., ! or ?)."""
    rng = random.Random(seed)
    words = [w for w in WORDS if len(w) > 2]  # no 'a .': it reads as an initial
    docs = []
    for d in range(num_docs):
        sents = [marker(d).capitalize() + "."]
        for _ in range(rng.randint(0, 12)):
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
            sents.append(sentence.capitalize() + rng.choice(".!?"))
        docs.append(sents)
    return docs


def test_nsp_on_records_equals_nsp_on_text(tmp_path, tokenizer):
    docs = prose_documents(60, seed=4)
    text_path = write_text(tmp_path / "prose.txt", docs)
    text = ds.open_corpus(text_path, objective="nsp")
    reference = list(make_stream(text_path, tokenizer, objective="nsp", seed=1))
    assert any(len(text.read(d)) >= 8 for d in range(60)) and len(reference) > 20
    for fmt in ("jsonl", "parquet", "arrow"):
        path = write_records(tmp_path / ("prose" if fmt == "arrow" else f"prose.{fmt}"), fmt,
                             [" ".join(doc) for doc in docs])
        records = ds.open_corpus(path, objective="nsp")
        assert [records.read(d) for d in range(60)] == [text.read(d) for d in range(60)] == docs
        same_batches(list(make_stream(path, tokenizer, objective="nsp", seed=1)), reference)


def test_a_mixed_folder_or_a_comma_list_reads_every_document_once_and_skips_cache_files(tmp_path, corpus):
    docs = bert_documents(corpus)
    texts = [" ".join(doc) for doc in docs]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    parts = [write_text(mixed / "a.txt", docs[:30]), write_jsonl(mixed / "b.jsonl", texts[30:50]),
             write_jsonl(mixed / "c.jsonl.gz", texts[50:60]), write_parquet(mixed / "d.parquet", texts[60:90]),
             write_arrow_folder(mixed / "saved", texts[90:])]
    # an intermediate file of datasets (cache-*.arrow) is not part of the dataset
    write_arrow_folder(tmp_path / "junk", ["docstart nine nine nine ."])
    os.replace(tmp_path / "junk" / "data-00000-of-00001.arrow", mixed / "saved" / "cache-0123abcd.arrow")
    expected = sorted(marker(d) for d in range(120))
    for spec in (str(mixed), ",".join(parts)):
        c = ds.Corpus(spec, sentences=False)
        assert len(c.files) == 5 and c.num_docs == 120, spec
        assert all_markers(c) == expected, spec


def test_dataset_dict_reads_one_split(tmp_path):
    folder = write_dataset_dict(tmp_path / "dd", {"train": [f"{marker(d)} . Train text." for d in range(5)],
                                                  "test": [f"{marker(d)} . Test text." for d in range(100, 103)]})
    train = ds.Corpus(folder, split="train", sentences=False)
    assert train.num_docs == 5 and all_markers(train) == sorted(marker(d) for d in range(5))
    assert ds.Corpus(folder, split="test", sentences=False).num_docs == 3
    assert ds.Corpus(folder, split="eval", sentences=False).num_docs == 3  # eval: validation, else test
    only_train = write_dataset_dict(tmp_path / "dd1", {"train": [f"{marker(d)} . Train text." for d in range(5)]})
    assert ds.Corpus(only_train, split="train", sentences=False).num_docs == 5
    with pytest.raises(ds.CorpusError) as e:
        ds.Corpus(only_train, split="eval")
    message = str(e.value)
    assert "\n" not in message and "splits train," in message and os.path.join(only_train, "train") in message


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_text_field_names_the_column(formats, tmp_path, tokenizer, fmt):
    texts = [" ".join(doc) for doc in bert_documents(formats["txt"])]
    path = write_records(tmp_path / f"content.{fmt}", fmt, texts, field="content")
    c = ds.Corpus(path, text_field="content", sentences=False)
    assert c.num_docs == 120 and all_markers(c) == sorted(marker(d) for d in range(120))
    same_batches(list(make_stream(path, tokenizer, objective="mlm", text_field="content")),
                 list(make_stream(formats["txt"], tokenizer, objective="mlm")))


def test_empty_records_are_skipped_with_a_count(tmp_path, tokenizer):
    texts = ["First river stone .", "", "   \n\t ", None, "Second garden paper .", ""]
    for fmt in ("jsonl", "parquet", "arrow"):
        path = write_records(tmp_path / ("ds" if fmt == "arrow" else f"e.{fmt}"), fmt, texts)
        with pytest.warns(UserWarning, match=r"corpus: 4 record\(s\) with empty or missing 'text' were skipped"):
            c = ds.Corpus(path, sentences=False)
        assert [c.read(d) for d in range(c.num_docs)] == [["First river stone ."], ["Second garden paper ."]], fmt
        with pytest.warns(UserWarning, match="4 record"):
            stream = make_stream(path, tokenizer, objective="mlm", mask_prob=0.0)
        assert tokenizer.decode(next(iter(stream))["input_ids"][0]).count("[SEP]") == 3  # 2 documents + end


# ----------------------------------------------------------------------------- bad input

def cli(*args):
    """data_stream.py with these arguments, started now (the tests start several, then wait_for them)."""
    return Launch(plain(*args, script=os.path.join(ROOT, "data_stream.py")))


def bad_records(tmp_path):
    """{corpus path: what data_stream.py's one error line must say}."""
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"text": "Fine river ."}\n\n{"text": "broken" \n{"text": "never read ."}\n')
    no_field = tmp_path / "no_field.jsonl"
    no_field.write_text('{"text": "Fine ."}\n{"content": "River stone .", "id": 1}\n')
    number = tmp_path / "number.jsonl"
    number.write_text('{"text": "Fine ."}\n{"text": "Fine too ."}\n{"text": 42}\n')
    no_column = write_parquet(tmp_path / "no_column.parquet", ["River stone ."] * 3, field="content")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1" + bytes(random.Random(0).getrandbits(8) for _ in range(4000)) + b"PAR1")
    return {str(malformed): [f"{malformed}, line 3: not valid JSON"],
            str(no_field): [f"{no_field}, line 2: no field 'text'", "(it has: content, id)", "--text-field"],
            str(number): [f"{number}, line 3", "'text' is a int, not text"],
            no_column: [f"{no_column} has no column 'text'", "(it has: id, content)", "--text-field"],
            str(garbage): [f"{garbage} does not read as parquet"]}


def test_bad_records_give_one_line_errors(tmp_path, tok_dir, capsys):
    """data_stream.py's main() stops with its one line (a SystemExit: exit code 1, no traceback) and shows no
    sample; as a process: test_a_bad_record_in_a_process_is_one_line_on_stderr."""
    for path, messages in bad_records(tmp_path).items():
        with pytest.raises(SystemExit) as stopped:
            ds.main(["--corpus", path, "--tokenizer", tok_dir, "--show", "1"])
        line = str(stopped.value.code)
        assert "--- sample" not in capsys.readouterr().out, path
        assert line.startswith("data_stream.py: error: ") and "\n" not in line, line
        assert all(m in line for m in messages), (messages, line)


@pytest.mark.slow  # subprocesses, or seconds of work
def test_a_bad_record_in_a_process_is_one_line_on_stderr(tmp_path, tok_dir):
    path, messages = list(bad_records(tmp_path).items())[-1]  # pyarrow's reader of a garbage file
    code, out, err = wait_for([cli("--corpus", path, "--tokenizer", tok_dir, "--show", "1")], 300)[0]
    assert code != 0 and "Traceback" not in err and "--- sample" not in out, (path, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("data_stream.py: error: "), err
    assert all(m in err for m in messages), (messages, err)


def test_more_bad_inputs_name_the_problem_in_one_line(tmp_path):
    int_column = write_parquet(tmp_path / "ints.parquet", [1, 2, 3])
    garbage = tmp_path / "saved"
    garbage.mkdir()
    (garbage / "data-00000-of-00001.arrow").write_bytes(b"ARROW1" + b"\x07" * 500)
    not_object = tmp_path / "list.jsonl"
    not_object.write_text('["River stone ."]\n')
    truncated = tmp_path / "cut.jsonl.gz"
    data = gzip.compress(b'{"text": "River stone garden ."}\n' * 2000)
    truncated.write_bytes(data[:len(data) // 2])
    only_test = write_dataset_dict(tmp_path / "dd", {"test": ["River stone ."]})
    cases = {int_column: "column 'text' is int64, not text", str(garbage): "does not read as arrow",
             str(not_object): f"{not_object}, line 1: no field 'text' (it has: list)",
             str(truncated): f"corpus file {truncated} is not a readable gzip file",
             only_test: f"--corpus {only_test} is a DatasetDict with splits test"}
    for path, message in cases.items():
        with pytest.raises(ds.CorpusError) as e:
            ds.Corpus(path)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- resume, estimator, CLI

@pytest.mark.parametrize("fmt,objective,shuffle_block,num_workers",
                         [("jsonl", "nsp", 3, 2), ("jsonl", "mlm", 8192, 0), ("parquet", "nsp", 8192, 0),
                          ("parquet", "mlm", 4, 2)])
def test_resume_from_cursor_on_records_yields_exactly_the_rest(formats, tokenizer, fmt, objective, shuffle_block,
                                                              num_workers):
    check_resume_from_cursor(formats[fmt], tokenizer, objective, shuffle_block, num_workers)


@pytest.mark.parametrize("fmt,world_size,num_workers,objective,batch_size,epochs",
                         [("jsonl", 2, 2, "nsp", 8, 1), ("parquet", 3, 0, "mlm", 4, 2)])
def test_estimator_s_exact_count_equals_the_stream_on_records(formats, tokenizer, fmt, world_size, num_workers,
                                                              objective, batch_size, epochs):
    real = check_against_stream(formats[fmt], tokenizer, world_size, num_workers, objective, batch_size, epochs)
    assert sum(map(len, real[0])) >= 8


@pytest.mark.slow  # subprocesses, or seconds of work
def test_cli_show_and_stream_bench_decode_the_records_words(formats, tok_dir, capsys):
    benches = [Launch(plain("--corpus", formats[fmt], "--tokenizer", tok_dir, "--seconds", "1",
                            script=os.path.join(ROOT, "bench", "stream_bench.py"))) for fmt in ("jsonl", "parquet")]
    shows = []
    for fmt in ("jsonl", "parquet"):  # data_stream.py --show, in-process while the benches start
        ds.main(["--corpus", formats[fmt], "--tokenizer", tok_dir, "--show", "2"])
        shows.append(capsys.readouterr().out)
    for fmt, out, (bench_code, bench_out, bench_err) in zip(("jsonl", "parquet"), shows, wait_for(benches, 300),
                                                            strict=True):
        assert bench_code == 0, (fmt, bench_err)
        out += bench_out
        assert "corpus: 1 file(s), 120 documents" in out and out.count("--- sample") == 2, out
        assert re.search(r"stream: [\d,]+ samples/s, [\d,]+ tokens/s", out), out
        shown = [w for line in out.splitlines() if line.startswith("[CLS]") for w in line.split()]
        assert sum(w in WORDS for w in shown) > 0.5 * len(shown), out  # the records' words, decoded


def test_a_real_folder_skips_hidden_folders_and_reads_nested_splits_categoricals_and_bad_utf8(tmp_path):
    """A DatasetDict nested in a corpus folder reads one split; hidden folders (notebook checkpoints)
    are skipped; a categorical (dictionary) column reads; bad UTF-8 in a jsonl record is replaced
    and counted; an error in a .jsonl.gz names the user's file, not the cache's copy."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_text(folder / "a.txt", [[f"{marker(0)} .", "river stone ."]])
    (folder / ".ipynb_checkpoints").mkdir()
    write_text(folder / ".ipynb_checkpoints" / "a-checkpoint.txt", [[f"{marker(0)} .", "river stone ."]])
    write_dataset_dict(folder / "dd", {"train": [f"{marker(1)} . Train text."], "test": [f"{marker(2)} . Test."]})
    table = pa.table({"text": pa.array([f"{marker(3)} . Categorical text."]).dictionary_encode()})
    pq.write_table(table, folder / "cat.parquet")
    with open(folder / "latin.jsonl", "wb") as f:
        f.write(b'{"text": "' + marker(4).encode() + b' . caf\xe9 au lait ."}\n')
    with pytest.warns(UserWarning, match="1 line"):
        c = ds.Corpus(str(folder), sentences=False)
    assert all_markers(c) == sorted(marker(d) for d in (0, 1, 3, 4))
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"text": "ok ."}\n{"text": oops}\n')
    with pytest.raises(ds.CorpusError, match=re.escape(f"{bad}, line 2")):
        ds.Corpus(str(bad))


def test_edge_files_read_or_fail_in_one_line(tmp_path):
    """A parquet file with no row group is an empty shard; a broken dataset_dict.json is a
    CorpusError; a 64 KB run of UTF-8 continuation bytes is indexed (it used to loop forever)."""
    import signal
    ok = write_text(tmp_path / "ok.txt", [[f"{marker(0)} .", "river stone ."]])
    empty = str(tmp_path / "empty.parquet")
    pq.ParquetWriter(empty, pa.schema([("text", pa.string())])).close()
    assert ds.Corpus(f"{ok},{empty}", sentences=False).num_docs == 1
    broken = tmp_path / "dd"
    broken.mkdir()
    (broken / "dataset_dict.json").write_text('{"splits": ["train"')
    with pytest.raises(ds.CorpusError, match="dataset_dict.json does not read"):
        ds.Corpus(str(broken))
    odd = tmp_path / "odd.txt"
    odd.write_bytes(b"hello world .\n\n" + b"\xc3" + b"\xa9" * 70000 + b"\n")
    signal.alarm(30)  # a hang fails the test instead of the suite
    try:
        with pytest.warns(UserWarning, match="not UTF-8"):
            assert ds.Corpus(str(odd)).num_docs >= 2
    finally:
        signal.alarm(0)
