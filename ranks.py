"""
Rank 0 decides, every rank verifies, and a rank that disagrees stops every rank with one line naming itself:
the process group of pretrain_ddp.py and the collectives by which its ranks agree. What rank 0 decided travels
over the process group (no shared file system), and every yes/no that gates a collective is agreed on by all
ranks first: no rank waits in a collective the others skipped. Control traffic runs on a gloo group (GROUP.ctrl)
even under nccl: reading its result never waits for the GPU, which keeps queueing kernels ahead.

A leaf: torch only. One process (no torchrun) is a world of one, and every collective here returns at once.
"""
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

HOST = socket.gethostname()


@dataclass
class Group:
    """This process in the job (join_group): its rank, the world size, this launch's namespace in torchrun's
    store, and the group for control traffic (gloo; None: the default group)."""
    rank: int = 0
    world_size: int = 1
    store: object = None
    ctrl: object = None


GROUP = Group()


def warn(line):
    print(line, file=sys.stderr, flush=True)


def say_error(message):
    where = f"rank {GROUP.rank} on {HOST}: " if GROUP.world_size > 1 else ""
    warn(f"pretrain_ddp.py: error: {where}{message}")


PREPARE_TIMEOUT = timedelta(hours=24)  # rank 0 may train a tokenizer and count a corpus meanwhile


def join_group(device, timeout, newest_step):
    """Create the process group in a namespace every rank of this launch agrees on. torchrun's restarts
    keep the dead group's store, and each agent counts its own restarts (PyTorch issue 135712), so
    neither tells a restarted rank which keys are current: torchrun's rank 0 names a fresh namespace;
    every other rank posts a random nonce and waits for the name under it (only a live rank 0 answers).
    There, rank 0 becomes a process that sees the newest checkpoint (newest_step, in its own out dir):
    a restart that moved torchrun's rank 0 to another node still resumes."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    GROUP.rank = rank
    GROUP.world_size = world_size
    if world_size == 1:
        return
    store = next(dist.rendezvous("env://", timeout=timeout))[0]
    base = f"bert_ddp/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
    if rank == 0:
        name, answered, deadline = uuid.uuid4().hex, set(), time.monotonic() + timeout.total_seconds()
        store.append(f"{base}/{name}/members", f"{rank}:{newest_step} ")
        store.add(f"{base}/{name}/joined", 1)
        while store.add(f"{base}/{name}/joined", 0) < world_size:
            if store.check([f"{base}/hello"]):
                for nonce in set(store.get(f"{base}/hello").decode().split()) - answered:
                    store.set(f"{base}/welcome/{nonce}", name)  # stale nonces of dead ranks too: harmless
                    answered.add(nonce)
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"only {store.add(f'{base}/{name}/joined', 0)} of {world_size} ranks "
                                          "joined rank 0 within --dist-timeout")
            time.sleep(0.02)
        store.set(f"{base}/{name}/complete", "1")
    else:
        nonce = uuid.uuid4().hex
        store.append(f"{base}/hello", nonce + " ")
        store.wait([f"{base}/welcome/{nonce}"], timeout)
        name = store.get(f"{base}/welcome/{nonce}").decode()
        store.append(f"{base}/{name}/members", f"{rank}:{newest_step} ")
        store.add(f"{base}/{name}/joined", 1)
        store.wait([f"{base}/{name}/complete"], timeout)
    members = [tuple(map(int, m.split(":"))) for m in store.get(f"{base}/{name}/members").decode().split()]
    order = sorted(members, key=lambda m: (-m[1], m[0]))  # the newest checkpoint first, then torchrun's order
    GROUP.rank = rank = [m[0] for m in order].index(rank)
    GROUP.store = dist.PrefixStore(f"{base}/{name}", store)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=GROUP.store, rank=rank,
                            world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    # Control traffic (flags, decisions, the per-step all_reduce) runs on the CPU (gloo) even under
    # nccl: reading its result never waits for the GPU, which keeps queueing kernels ahead.
    GROUP.ctrl = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else None


def gather(value):
    """[(host, value) of rank 0, (host, value) of rank 1, ...] on every rank."""
    items = [(HOST, value)] * GROUP.world_size
    if GROUP.world_size > 1:
        dist.all_gather_object(items, (HOST, value), group=GROUP.ctrl)
    return items


def from_rank0(obj):
    """Rank 0's obj on every rank (picklable: plans, names, a checkpoint's tensors)."""
    box = [obj]
    if GROUP.world_size > 1:
        dist.broadcast_object_list(box, src=0, group=GROUP.ctrl)
    return box[0]


def unless_local(mine):
    """Collective: `mine` (None: this rank could not read it) where every rank has it, else rank 0's
    on every rank (rank 0 always has it): sent over the process group only when needed."""
    if any(lacking for _, lacking in gather(mine is None)):
        sent = from_rank0(mine if GROUP.rank == 0 else None)
        mine = mine if mine is not None else sent
    return mine


def agree(error):
    """Collective: if any rank has an error (a string), the ranks that found it say it, all exit 2."""
    errors = [e for _, e in gather(error)]
    if any(errors):
        if error and (GROUP.rank == 0 or error != errors[0]):  # not a copy of rank 0's line
            say_error(error)
        raise SystemExit(2)


def verify(what, mine):
    """Collective: every rank's `mine` must equal rank 0's; the ranks that differ say how, all exit 2."""
    values = gather(mine)
    host0, theirs = values[0]
    if all(v == theirs for _, v in values):
        return
    if mine != theirs:
        if isinstance(mine, dict):  # name only what differs
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            mine, theirs = {k: mine.get(k) for k in keys}, {k: theirs.get(k) for k in keys}
        say_error(f"{what} is not rank 0's: {mine} here, {theirs} on rank 0 ({host0})")
    raise SystemExit(2)


def rank0_prepares(prepare, user_errors):
    """prepare() on rank 0, its result on every rank. The others wait on the store with a long
    timeout meanwhile (training a tokenizer on a big corpus can take hours), not in a collective
    bounded by --dist-timeout; a user error on rank 0 (user_errors: their classes) reaches every rank."""
    result, error = None, None
    if GROUP.rank == 0:
        try:
            result = prepare()
        except user_errors as e:
            error = str(e)
        finally:
            if GROUP.store is not None:
                GROUP.store.set("prepared", "1")
    elif GROUP.store is not None:
        GROUP.store.wait(["prepared"], PREPARE_TIMEOUT)
    agree(error)
    return from_rank0(result)


def all_reduce_ctrl(values):
    """Collective: the elementwise SUM of every rank's values (floats, on the control group)."""
    t = torch.tensor(values, dtype=torch.float64)
    if GROUP.world_size > 1:
        dist.all_reduce(t, group=GROUP.ctrl)
    return t.tolist()


def leave_group():
    """Every rank leaves together (rank 0's writes done, the DataLoader workers ended): one barrier, then
    every group destroyed before teardown. A rank that left while a peer used the group, or a group left
    to teardown, could abort on a gloo thread, and torchrun would report (and restart) a finished job."""
    if dist.is_initialized():
        dist.barrier(group=GROUP.ctrl)
        dist.destroy_process_group()
