"""
The builtin corpus (`--corpus builtin`): English prose that ships with CPython, the pydoc topics plus
the standard library's long docstrings, so nothing is ever downloaded. data_stream.py imports it only
to write the corpus, once per Python version, into its cache (later runs read those files), and for
data_stream._split_prose (bench/learning.py splits the pydoc topics alone with it).

A leaf: it imports nothing of the project, and writes with the function the caller passes (`write`:
data_stream.atomic_write).
"""
import ast
import os
import re
import sysconfig


def split_prose(text):
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


def write_corpus(train_path, eval_path, write):
    """Gather the documents and write them in BERT's text format: the held-out split to eval_path,
    the rest to train_path (write(path, write_to_file, mode): a file whole or not at all)."""
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
    docs = [s for s in (split_prose(t) for t in texts) if len(s) >= 2]
    os.makedirs(os.path.dirname(train_path), exist_ok=True)
    # Every 20th document is held out for evaluation and never enters the training stream.
    for path, part in ((eval_path, docs[::20]), (train_path, [d for i, d in enumerate(docs) if i % 20])):
        text = "\n\n".join("\n".join(d) for d in part) + "\n"
        write(path, lambda f, text=text: f.write(text), "w")
