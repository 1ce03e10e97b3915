"""
The out dir of pretrain_ddp.py on disk: its lock, its checkpoint folders and its Hugging Face export, and the other
weights a run can start from (--init-from). The trainer decides when to save, what every rank puts in and how a
run resumes; this file keeps the folders' guarantees: a save is atomic (a crash or a full disk never costs a
complete checkpoint), a load is checked against the checksums and never runs pickled code, `latest` names the
timeline. finetune.py reads checkpoints through it too.

    <out>/.lock                                   held by the job's rank 0 while it lives
    <out>/checkpoints/step_000400/trainer.pt      weights (a Hugging Face BertForPreTraining's, or model.ElectraPair's),
                                                  optimizer, loss scale
    <out>/checkpoints/step_000400/ranks.pt        every rank's RNG states and data cursor
    <out>/checkpoints/step_000400/manifest.json   meta (progress, LR plan, config), the files' sha256s; written last
    <out>/checkpoints/latest                      the name of the newest checkpoint of the run's timeline
    <out>/checkpoints/abandoned/                  checkpoints off the timeline (a rollback, a failed one), kept
    <out>/hf/                                     config.json, model.safetensors and the tokenizer
    <out>/hf/generator/                           electra: the generator, the same files

A mistake the user must fix is raised as CheckpointError, in one line.
"""
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import socket
import sys
import time

import torch

import data_stream
from model import model_from, new_architecture


class CheckpointError(Exception):
    """A checkpoint or weights folder the user named cannot be used, or the out dir is busy: one line."""


def fail(message):
    raise CheckpointError(message)


def warn(line):
    print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the out dir's lock

OUT_DIR_LOCK = {}  # rank 0's open lock file of each out dir it runs in (lock_out_dir)


def lock_out_dir(out_dir):
    """Rank 0 holds an exclusive flock on <out>/.lock while it lives: a second job into the out dir (a Slurm
    requeue beside the running job) stops before it resumes anything. The kernel drops the lock when the
    process dies, SIGKILL included: never stale (NFSv4 has flock; where it fails, a warning)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        fail(f"--out-dir {out_dir} is a file; give a directory")
    os.makedirs(out_dir, exist_ok=True)
    if os.path.realpath(out_dir) in OUT_DIR_LOCK:  # main() run again by this process (tests)
        return
    f = open(os.path.join(out_dir, ".lock"), "a+")  # kept open (OUT_DIR_LOCK): closing it would unlock
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        fail(f"--out-dir {out_dir} is in use by another job ({f.read().strip() or 'holder unknown'}): let it "
             "finish or stop it, or give another --out-dir")
    except OSError as e:
        warn(f"warning: --out-dir {out_dir} cannot be locked ({e.strerror}): nothing stops a second job from "
             "writing into it")
    f.truncate(0)
    f.write(f"held by host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    OUT_DIR_LOCK[os.path.realpath(out_dir)] = f


# ----------------------------------------------------------------------------- the folders' names
# Named here only: the trainer, finetune.py, the tests and bench/ build and parse them with these three.

def step_name(step):
    """The name of the checkpoint folder of a step: step_000400."""
    return f"step_{step:06d}"


def step_of(name):
    """The step a checkpoint folder's name holds (step_000400: 400), None if the name is not one."""
    digits = name.removeprefix("step_")
    return int(digits) if digits != name and digits.isdecimal() else None


def step_folders(root):
    """{step: folder name} of the checkpoint folders in root (none if root is missing)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return {step: d for d in names if (step := step_of(d)) is not None}


# ----------------------------------------------------------------------------- writing a checkpoint

def save_checkpoint(root, step, files, meta, keep_last):
    """Write {name: object} atomically as root/step_<step>; keep the newest keep_last complete ones."""
    name = step_name(step)
    tmp = os.path.join(root, f".tmp-{name}")
    final = os.path.join(root, name)
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crash during an earlier save
    os.makedirs(tmp)
    try:
        for file_name, obj in files.items():
            _write(os.path.join(tmp, file_name), lambda f, obj=obj: torch.save(obj, f))
        manifest = {"meta": meta, "sha256": {f: _sha256(os.path.join(tmp, f)) for f in files}}
        _write(os.path.join(tmp, "manifest.json"), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(tmp)
    except BaseException:  # e.g. the disk is full: no half-written folder stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # The pointer moves first: a crash before the rename leaves it naming a missing step, and --resume auto
    # takes the newest complete one below it (moved after, the new checkpoint would look abandoned)
    point_latest(root, name)
    if os.path.exists(final):  # the same step saved twice (e.g. a resumed run's final save)
        old = os.path.join(root, f".old-{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)  # a crash before the next rename leaves only .old-: choose_checkpoint restores it
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    steps = step_folders(root)
    for old in sorted(steps)[:-keep_last]:
        shutil.rmtree(os.path.join(root, steps[old]), ignore_errors=True)
    return final


def _write(path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def point_latest(root, name):
    data_stream.atomic_write(os.path.join(root, "latest"), lambda f: f.write(name.encode()))


def nbytes(obj):
    """Bytes of the tensors in a (nested) state dict: about what its checkpoint file takes."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(nbytes(v) for v in values)


# ----------------------------------------------------------------------------- finding and reading one

def read_latest(root):
    """The name of the checkpoint that root/latest points to ('step_000400'), None if none."""
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().strip()
    except OSError:
        return None
    return name if step_of(name) is not None else None


def read_checkpoint(path):
    """The checkpoint's meta and files, or a one-line reason why it cannot be used."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        for file_name, digest in manifest["sha256"].items():
            if _sha256(os.path.join(path, file_name)) != digest:
                return None, f"{file_name} does not match its checksum"
        files = {f: torch.load(os.path.join(path, f), map_location="cpu", weights_only=True)
                 for f in manifest["sha256"]}
    except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as e:
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__
    return {"meta": manifest["meta"], "sha256": manifest["sha256"], **files}, None


def choose_checkpoint(root, resume, overwrite):
    """Rank 0's choice: (path, checkpoint) to resume, or (None, None). `latest` names the timeline: a
    step_* newer than the checkpoint resumed (abandoned by a rollback to an older step, or damaged) goes
    to checkpoints/abandoned/ with a warning, never resumed nor counted by --keep-last. resume: "auto",
    "none" or a checkpoint folder (--resume); overwrite: --overwrite."""
    for d in os.listdir(root) if os.path.isdir(root) else []:
        name = d.removeprefix(".old-")
        if name != d and step_of(name) is not None:  # a re-save crashed between its renames (save_checkpoint)
            if os.path.isdir(os.path.join(root, name)):
                shutil.rmtree(os.path.join(root, d))
            else:
                os.rename(os.path.join(root, d), os.path.join(root, name))
    steps = step_folders(root)
    if resume == "none":
        if steps and not overwrite:
            fail(f"--out-dir {os.path.dirname(root)} holds checkpoints: --resume auto continues from them, "
                 "--overwrite deletes them, or choose another --out-dir")
        return None, None
    path = None
    loaded = None
    if resume == "auto":
        latest = read_latest(root)
        newest = step_of(latest) if latest else None
        for s in sorted((s for s in steps if newest is None or s <= newest), reverse=True):
            loaded, problem = read_checkpoint(os.path.join(root, steps[s]))
            if loaded is not None:
                path = os.path.join(root, steps[s])
                break
            warn(f"warning: checkpoint {os.path.join(root, steps[s])} is damaged ({problem}); trying an older one")
        newest = loaded["meta"]["step"] if loaded else newest
    else:
        path = resume
        if not os.path.isdir(path):
            fail(f"--resume {path} is not a checkpoint folder (or auto, none)")
        loaded, problem = read_checkpoint(path)
        if loaded is None:
            fail(f"--resume {path} cannot be used: {problem}")
        newest = loaded["meta"]["step"]
    abandoned = sorted(s for s in steps if newest is not None and s > newest)
    for s in abandoned:
        set_aside(root, steps[s])
    if abandoned:
        warn(f"warning: checkpoint(s) of step {', '.join(map(str, abandoned))} are newer than the timeline "
             f"resumed here (step {newest}); moved to {os.path.join(root, 'abandoned')}")
    if path is not None and os.path.realpath(os.path.dirname(path)) == os.path.realpath(root):
        point_latest(root, os.path.basename(os.path.normpath(path)))
    return path, loaded


def set_aside(root, name):
    """Move root/name to root/abandoned/name (replacing one there): out of the timeline and of --keep-last's
    count, kept for a look. Returns where it went."""
    aside = os.path.join(root, "abandoned", name)
    shutil.rmtree(aside, ignore_errors=True)
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    os.rename(os.path.join(root, name), aside)
    return aside


def abandon(root, path):
    """Rank 0: move a checkpoint whose weights failed aside (checkpoints/abandoned/), `latest` to the one
    before it; returns the line that says so."""
    aside = set_aside(root, os.path.basename(path))
    older = step_folders(root)
    if not older:
        os.remove(os.path.join(root, "latest"))
        return f"it is moved to {aside}"
    newest = older[max(older)]
    point_latest(root, newest)
    return f"it is moved to {aside}; a re-run resumes {os.path.join(root, newest)}"


# ----------------------------------------------------------------------------- --init-from: weights only
# BERT's phase 2 and continued pretraining start from trained weights with a new optimizer, LR plan and
# step 0, in the source's shape; a head the source lacks starts fresh, seeded (the same on every rank).

HEADS = ("cls.", "bert.pooler.")


def init_source(path):
    """(kind, folder, its tokenizer folder or None) named by --init-from PATH; kind: checkpoint or hf."""
    latest = read_latest(os.path.join(path, "checkpoints"))
    if latest:  # a run's out dir
        path = os.path.join(path, "checkpoints", latest)
    elif os.path.isfile(os.path.join(path, "hf", "config.json")):  # a run's out dir without checkpoints
        path = os.path.join(path, "hf")
    if os.path.isfile(os.path.join(path, "manifest.json")):
        tokenizer = os.path.join(os.path.dirname(os.path.dirname(os.path.normpath(path))), "tokenizer")
        return "checkpoint", path, tokenizer if os.path.isdir(tokenizer) else None
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            with open(os.path.join(path, "config.json")) as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            fail(f"--init-from {path}: its config.json cannot be read ({e})")
        if model_type not in FAMILIES:
            fail(f"--init-from {path} holds a {model_type} model; this script trains BERT, ELECTRA and ModernBERT "
                 "(model_type bert, electra or modernbert)")
        has_tokenizer = any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "vocab.txt"))
        return "hf", path, path if has_tokenizer else None
    fail(f"--init-from {path} is not a checkpoint folder, a run's out dir or a Hugging Face BERT folder "
         "(config.json + weights)")


FAMILIES = {"bert": "a BERT", "electra": "an ELECTRA", "modernbert": "a ModernBERT"}


def source_family(kind, folder):
    """What --init-from's folder (kind as init_source says) holds: bert, electra (a checkpoint of an electra run,
    or an hf folder of model_type electra) or modernbert; None where its files cannot tell (loading them says
    why)."""
    try:
        if kind == "checkpoint":
            with open(os.path.join(folder, "manifest.json")) as f:
                config = json.load(f)["meta"]["config"]
            return "electra" if config["objective"] == "electra" else config["architecture"].get("arch", "bert")
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)["model_type"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def check_family(kind, folder, objective, arch):
    """One line and exit when --init-from's model is not what --objective and --arch train (arch None: the
    source's); returns the arch to train."""
    family = source_family(kind, folder)
    source_arch = "modernbert" if family == "modernbert" and objective == "mlm" else "bert"  # ModernBERT: mlm only
    wanted = "electra" if objective == "electra" else arch or source_arch
    if family not in (None, wanted):
        flags = f"--objective {objective}" + (f" --arch {arch}" if arch else "")
        give = {"electra": "--objective electra", "bert": "--objective mlm or nsp (--arch bert)",
                "modernbert": "--arch modernbert --objective mlm"}[family]
        fail(f"--init-from {folder} holds {FAMILIES[family]} model, which {flags} cannot start from: give {give}, "
             "or --init-from a run of these flags")
    return "modernbert" if wanted == "modernbert" else "bert"


def load_init(kind, folder, objective, seed, arch=None):
    """The source's weights as this run's model holds them: (state_dict, architecture, notes)."""
    from transformers import BertForMaskedLM, BertForPreTraining, ModernBertForMaskedLM
    from transformers.utils import logging as hf_logging
    torch.manual_seed(seed)  # fresh heads: the same on every rank
    arch = check_family(kind, folder, objective, arch)
    if kind == "checkpoint":
        loaded, problem = read_checkpoint(folder)
        if loaded is None:
            fail(f"--init-from {folder} cannot be used: {problem}")
        architecture = loaded["meta"]["config"]["architecture"]
        model = model_from(architecture, objective, 0.0)
        missing, unexpected = model.load_state_dict(loaded["trainer.pt"]["model"], strict=False)
        if objective == "electra":
            return model.state_dict(), architecture, []
    elif objective == "electra":
        return electra_init(folder)
    else:
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report: the notes below say what matters, in one line
        hf_logging.disable_progress_bar()
        model_class = ModernBertForMaskedLM if arch == "modernbert" else \
            BertForPreTraining if objective == "nsp" else BertForMaskedLM
        try:
            model, info = model_class.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
        except (OSError, ValueError) as e:
            fail(f"--init-from {folder} cannot be loaded: {str(e).strip().splitlines()[0]}")
        finally:
            hf_logging.set_verbosity(verbosity)
        missing, unexpected = info["missing_keys"], info["unexpected_keys"]
        # what a run's config keeps: the fields a fresh model of the same family sets, and those that shape its math
        keep = set(new_architecture("tiny", 1, 1, 0, arch=arch)) | {
            "hidden_act", "type_vocab_size", "layer_norm_eps", "initializer_range", "position_embedding_type",
            "hidden_activation", "norm_eps", "norm_bias", "attention_bias", "mlp_bias", "decoder_bias",
            "classifier_activation", "layer_types", "rope_parameters"}
        architecture = {k: v for k, v in model.config.to_dict().items() if k in keep}
        if arch == "modernbert":
            architecture["arch"] = "modernbert"
    heads = ("head.", "decoder.") if arch == "modernbert" else HEADS
    body = sorted(k for k in missing if not k.startswith(heads))
    if body:
        fail(f"--init-from {folder} lacks {len(body)} weights of the model's body (e.g. {body[0]}); is it "
             f"{FAMILIES[arch]} model?")
    notes = []
    if any(k.startswith("cls.predictions.transform") for k in missing):
        notes.append("the MLM head starts fresh (the source has none)")
    if any(k.startswith(("cls.seq_relationship", "bert.pooler")) for k in missing):
        notes.append("the NSP head starts fresh (the source trained without NSP)")
    if any(k.startswith(("cls.seq_relationship", "pooler", "bert.pooler")) for k in unexpected):
        notes.append("its NSP head is left out (--objective mlm)")
    return model.state_dict(), architecture, notes


def electra_init(folder):
    """(state_dict, architecture, notes) of an ELECTRA hf folder: the discriminator in it, the generator in its
    generator/ (a run's export), one model.ElectraPair: the two share the discriminator's embeddings."""
    from transformers import ElectraForMaskedLM, ElectraForPreTraining
    from transformers.utils import logging as hf_logging
    if not os.path.isfile(os.path.join(folder, "generator", "config.json")):
        fail(f"--init-from {folder} has no generator/ beside its discriminator: --objective electra continues "
             "from a run's hf folder (or checkpoint), which holds both")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        generator = ElectraForMaskedLM.from_pretrained(os.path.join(folder, "generator"), dtype=torch.float32)
        discriminator = ElectraForPreTraining.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError) as e:
        fail(f"--init-from {folder} cannot be loaded: {str(e).strip().splitlines()[0]}")
    finally:
        hf_logging.set_verbosity(verbosity)
    disc, gen = discriminator.config, generator.config
    if (gen.embedding_size, gen.vocab_size) != (disc.embedding_size, disc.vocab_size):
        fail(f"--init-from {folder}: its generator's embeddings ({gen.vocab_size} x {gen.embedding_size}) are not "
             f"its discriminator's ({disc.vocab_size} x {disc.embedding_size}), which the two share here")
    if gen.hidden_size > disc.hidden_size:
        fail(f"--init-from {folder}: its generator ({gen.hidden_size} wide) is wider than its discriminator "
             f"({disc.hidden_size}); ELECTRA trains a generator of 1/4 to 1/2 of the width")
    keep = set(new_architecture("tiny", 1, 1, 0, 0.25)) | {"hidden_act", "type_vocab_size", "layer_norm_eps",
                                                            "initializer_range"}
    architecture = {k: v for k, v in disc.to_dict().items() if k in keep and k != "generator"}
    architecture["generator"] = {k: getattr(gen, k) for k in ("hidden_size", "num_attention_heads",
                                                               "intermediate_size", "num_hidden_layers")}
    pair = model_from(architecture, "electra", 0.0)
    pair.generator.load_state_dict(generator.state_dict())
    pair.discriminator.load_state_dict(discriminator.state_dict())  # last: the shared embeddings are its own
    return pair.state_dict(), architecture, []


# ----------------------------------------------------------------------------- the Hugging Face export

def export_hf(hf_model, tokenizer, out_dir):
    """A Hugging Face folder (safetensors + tokenizer), written aside and renamed into place. Returns
    None, or the one line saying why it could not be written (a full disk: the old folder stays)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    def write(folder):
        hf_model.save_pretrained(folder, safe_serialization=True)
        for model_folder in (folder, os.path.join(folder, "generator")):  # electra's generator: its own folder
            if os.path.isdir(model_folder):
                tokenizer.save_pretrained(model_folder)
    final = os.path.join(out_dir, "hf")
    return data_stream.try_write(lambda: replace_folder(final, write), f"the Hugging Face export {final}", out_dir,
                                 nbytes(hf_model.state_dict()))


def replace_folder(final, write):
    """write(folder) into a temporary folder beside final, then put in its place: never a half-written
    folder (for an instant, none: a checkpoint's save has its own steps for that)."""
    tmp = os.path.join(os.path.dirname(final), ".tmp-" + os.path.basename(final))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except BaseException:  # e.g. a full disk: the old folder stays, no half-written one
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
