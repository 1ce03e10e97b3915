"""Does a change keep the trainer's behaviour? The same weights, bitwise, as another commit (BENCHMARKS.md 20, 22).

    python bench/same_weights.py --before ba45e11          # this tree against that commit

Each side runs `python pretrain_ddp.py` (1 rank) and `torchrun --standalone --nproc_per_node 2 pretrain_ddp.py`
(2 ranks) with --objective nsp (packed pairs) and mlm, 30 steps at --max-seq-len 64 --batch-size 8
--num-workers 1 on the tests' kind of generated corpus (160 documents) and one tokenizer; the final checkpoints'
tensors are compared with torch.equal. Then a checkpoint of the commit before resumes: --before's 1-rank nsp run
is cut back to its step 10 checkpoint and this tree trains it on to step 30, which must equal this tree's
uninterrupted 30 steps. Prints one table; exits 1 if anything differs.
"""
import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoints  # noqa: E402
import data_stream  # noqa: E402

WORDS = ("the a of to and in is was for on that with as by at from it an be this which or are river stone garden "
         "winter paper engine market signal window forest letter silver bridge music number orange planet").split()


def write_corpus(path, num_docs, seed=0):
    rng = random.Random(seed)
    docs = ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25))) + " ."
                      for _ in range(rng.randint(1, 30))) for _ in range(num_docs)]
    with open(path, "w") as f:
        f.write("\n\n".join(docs) + "\n")


def train(code, out, objective, ranks, corpus, tok, cache, steps=30, more=()):
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={ranks}"]
    cmd = [*launcher, "pretrain_ddp.py", "--corpus", corpus, "--tokenizer", tok, "--eval-corpus", "none",
           "--max-seq-len", "64", "--batch-size", "8", "--max-steps", str(steps), "--num-workers", "1",
           "--objective", objective, "--out-dir", out, "--save-every", "10", "--keep-last", "5", *more]
    env = {**os.environ, "BERT_DDP_CACHE": cache, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} in {code} failed:\n{done.stderr[-3000:]}")


def weights(out, step=None):
    root = os.path.join(out, "checkpoints")
    name = checkpoints.step_name(step) if step is not None else checkpoints.read_latest(root)
    return torch.load(os.path.join(root, name, "trainer.pt"), weights_only=True)["model"]


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the commit to compare with (git rev)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (printed)")
    args = p.parse_args()
    scratch = tempfile.mkdtemp(prefix="same_weights_")
    before = os.path.join(scratch, "before")
    os.makedirs(before)
    archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", before], input=archive, check=True)
    corpus = os.path.join(scratch, "corpus.txt")
    write_corpus(corpus, 160)
    tok = os.path.join(scratch, "tokenizer")
    data_stream.get_tokenizer(None, [corpus], vocab_size=300).save_pretrained(tok)
    rows, ok = [], True
    for objective in ("nsp", "mlm"):
        for ranks in (1, 2):
            outs = {}
            for side, code in (("before", before), ("after", ROOT)):
                outs[side] = os.path.join(scratch, f"{side}-{objective}-{ranks}")
                train(code, outs[side], objective, ranks, corpus, tok, os.path.join(scratch, f"cache-{side}"))
            a, b = weights(outs["before"]), weights(outs["after"])
            rows.append((f"{objective} {ranks} rank(s), 30 steps", same(a, b), len(a)))
    # a checkpoint of --before resumes in this tree: its step 10, trained on to 30
    cut = os.path.join(scratch, "resumed")
    shutil.copytree(os.path.join(scratch, "before-nsp-1"), cut)
    root = os.path.join(cut, "checkpoints")
    for name in os.listdir(root):
        if checkpoints.step_of(name) not in (None, 10):
            shutil.rmtree(os.path.join(root, name))
    checkpoints.point_latest(root, checkpoints.step_name(10))
    train(ROOT, cut, "nsp", 1, corpus, tok, os.path.join(scratch, "cache-after"))
    resumed = weights(cut)
    rows.append((f"{args.before}'s step 10 resumed here to 30 (nsp, 1 rank)",
                 same(resumed, weights(os.path.join(scratch, "after-nsp-1"))), len(resumed)))
    print(f"| run | {args.before} vs this tree | tensors |\n| --- | --- | --- |")
    for what, equal, tensors in rows:
        print(f"| {what} | {'equal' if equal else 'DIFFERENT'} | {tensors} |")
        ok &= equal
    if args.keep:
        print(f"scratch: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
