"""
Predict how many samples and optimizer steps a corpus yields for given settings, before training,
by asking data_stream.py's own code (its reader, tokenizer call, plan_pairs and shard_documents),
never a re-implementation of sample creation.

    python estimate_steps.py                                     # builtin corpus, the defaults
    python estimate_steps.py --corpus my_texts/ --world-size 8 --num-workers 4 --batch-size 64 \
        --accum-steps 2 --epochs 3 --json

The trainer's rule, mirrored exactly:
- the stream is cut into world_size x num_workers shards (num_workers 0 means one per rank), shard
  rank * W + worker with W = max(num_workers, 1), each epoch by data_stream.shard_documents;
- every worker yields ceil(its samples / batch_size) micro-batches, the last one partial;
- an optimizer step needs accum_steps micro-batches on every rank, so an epoch has
  min over ranks of floor(micro-batches / accum_steps) steps; what the ranks hold beyond that is unused.

Two ways to count:
- exact: tokenize every document once; nsp sample counts are taken for every epoch, because the
  pairing RNG is keyed by (seed, epoch, document). Memory: a few numbers per document (x epochs).
- sample: tokenize --sample-docs random documents, scale up by bytes (ratio estimator, 95% interval)
  and simulate byte-balanced shards around the estimate (steps with a 95% interval).
- auto (default): exact under 50 MB of text and --sample-docs documents, else sample; the output says
  which one ran. Exact mode reads token ids from the token cache when they are there (seconds).

The trainer calls `estimate(stream, ...)` on rank 0 with its own BertPretrainStream. The LR plan
that the estimate steers lives here too (LRPlan, plan_of, lr_factor): the trainer keeps it in every
checkpoint and finetune.py schedules its fine-tuning with it, without importing the trainer.
"""

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass

import numpy as np

from data_stream import (
    CorpusError,
    Parser,
    add_data_args,
    check_versions,
    number,
    shard_documents,
    stream_from_args,
)

WARMUP = 0.06                # default --warmup of this script and of pretrain_ddp.py
DECAY = 0.2                  # default --decay (wsd: the share of the plan the LR decays over)
AUTO_EXACT_BYTES = 50_000_000  # auto mode counts exactly below this much text (~1 min of tokenizing)
SIMULATION_DRAWS = 1000      # sample mode: simulated epochs per estimate (percentiles need ~1000)
SHARD_EPOCHS = 16            # sample mode: epochs whose real shard sizes are computed (an O(documents) pass each)
SAMPLE_EPOCHS = 8            # sample mode, nsp: epochs counted per sampled document (their spread)
PROGRESS_SECONDS = 5.0       # how often long counts report on stderr


def warmup_steps(warmup, total_steps):
    """The trainer's warmup (one rule for both scripts): warmup x total steps, rounded, at least
    one step when warmup > 0, never more than the plan."""
    return min(total_steps, max(1, round(warmup * total_steps))) if warmup > 0 else 0


def decay_start(schedule, decay, warmup, total_steps):
    """Where the LR starts to fall (one rule for both scripts): linear and cosine right after the
    warmup, wsd (warmup-stable-decay) at the last `decay` of the plan, never inside the warmup."""
    return warmup if schedule != "wsd" else max(warmup, round(total_steps * (1 - decay)))


# ----------------------------------------------------------------------------- the LR plan the estimate steers

@dataclass(frozen=True)
class Budget:
    """How the trainer made a --budget plan; kept with the plan, so a resume never measures again."""
    seconds: float        # --budget
    step_s: float         # the time of a step with its share of eval, checkpoints and exports
    train_step_s: float   # the time of a training step alone
    calibration_s: float  # what the calibration took (counted in the budget)
    steps_fit: int        # the steps the budget holds
    limit: str            # "budget", or "epochs" when --epochs or --max-steps end the run first


@dataclass(frozen=True)
class LRPlan:
    """The learning rate's plan, made once (from the estimate, or --budget's calibration). Positions count
    steps at the planned effective batch: a resume on another world size advances by its share of it."""
    total: float          # planned steps: the LR is 0 there
    warmup: int           # steps of linear warmup
    batch: int            # the effective batch a position counts
    steps_per_epoch: float
    schedule: str = "linear"  # a plan from before --schedule is linear
    decay: float = DECAY
    decay_from: tuple = (0.0, 1.0)  # (position, factor): from there the LR decays from factor (wsd: stable before)
    budget: Budget | None = None

    @classmethod
    def from_dict(cls, plan):
        """A plan as a checkpoint's meta keeps it."""
        budget = Budget(**plan["budget"]) if plan.get("budget") else None
        return cls(**{**plan, "decay_from": tuple(plan["decay_from"]), "budget": budget})


def plan_of(total, steps_per_epoch, batch, warmup=WARMUP, schedule="linear", decay=DECAY, budget=None):
    """The plan of `total` steps: `warmup` (a fraction of them) of linear warmup, then from decay_from =
    (position, factor) down to 0 at the total (decay: wsd's share of the plan that decays)."""
    warmup = warmup_steps(warmup, total)
    return LRPlan(total, warmup, batch, steps_per_epoch, schedule, decay,
                  (decay_start(schedule, decay, warmup, total), 1.0), budget)


def lr_factor(plan, pos):
    """The LR plan at a position: linear warmup to 1; the factor of decay_from = (position, factor) until
    that position (wsd's stable phase), then down to 0 at the total: linear, or cosine."""
    if pos < plan.warmup:
        return (pos + 1) / plan.warmup
    start, factor = plan.decay_from
    done = min(max(pos - start, 0) / max(plan.total - start, 1), 1.0)
    if plan.schedule == "cosine":
        return factor * 0.5 * (1 + math.cos(math.pi * done))
    return factor * (1 - done)


# ----------------------------------------------------------------------------- command-line values

def duration(text):
    """An argparse type: a time with its unit (6h, 90m, 45s, 1h30m) -> seconds."""
    found = re.fullmatch(r"(?:(\d+(?:\.\d*)?)h)?(?:(\d+(?:\.\d*)?)m)?(?:(\d+(?:\.\d*)?)s)?", text.strip().lower())
    seconds = sum(float(v or 0) * unit for v, unit in zip(found.groups(), (3600, 60, 1), strict=True)) if found else 0
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time such as 6h, 90m, 45s or 1h30m")
    return seconds


def step_time(text):
    """An argparse type: seconds an optimizer step takes, or a run's summary.json (its steady steps/hour)."""
    if text.endswith(".json"):
        try:
            with open(text) as f:
                return 3600 / json.load(f)["steps_per_hour"]
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            raise argparse.ArgumentTypeError(f"{text} gives no steps_per_hour ({e})") from None
    return number(float, 0, low_open=True)(text)


def progress_printer(enabled, total, what):
    """A function to call with the count done so far; it prints to stderr every few seconds."""
    t0 = last = time.perf_counter()

    def tick(done):
        nonlocal last
        now = time.perf_counter()
        if enabled and now - last >= PROGRESS_SECONDS:
            last = now
            eta = (total - done) * (now - t0) / max(done, 1)
            print(f"estimate_steps: {what} {done:,}/{total:,} ({100 * done / total:.0f}%), "
                  f"{now - t0:.0f} s, about {eta:.0f} s left", file=sys.stderr, flush=True)
    return tick


def count_documents(stream, doc_ids, epochs, progress):
    """Per document: its sentences, its tokens, and its 'units' per epoch, the quantity that adds up
    over a shard. nsp: samples, exactly as the stream's pair_plans plans them (they differ by epoch);
    mlm: tokens plus the [SEP] that ends every document in the packed stream (the same every epoch)."""
    nsp = stream.settings.objective == "nsp"
    units = np.zeros((epochs if nsp else 1, len(doc_ids)), np.int32)
    sentences, tokens = np.zeros(len(doc_ids), np.int32), np.zeros(len(doc_ids), np.int32)
    tick = progress_printer(progress, len(doc_ids), "documents tokenized")
    for i, doc_id in enumerate(doc_ids.tolist()):
        seg_lens = stream.segment_lengths(doc_id)
        sentences[i], tokens[i] = len(seg_lens), int(seg_lens.sum())
        if nsp:
            for epoch in range(epochs):
                units[epoch, i] = len(stream.pair_plans(seg_lens, doc_id, epoch))
        else:
            units[0, i] = tokens[i] + 1
        tick(i + 1)
    return units, sentences, tokens


def shard_samples_of(units, objective, max_seq_len):
    """Units per shard -> samples per shard. mlm windows of max_seq_len - 2 tokens span chunks
    (data_stream.packed_windows), so only the shard's last window is partial."""
    return units if objective == "nsp" else -(-units // (max_seq_len - 2))


def batches_per_rank(samples_per_worker, batch_size):
    """Micro-batches one rank yields: each DataLoader worker ends with a partial batch."""
    return sum(-(-n // batch_size) for n in samples_per_worker)


def samples_in_first_batches(worker_samples, batch_size, k):
    """Samples in the first k micro-batches of one rank. DataLoader takes batches round-robin from
    its workers, skipping finished ones, so batch j of worker w comes in the order (j, w); each
    worker's last batch may be partial."""
    num_batches = [-(-n // batch_size) for n in worker_samples]
    total = k * batch_size
    for w, (n, nb) in enumerate(zip(worker_samples, num_batches, strict=True)):
        if n % batch_size:
            j = nb - 1  # the partial batch's round
            position = sum(min(j, x) for x in num_batches) + sum(x > j for x in num_batches[:w])
            if position < k:
                total -= batch_size - n % batch_size
    return total


def epoch_summary(shard_samples, world_size, batch_size, accum_steps):
    """One epoch's numbers from its exact per-shard sample counts (shard = rank * W + worker)."""
    per_rank = [[int(n) for n in row] for row in np.asarray(shard_samples).reshape(world_size, -1)]
    micro = [batches_per_rank(row, batch_size) for row in per_rank]
    steps = min(micro) // accum_steps
    used = sum(samples_in_first_batches(row, batch_size, steps * accum_steps) for row in per_rank)
    rank_samples = [sum(row) for row in per_rank]
    return {"samples": sum(rank_samples), "steps": steps,
            "samples_per_rank_min": min(rank_samples), "samples_per_rank_max": max(rank_samples),
            "micro_batches_per_rank_min": min(micro), "micro_batches_per_rank_max": max(micro),
            "unused_samples": sum(rank_samples) - used}


def ratio_total(y, x, x_total, population):
    """Ratio estimator of a total of y over `population` documents of x_total bytes, from a simple
    random sample of them with byte sizes x: x_total * sum(y) / sum(x), samples (or tokens) per
    byte scaled up. Returns it and its standard error (Cochran's, from the residuals y - ratio * x,
    with the finite-population correction: 0 when every document was read)."""
    y, x, n = np.asarray(y, float), np.asarray(x, float), len(y)
    if n == 0 or n == population:
        return float(y.sum()), 0.0
    ratio = y.sum() / x.sum()
    resid_sd = float(np.std(y - ratio * x, ddof=1))
    return float(ratio * x_total), population * math.sqrt((1 - n / population) / n) * resid_sd


def simulate_epochs(units_total, units_se, epoch_sd, shard_sd, shard_bytes, objective, max_seq_len, world_size,
                    batch_size, accum_steps, epochs, seed):
    """Sample mode's steps: epochs of shards around the estimated total.

    Each draw takes a corpus total from the estimate's error (the same for all its epochs); every
    epoch moves it by the documents' RNG (epoch_sd) and splits it by the shards' real byte sizes
    (shard_bytes, epochs x shards: shards are cut at documents, so a few huge documents unbalance
    them), and each shard is off its bytes' share by the documents it happens to hold (shard_sd for
    an average shard). The slowest rank, not the average one, decides an epoch's steps.
    """
    rng = np.random.default_rng([seed, 7])  # same answer every run
    draws, num_shards = SIMULATION_DRAWS, shard_bytes.shape[1]
    totals = rng.normal(units_total, units_se, draws)
    out = {k: np.zeros((draws, epochs)) for k in ("samples", "steps", "samples_per_rank_min", "samples_per_rank_max",
                                                  "micro_batches_per_rank_min", "micro_batches_per_rank_max",
                                                  "unused_samples")}
    for epoch in range(epochs):
        share = shard_bytes[epoch % len(shard_bytes)] / shard_bytes[0].sum()
        epoch_totals = totals + rng.normal(0.0, epoch_sd, draws)
        noise = rng.normal(0.0, shard_sd, (draws, num_shards)) * np.sqrt(share * num_shards)
        noise -= noise.mean(1, keepdims=True)  # the shards share the epoch's total
        units = np.maximum(np.rint(epoch_totals[:, None] * share + noise), 0).astype(np.int64)
        per_rank = shard_samples_of(units, objective, max_seq_len).reshape(draws, world_size, -1)
        micro = (-(-per_rank // batch_size)).sum(2)
        steps = micro.min(1) // accum_steps
        rank_samples = per_rank.sum(2)
        # Treats the consumed micro-batches as full: off by under one batch per worker of a rank.
        used = np.minimum(rank_samples, (steps * accum_steps * batch_size)[:, None]).sum(1)
        for key, value in (("samples", rank_samples.sum(1)), ("steps", steps),
                           ("samples_per_rank_min", rank_samples.min(1)), ("samples_per_rank_max", rank_samples.max(1)),
                           ("micro_batches_per_rank_min", micro.min(1)), ("micro_batches_per_rank_max", micro.max(1)),
                           ("unused_samples", rank_samples.sum(1) - used)):
            out[key][:, epoch] = value
    return out


def exact_counts(stream, world_size, num_workers, batch_size, accum_steps, epochs, progress):
    """Every document tokenized once; every epoch's shards summed exactly."""
    doc_bytes = stream.corpus.doc_bytes()
    num_shards = world_size * max(num_workers, 1)
    units, sentences, tokens = count_documents(stream, np.arange(stream.num_docs), epochs, progress)
    per_epoch = []
    for epoch in range(epochs):
        shards = shard_documents(doc_bytes, stream.settings.seed, epoch, num_shards, stream.settings.shuffle)
        u = units[epoch if stream.settings.objective == "nsp" else 0]
        shard_units = np.array([u[s].sum(dtype=np.int64) for s in shards])
        shard_samples = shard_samples_of(shard_units, stream.settings.objective, stream.settings.max_seq_len)
        per_epoch.append({"epoch": epoch, **epoch_summary(shard_samples, world_size, batch_size, accum_steps)})
    first, total_steps = per_epoch[0], sum(e["steps"] for e in per_epoch)
    return {"sentences": int(sentences.sum(dtype=np.int64)), "tokens": int(tokens.sum(dtype=np.int64)),
            "docs_read": stream.num_docs,
            **{k: v for k, v in first.items() if k not in ("epoch", "samples", "steps")},
            "samples_per_epoch": first["samples"], "samples_per_epoch_ci": [first["samples"]] * 2,
            "steps_per_epoch": first["steps"], "steps_per_epoch_ci": [first["steps"]] * 2,
            "total_steps": total_steps, "total_steps_ci": [total_steps] * 2, "per_epoch": per_epoch}


def sample_counts(stream, world_size, num_workers, batch_size, accum_steps, epochs, sample_docs, progress):
    """sample_docs documents tokenized, scaled up to the corpus by bytes, steps simulated.

    The sample_docs // 10 largest documents are always read: a corpus's few huge documents (a book
    among articles) would otherwise dominate the error, and its estimate, whenever they are missed or
    hit. The rest of the budget is a seeded uniform sample of the other documents, from every file.
    """
    doc_bytes = stream.corpus.doc_bytes()
    num_docs, num_shards = len(doc_bytes), world_size * max(num_workers, 1)
    by_size = np.argsort(doc_bytes, kind="stable")
    cut = num_docs - min(sample_docs // 10, num_docs)
    largest, rest = by_size[cut:], by_size[:cut]
    rng = np.random.default_rng([stream.settings.seed, 5])
    drawn = rng.choice(rest, min(sample_docs - len(largest), len(rest)), replace=False)
    ids = np.sort(np.concatenate([largest, drawn]))  # sorted: every file is read front to back, not by seeks
    is_largest = np.isin(ids, largest)
    rest_bytes, x = int(doc_bytes[rest].sum()), doc_bytes[ids]
    # nsp: each sampled document is counted over several epochs' RNG, which averages out its
    # luck (a short target length on a long document makes many samples) and measures it.
    units, sentences, tokens = count_documents(stream, ids, SAMPLE_EPOCHS, progress)

    def total(y):  # the largest documents exactly, the rest by the ratio estimator
        est, se = ratio_total(y[~is_largest], x[~is_largest], rest_bytes, len(rest))
        return float(y[is_largest].sum()) + est, se

    def sum_over_corpus(v):  # of a per-document quantity: the largest exactly, the rest scaled by count
        return float(v[is_largest].sum()) + (len(rest) * float(v[~is_largest].mean()) if len(rest) else 0.0)

    units_total, units_se = total(units.mean(0))  # an epoch's expected units
    # An epoch's total moves by the sum of the documents' epoch-to-epoch variances; a shard's share
    # by the documents it holds, each off its bytes' share by one epoch's residual.
    epoch_var = sum_over_corpus(units.var(0, ddof=1)) if len(units) > 1 else 0.0
    shard_var = sum_over_corpus(((units - units_total / doc_bytes.sum() * x) ** 2).mean(0)) / num_shards
    # Shard sizes need only the index; past SHARD_EPOCHS epochs they repeat (their spread is what matters).
    settings = stream.settings
    shard_bytes = np.array([[doc_bytes[s].sum() for s in shard_documents(doc_bytes, settings.seed, epoch, num_shards,
                                                                         settings.shuffle)]
                            for epoch in range(min(epochs, SHARD_EPOCHS))], float)
    sim = simulate_epochs(units_total, units_se, math.sqrt(epoch_var), math.sqrt(shard_var), shard_bytes,
                          settings.objective, settings.max_seq_len, world_size, batch_size, accum_steps, epochs,
                          settings.seed)
    totals = sim["steps"].sum(1)

    def mid(v):
        return int(np.median(v))

    def ci(v):
        return [float(q) for q in np.percentile(v, [2.5, 97.5])]

    return {"sentences": round(total(sentences)[0]), "tokens": round(total(tokens)[0]), "docs_read": len(ids),
            **{k: mid(v) for k, v in sim.items() if k not in ("samples", "steps")},
            "samples_per_epoch": mid(sim["samples"]), "samples_per_epoch_ci": ci(sim["samples"]),
            "steps_per_epoch": mid(sim["steps"]), "steps_per_epoch_ci": ci(sim["steps"]),
            "total_steps": mid(totals), "total_steps_ci": ci(totals), "per_epoch": None}


def estimate(stream, world_size, num_workers, batch_size, accum_steps, epochs, mode="auto", warmup=0.0,
             sample_docs=10000, progress=False, schedule="linear", decay=DECAY):
    """Samples and optimizer steps that `stream` (a BertPretrainStream: its corpus, tokenizer,
    objective, max_seq_len, seed, short_seq_prob, shuffle; not its batch_size or rank) yields when
    trained with these settings. Returns a JSON-serialisable dict.

    `*_per_epoch` and the per-rank values are epoch 0's in exact mode (`per_epoch` lists every
    epoch) and an epoch's median in sample mode; `*_ci` are 95% intervals (one point in exact mode).
    warmup_steps and decay_start are what pretrain_ddp.py will plan for these settings.
    """
    t0 = time.perf_counter()
    num_docs, total_bytes = stream.num_docs, int(stream.corpus.doc_bytes().sum())
    num_shards = world_size * max(num_workers, 1)
    if mode == "auto":
        mode = "exact" if total_bytes < AUTO_EXACT_BYTES and num_docs <= sample_docs else "sample"
        reason = (f"auto: {total_bytes / 1e6:.1f} MB of text, {num_docs:,} documents; "
                  f"exact below {AUTO_EXACT_BYTES / 1e6:.0f} MB and {sample_docs:,} documents")
    else:
        reason = f"--mode {mode}"
    if stream.cache is not None:  # counting from cached ids takes seconds; what it tokenizes is cached
        stream.cache.refresh(stream.num_docs)
    try:
        if mode == "exact":
            result = exact_counts(stream, world_size, num_workers, batch_size, accum_steps, epochs, progress)
        else:
            result = sample_counts(stream, world_size, num_workers, batch_size, accum_steps, epochs, sample_docs,
                                   progress)
    finally:
        stream.flush_cache()
    note = None
    epoch_steps = [e["steps"] for e in result["per_epoch"]] if result["per_epoch"] else [result["steps_per_epoch"]]
    if min(epoch_steps) == 0:
        if result["samples_per_rank_min"] == 0:
            why = (f"a rank gets no samples ({num_docs:,} documents over {num_shards} shards = "
                   f"ranks x workers): use fewer ranks/workers or a bigger corpus")
        else:
            why = (f"the smallest rank gets {result['micro_batches_per_rank_min']:,} micro-batch(es) "
                   f"({result['samples_per_rank_min']:,} samples), fewer than --accum-steps {accum_steps}: "
                   f"lower --batch-size, --accum-steps or --world-size")
        note = f"0 optimizer steps in an epoch: {why}"
    return {"mode": mode, "mode_reason": reason, "seconds": round(time.perf_counter() - t0, 2),
            "files": len(stream.corpus.files), "documents": num_docs, "bytes": total_bytes,
            "objective": stream.settings.objective, "max_seq_len": stream.settings.max_seq_len,
            "world_size": world_size,
            "num_workers": num_workers, "num_shards": num_shards, "batch_size": batch_size,
            "accum_steps": accum_steps, "epochs": epochs, **result,
            "warmup": warmup, "warmup_steps": (w := warmup_steps(warmup, result["total_steps"])), "schedule": schedule,
            "decay_start": decay_start(schedule, decay, w, result["total_steps"]), "note": note}


def format_report(r):
    """The human-readable table of an estimate() result."""
    def num(v):
        return f"{v:,.0f}"

    def extra(key, ci_key=None):
        if r["mode"] == "sample" and ci_key:
            lo, hi = r[ci_key]
            return f"95% interval {num(lo)} .. {num(hi)}"
        if r["per_epoch"] and r["epochs"] > 1:
            values = [e[key] for e in r["per_epoch"]]
            return f"epochs 0-{r['epochs'] - 1}: {num(min(values))} .. {num(max(values))}"
        return ""

    approx = "~" if r["mode"] == "sample" else ""
    sampled = f", {r['docs_read']:,} documents read" if r["mode"] == "sample" else ""
    lines = [f"{label:<32}{text}" for label, text in (
        ("mode", f"{r['mode']} ({r['mode_reason']}{sampled}), {r['seconds']:.1f} s"),
        ("corpus", f"{r['files']} file(s), {r['documents']:,} documents, {r['bytes'] / 1e6:.1f} MB, "
                   f"{approx}{r['sentences']:,} sentences, {approx}{r['tokens']:,} tokens"),
        ("setting", f"{r['objective']}, max_seq_len {r['max_seq_len']}, {r['world_size']} rank(s) x "
                    f"{r['num_workers']} worker(s) = {r['num_shards']} shard(s), batch {r['batch_size']}/rank, "
                    f"accum {r['accum_steps']}, {r['epochs']} epoch(s)"))]
    rows = [
        ("samples per epoch", num(r["samples_per_epoch"]), extra("samples", "samples_per_epoch_ci")),
        ("samples per rank min/max", f"{num(r['samples_per_rank_min'])} / {num(r['samples_per_rank_max'])}",
         extra("samples_per_rank_min")),
        ("micro-batches per rank min/max",
         f"{num(r['micro_batches_per_rank_min'])} / {num(r['micro_batches_per_rank_max'])}",
         extra("micro_batches_per_rank_min")),
        ("optimizer steps per epoch", num(r["steps_per_epoch"]), extra("steps", "steps_per_epoch_ci")),
        ("total steps", num(r["total_steps"]), extra(None, "total_steps_ci") if r["mode"] == "sample" else ""),
        ("warmup steps", num(r["warmup_steps"]), f"{r['warmup']} x total steps, as pretrain_ddp.py plans it"),
        ("LR decays from step", num(r["decay_start"]), f"{r['schedule']}: to 0 at the last step"),
        ("unused samples per epoch", num(r["unused_samples"]), extra("unused_samples")),
    ]
    lines += [f"{label:<32}{value:>17}  {more}".rstrip() for label, value, more in rows]
    if r["mode"] == "exact" and r["epochs"] > 1:
        lines.append("(per-epoch rows are epoch 0; the right column is the range over epochs)")
    if r["note"]:
        lines.append(f"note: {r['note']}")
    if r.get("time"):
        t = r["time"]
        lines.append(f"{'time':<32}{hours(t['epochs_seconds']):>17}  {r['total_steps']:,} steps x "
                     f"{t['step_seconds']:.3g} s (training only: no eval, saves or start-up)")
        if t["budget_seconds"]:
            lines.append(f"{'steps in --budget ' + hours(t['budget_seconds']):<32}{num(t['budget_steps']):>17}  "
                         + ("the budget ends the run" if t["limit"] == "budget" else
                            f"--epochs {r['epochs']} ends the run first, after {hours(t['epochs_seconds'])}"))
    return "\n".join(lines)


def time_answer(total_steps, step_seconds, budget_seconds):
    """How long the steps take at step_seconds a step; with a budget, the steps it holds and which ends first."""
    budget_steps = int(budget_seconds // step_seconds) if budget_seconds else None
    return {"step_seconds": step_seconds, "epochs_seconds": total_steps * step_seconds,
            "budget_seconds": budget_seconds, "budget_steps": budget_steps,
            "limit": None if budget_steps is None else "budget" if budget_steps < total_steps else "epochs"}


def hours(seconds):
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m{seconds % 60:02.0f}s"


def main(argv=None):
    parser = Parser(prog="estimate_steps.py",
                    description="Predict the samples and optimizer steps of a pretraining run.",
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_data_args(parser)
    run = parser.add_argument_group("the run (as pretrain_ddp.py takes it)")
    run.add_argument("--batch-size", type=number(int, 1), default=16,
                     help="samples per micro-batch, per rank (pretrain_ddp.py's default)")
    run.add_argument("--accum-steps", type=number(int, 1), default=1, help="micro-batches per optimizer step")
    run.add_argument("--world-size", type=number(int, 1), default=1, help="DDP ranks")
    run.add_argument("--num-workers", type=number(int, 0), default=1,
                     help="DataLoader workers per rank (0: one shard/rank)")
    run.add_argument("--epochs", type=number(int, 1), default=1, help="passes over the corpus")
    run.add_argument("--warmup", type=number(float, 0, 1), default=WARMUP,
                     help="warmup as a fraction of the total steps")
    run.add_argument("--schedule", default="linear", choices=["linear", "cosine", "wsd"],
                     help="the LR after warmup (see pretrain_ddp.py --help)")
    run.add_argument("--decay", type=number(float, 0, 1, low_open=True), default=DECAY,
                     help="wsd: the last fraction of the steps, over which the LR decays")
    run.add_argument("--step-time", type=step_time, default=None, metavar="SECONDS|SUMMARY_JSON",
                     help="seconds an optimizer step takes (or a run's summary.json: its steady steps/hour): "
                          "prints how long the steps take")
    run.add_argument("--budget", type=duration, default=None, metavar="TIME",
                     help="with --step-time: how many steps fit in this time (6h, 90m, 45s), and which limit "
                          "ends the run, the budget or --epochs")
    parser.add_argument("--mode", default="auto", choices=["auto", "exact", "sample"],
                        help=f"exact: tokenize everything; sample: scale up --sample-docs documents; "
                             f"auto: exact below {AUTO_EXACT_BYTES / 1e6:.0f} MB of text and --sample-docs documents")
    parser.add_argument("--sample-docs", type=number(int, 2), default=10000,
                        help="documents that sample mode reads (a variance needs two)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    check_versions("estimate_steps.py")
    if args.budget and not args.step_time:
        parser.error("--budget needs --step-time: the seconds a step takes, or a run's summary.json")
    try:
        stream = stream_from_args(args, rank=0, world_size=args.world_size)
        result = estimate(stream, args.world_size, args.num_workers, args.batch_size, args.accum_steps, args.epochs,
                          mode=args.mode, warmup=args.warmup, sample_docs=args.sample_docs, progress=True,
                          schedule=args.schedule, decay=args.decay)
    except CorpusError as e:
        sys.exit(f"estimate_steps.py: error: {e}")
    if args.step_time:
        result["time"] = time_answer(result["total_steps"], args.step_time, args.budget)
    print(json.dumps(result, indent=2) if args.json else format_report(result))


if __name__ == "__main__":
    main()
