"""
finetune.py's time per task, and what model.classify (the real tokens only, the last layer at [CLS] only) buys
against the stock BertForSequenceClassification forward, A/B in one run, sides alternating (issue 45).

    python bench/finetune_speed.py                                  # tiny and mini, polarity and r8, 2 repeats
    python bench/finetune_speed.py --repeats 1 --max-train 2000     # a fifth of each task's training set
    python bench/finetune_speed.py --sizes tiny --tasks polarity --repeats 1 --max-train 500   # a smoke run

Each run is finetune.main on a model of the size with fresh weights (--random-init: the speed does not depend on
the weights), one seed, its default recipe, in a process of its own. Feeds BENCHMARKS.md section 19 (the time per
task) and the choice of model.classify in finetune.py.
"""
import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import common  # noqa: E402


def model_folder(size, work):
    """A Hugging Face folder of BERT-size with the builtin corpus's tokenizer (what the trainer would export)."""
    sys.path.insert(0, ROOT)
    from transformers.utils import logging as hf_logging

    import data_stream
    import model
    hf_logging.disable_progress_bar()
    folder = os.path.join(work, size)
    if not os.path.isdir(folder):
        corpus = data_stream.open_corpus("builtin")
        tokenizer = data_stream.get_tokenizer(None, corpus)
        net = model.model_from(model.new_architecture(size, len(tokenizer), 128, tokenizer.pad_token_id), "nsp", 0.1)
        net.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


# run in a process of its own: side "stock" swaps model.classify for the stock forward
WORKER = """
import sys, torch
sys.path.insert(0, {root!r})
import finetune
finetune.bag_of_words = lambda task, args: None  # the reference's fits are not the forward measured here
if {side!r} == "stock":
    finetune.classify = lambda m, input_ids, token_type_ids, attention_mask, pooling="cls": m(
        input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).logits
finetune.main({argv!r})
"""


def run(side, folder, task, args, out):
    argv = [folder, "--task", task, "--random-init", "--seeds", "0,", "--out", out, "--threads", str(args.threads)]
    if args.max_train:
        argv += ["--max-train", str(args.max_train)]
    # the process's CPU seconds (start-up and the test set included), which a loaded machine moves far less
    done, cpu = common.run_counting_cpu([sys.executable, "-c", WORKER.format(root=ROOT, side=side, argv=argv)],
                                        capture_output=True, text=True, cwd=ROOT,
                                        env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if done.returncode:
        sys.exit(f"finetune.py failed ({side}, {task}):\n{done.stderr[-3000:]}")
    with open(out) as f:
        seed = json.load(f)["seeds"][0]
    return seed["seconds"], cpu, seed["accuracy"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--sizes", default="tiny,mini")
    p.add_argument("--tasks", default="polarity,r8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="OpenMP threads of each fine-tuning (1: its CPU seconds are the work)")
    p.add_argument("--max-train", type=int, default=None, help="for a smoke run")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "finetune_speed"))
    args = p.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    print("| size | task | model.classify: fine-tuning s, CPU s (accuracy) | stock: the same | stock / classify, CPU |")
    print("| --- | --- | --- | --- | --- |")
    for size in args.sizes.split(","):
        folder = model_folder(size, args.work_dir)
        for task in args.tasks.split(","):
            times = {"classify": [], "stock": []}
            cpus = {"classify": [], "stock": []}
            accuracy = {}
            for repeat in range(args.repeats):
                for side in ("classify", "stock") if repeat % 2 == 0 else ("stock", "classify"):
                    seconds, cpu, accuracy[side] = run(side, folder, task, args, os.path.join(
                        args.work_dir, f"{size}-{task}-{side}-{repeat}.json"))
                    times[side].append(seconds)
                    cpus[side].append(cpu)
            mean = {side: sum(t) / len(t) for side, t in cpus.items()}
            cells = [f"{' / '.join(f'{t:.0f}' for t in times[side])} s, {' / '.join(f'{t:.0f}' for t in cpus[side])} "
                     f"CPU s ({accuracy[side]:.3f})" for side in ("classify", "stock")]
            print(f"| {size} | {task} | {cells[0]} | {cells[1]} | {mean['stock'] / mean['classify']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
