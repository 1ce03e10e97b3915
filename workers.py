"""
The trainer's DataLoader workers: started from a forkserver (never forked from a process that runs threads) and
ended with their trainer, whatever ends it. data_stream.py's stream needs none of this: a plain
`DataLoader(stream, batch_size=None, num_workers=N)` reads it; pretrain_ddp.py uses make_loader.
"""
import contextlib
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import threading
import time

import torch
from torch.utils.data import DataLoader


def make_loader(stream, num_workers, pin_memory, timeout_s, collate_fn=None, persistent=False):
    """A DataLoader of the stream (batches built in the workers, batch_size=None: one IPC message each)
    whose workers come from a forkserver, never forked from this process: a trainer runs threads (gloo,
    TensorBoard, OpenMP, pin-memory) and a child forked while one holds a lock can hang before its first
    line (seen: an eval worker, 1 job in 30 under load). The server imports torch and the tokenizer's
    module once (a worker starts in ~0.1 s, not 6-11 s: BENCHMARKS.md section 14), not data_stream.py:
    it finds modules from the working directory, where another data_stream.py may be. It starts with SIGTERM
    ignored (fork and exec keep that; quiet_worker undoes it): a SIGTERM to the whole process group
    (Slurm's scancel, `timeout`) killed it, and the eval after the stop waited forever on workers it could
    not make. A worker that sends no batch within timeout_s stops the trainer with DataLoader's error."""
    # The Rust tokenizer's thread pool deadlocks in a process forked after using it; and the stream
    # tokenizes a document at a time, where threads cost CPU the model could use and gain nothing.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(sorted({"torch", "numpy", type(stream.tokenizer).__module__}))
    if num_workers and threading.current_thread() is threading.main_thread():
        handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one SIGTERM in this ~1 ms is lost
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGTERM, handler)
    # Its own generator: a loader started mid-epoch after a resume must not shift the global RNG.
    return DataLoader(stream, batch_size=None, collate_fn=collate_fn, num_workers=num_workers,
                      pin_memory=pin_memory, prefetch_factor=4 if num_workers else None,
                      worker_init_fn=functools.partial(quiet_worker, trainer_pid=os.getpid()),
                      generator=torch.Generator(),
                      multiprocessing_context=context if num_workers else None,
                      persistent_workers=persistent and num_workers > 0, timeout=timeout_s if num_workers else 0)


def quiet_worker(worker_id, trainer_pid):
    """Ctrl-C and torchrun's SIGTERM go to a whole process group: a worker leaves it, so the trainer
    decides when to stop (the DataLoader still ends its workers). A worker also ends when its trainer
    dies: DataLoader's own check watches the worker's parent, which is the forkserver here, and the
    forkserver lives as long as its workers do (each holds the fd the server watches), so a SIGKILLed
    or OOM-killed rank would leave its workers waiting forever, holding memory and its stdout."""
    os.setpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # DataLoader ends a stuck worker with it
    threading.Thread(target=exit_with, args=(trainer_pid,), daemon=True).start()


def exit_with(pid):
    """End this process once process pid has ended (never returns)."""
    try:
        select.select([os.pidfd_open(pid)], [], [])  # Linux 5.3+: readable once pid has exited
    except (AttributeError, OSError):  # no pidfd here: ask every second
        with contextlib.suppress(ProcessLookupError):
            while True:
                os.kill(pid, 0)
                time.sleep(1)
    os._exit(0)
