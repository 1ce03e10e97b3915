"""Many nodes, simulated on one machine: every node is a torchrun agent started in a working
directory of its own, with its own BERT_DDP_CACHE and a relative --out-dir, so the nodes share
nothing but the loopback network. Rank 0 decides, every rank verifies (issue 9); a worker that
dies on any node is restarted by torchrun and the job resumes exactly (issue 18)."""
import hashlib
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time

import pytest
import torch
from conftest import FAST, ROOT, SCRIPT, Launch, final_weights, run, same_weights, torchrun, wait_for, write_corpus

import checkpoints

pytestmark = pytest.mark.slow  # every test here starts the trainer

AGENT = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
ARGS = ["--corpus", "corpus.txt", "--vocab-size", "300", "--eval-corpus", "none", "--out-dir", "run", *FAST,
        "--save-every", "4", "--max-steps", "12"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def static(port):
    """The by-hand launch: node k is --node_rank k, node 0 hosts the store."""
    return [["--node_rank", str(k), "--master_addr", "127.0.0.1", "--master_port", str(port)] for k in (0, 1)]


def elastic(port, max_restarts=1):
    """The c10d rendezvous of the README's multi-node launches (ranks are assigned by torchrun)."""
    return [["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
             "--max-restarts", str(max_restarts)]] * 2


def make_nodes(tmp_path, corpus):
    """Two node directories, each with its own cache and a copy of the corpus. A cache starts with the session
    cache's timing of this machine's CPU peak, if there is one yet (else rank 0 times it: ~2.4 s a job)."""
    nodes = []
    peak = os.path.join(os.environ["BERT_DDP_CACHE"], "cpu_peak.json")
    for k in range(2):
        node = tmp_path / f"node{k}"
        (node / "cache").mkdir(parents=True)
        shutil.copy(corpus, node / "corpus.txt")
        if os.path.exists(peak):
            shutil.copy(peak, node / "cache" / "cpu_peak.json")
        nodes.append(str(node))
    return nodes


def processes_in(node, workers_only=False):
    """pids of the processes running in a node's directory (the agent, its workers)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if cwd == node and SCRIPT.encode() in cmdline and not (workers_only and b"torch.distributed.run" in cmdline):
            pids.append(int(pid))
    return pids


def kill(nodes, workers_only=False):
    for node in nodes:
        for pid in processes_in(node, workers_only):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_nodes(nodes, launches, args, on_line=None, timeout=150, extra=((), ()), variables=({}, {})):
    """The two-agent launcher: one torchrun agent per node, in the node's directory with its own cache (node k's
    command line ends with extra[k], its environment has variables[k]); on_line(k, line) sees every stdout line
    of node k. Returns [(exit code, stdout, stderr)] per node; a job past timeout is killed and fails the test,
    and so does a process of it alive 30 s after its agent ended (wait_for)."""
    return wait_for([Launch([*AGENT, *launch, SCRIPT, *args, *more],
                            on_line and (lambda line, proc, k=k: on_line(k, line)), node,
                            {"BERT_DDP_CACHE": os.path.join(node, "cache"), **more_variables})
                     for k, (node, launch, more, more_variables) in enumerate(zip(nodes, launches, extra, variables,
                                                                                   strict=True))], timeout)


def folder_digest(path):
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        digest.update(name.encode() + open(os.path.join(path, name), "rb").read())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def shared_nothing(tmp_path_factory, corpus):
    """The job on two nodes with separate caches and node-local out dirs, no --tokenizer (rank 0 trains one),
    SIGKILLed on both nodes at step 6, the caches wiped, started again. Returns (nodes, the restart's results,
    whose node was killed first, the tokenizer's digest before the restart). Its tokenizer is the one the
    other tests here run with (`reference` is this job uninterrupted): a run of its own to compare with
    would cost the suite a torchrun more."""
    nodes = make_nodes(tmp_path_factory.mktemp("shared_nothing"), corpus)
    killed = []

    def kill_both_at_step_6(k, line):
        if line.startswith("step 6:") and not killed:
            killed.append(k)
            kill(nodes)

    run_nodes(nodes, static(free_port()), ARGS, kill_both_at_step_6)
    digest = folder_digest(os.path.join(nodes[0], "run", "tokenizer"))
    trained_on_node_1 = os.path.exists(os.path.join(nodes[1], "cache", "tokenizers"))
    for node in nodes:  # the caches are wiped between the kill and the restart
        shutil.rmtree(os.path.join(node, "cache"))
        os.mkdir(os.path.join(node, "cache"))
    return nodes, run_nodes(nodes, static(free_port()), ARGS), killed, digest, trained_on_node_1


def test_shared_nothing_nodes_one_tokenizer_and_exact_resume(shared_nothing, reference):
    """Separate caches, node-local out dirs: one tokenizer (rank 0's), SIGKILL of both nodes,
    caches wiped, restart: bitwise equal to one uninterrupted run given that tokenizer."""
    nodes, results, killed, digest, trained_on_node_1 = shared_nothing
    assert killed == [0]  # rank 0 (which logs) runs on node 0
    assert not trained_on_node_1  # rank 1 never trained its own
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    assert "resumed from run/checkpoints/step_000004 at step 4" in results[0][1]
    # the run's own tokenizer: neither retrained nor read from a cache
    assert folder_digest(os.path.join(nodes[0], "run", "tokenizer")) == digest
    # no tokenizer in any cache (node-local index and token caches are expected)
    assert not any(os.path.exists(os.path.join(node, "cache", "tokenizers")) for node in nodes)
    assert not os.path.exists(os.path.join(nodes[1], "run", "checkpoints"))  # only rank 0's node holds them
    assert same_weights(final_weights(reference), final_weights(os.path.join(nodes[0], "run")))


# On PYTHONPATH of node 1: its tokenizer library reads the same files differently (here: "river" is
# read as "stone"), as another version of it might. Every file and hash on disk stays rank 0's.
OTHER_TOKENIZER_LIBRARY = """
import os
if "LOCAL_RANK" in os.environ:
    from tokenizers import normalizers

    import data_stream
    _get_tokenizer = data_stream.get_tokenizer

    def get_tokenizer(*args, **kwargs):
        tokenizer = _get_tokenizer(*args, **kwargs)
        backend = tokenizer.backend_tokenizer
        backend.normalizer = normalizers.Sequence([backend.normalizer, normalizers.Replace("river", "stone")])
        return tokenizer

    data_stream.get_tokenizer = get_tokenizer
"""


@pytest.mark.parametrize("case", ["flags", "corpus differs", "corpus missing", "eval corpus on node 0 only",
                                  "tokenizer reads differently"])
def test_a_node_that_disagrees_stops_every_rank_with_one_line(tmp_path, corpus, case):
    nodes = make_nodes(tmp_path, corpus)
    args, extra, variables = list(ARGS), [[], []], [{}, {}]
    if case == "flags":
        extra[1] = ["--lr", "3e-3"]  # rank 0 has the default, 2e-3
        expected = r"the command line is not rank 0's: \{'lr': 0.003\} here, \{'lr': 0.002\} on rank 0 \(\S+\)"
    elif case == "corpus differs":
        write_corpus(os.path.join(nodes[1], "corpus.txt"), 120, seed=1)
        expected = r"the corpus of --corpus corpus.txt is not rank 0's: \{'bytes': \d+, 'index': '\w+'\} here"
    elif case == "corpus missing":
        os.remove(os.path.join(nodes[1], "corpus.txt"))
        expected = r"--corpus path corpus.txt does not exist"
    elif case == "eval corpus on node 0 only":
        shutil.copy(corpus, os.path.join(nodes[0], "eval.txt"))
        args[args.index("--eval-corpus") + 1] = "eval.txt"
        expected = r"--eval-corpus eval.txt: --corpus path eval.txt does not exist \(rank 0 has it"
    else:  # rank 0 trains the tokenizer and sends its files; node 1 loads them into another tokenizer
        patch = tmp_path / "other_tokenizer_library"
        patch.mkdir()
        (patch / "sitecustomize.py").write_text(OTHER_TOKENIZER_LIBRARY)
        variables[1] = {"PYTHONPATH": os.pathsep.join([str(patch), ROOT])}
        expected = r"the tokenizer is not rank 0's: \w{16} here, \w{16} on rank 0 \(\S+\)$"
    results = run_nodes(nodes, static(free_port()), args, timeout=300, extra=extra, variables=variables)
    assert all(rc != 0 for rc, _, _ in results)
    errors = [line for _, _, err in results for line in err.splitlines() if "pretrain_ddp.py: error" in line]
    assert len(errors) == 1, errors  # said once, by the rank that differs, on its own node
    assert re.search(r"^pretrain_ddp.py: error: rank 1 on \S+: " + expected, errors[0]), errors[0]
    assert "pretrain_ddp.py: error: rank 1" in results[1][2]
    for k, (_, _, err) in enumerate(results):  # every rank stopped by itself, with code 2 (torchrun's report)
        assert re.search(rf"rank\s*: {k} \(local_rank: 0\)\s*exitcode\s*: 2 ", err), err[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, shared_nothing):
    """The out dir of the job (ARGS), uninterrupted, on one node, with the shared-nothing job's tokenizer; the
    tests below run with it too (`tokenizer_of(reference)`)."""
    out = str(tmp_path_factory.mktemp("reference") / "run")
    kept = os.path.join(shared_nothing[0][0], "run", "tokenizer")
    rc, _, err = run(torchrun(2, *ARGS, "--corpus", corpus, "--tokenizer", kept, "--out-dir", out))
    assert rc == 0, err[-3000:]
    return out


def tokenizer_of(run_dir):
    return os.path.join(run_dir, "tokenizer")


def test_elastic_restarts_after_a_worker_dies_on_either_node_resume_exactly(tmp_path, corpus, reference):
    """torchrun --max-restarts 2 on two c10d agents, node-local out dirs: SIGKILL the other node's worker at step 6
    (as an OOM kill would): the job restarts and resumes from rank 0's newest checkpoint, step 4; then SIGKILL rank
    0's own worker at step 10: it restarts again, resumes from step 8, and ends bitwise equal to the uninterrupted
    job. Which restart each agent sees first is a race: both victims once per run of the suite, in one job (they
    were a job each: ~20 s of the suite more, for the same code paths)."""
    nodes = make_nodes(tmp_path, corpus)
    killed, resumed = [], []

    def kill_a_worker_of_each_node(k, line):  # k: the node whose stdout logs, i.e. rank 0's
        if line.startswith("resumed from"):
            resumed.append(k)
        victim = 1 - k if not killed and line.startswith("step 6:") else None
        if len(killed) == 1 and resumed and line.startswith("step 10:"):
            victim = k
        if victim is not None:
            killed.append(victim)
            kill([nodes[victim]], workers_only=True)

    results = run_nodes(nodes, elastic(free_port(), max_restarts=2), [*ARGS, "--tokenizer", tokenizer_of(reference)],
                        kill_a_worker_of_each_node, timeout=240)  # three attempts
    assert sorted(killed) == [0, 1], killed  # one worker of each node
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    holder = [k for k in (0, 1) if os.path.isdir(os.path.join(nodes[k], "run", "checkpoints"))]
    assert len(holder) == 1  # shared nothing: one node's out dir holds every checkpoint
    stdout = results[holder[0]][1]
    assert "resumed from run/checkpoints/step_000004 at step 4" in stdout, stdout[-3000:]
    assert "resumed from run/checkpoints/step_000008 at step 8" in stdout, stdout[-3000:]
    assert same_weights(final_weights(reference), final_weights(os.path.join(nodes[holder[0]], "run")))


def test_restarts_used_up_end_every_agent_with_one_line(tmp_path, corpus, tok_dir):
    nodes = make_nodes(tmp_path, corpus)
    killed = []

    def kill_the_other_worker(k, line):
        if line.startswith("step 6:") and not killed:
            killed.append(1 - k)
            kill([nodes[1 - k]], workers_only=True)

    results = run_nodes(nodes, elastic(free_port(), max_restarts=0), [*ARGS, "--tokenizer", tok_dir],
                        kill_the_other_worker, timeout=480)  # a hang guard, far above a run under load
    assert killed and all(rc != 0 for rc, _, _ in results)  # both agents ended by themselves
    errors = [line for _, _, err in results for line in err.splitlines() if "pretrain_ddp.py: error" in line]
    assert len(errors) == 1 and re.match(r"pretrain_ddp.py: error: rank 0 on \S+: lost the other ranks \(.*"
                                         r"Connection (closed|reset) by peer", errors[0]), errors
    assert "exitcode: -9" in results[killed[0]][2]  # and torchrun names the rank that was killed


def test_a_sigkilled_agent_of_the_second_node_stops_the_job_and_the_rerun_resumes_exactly(tmp_path, corpus,
                                                                                          reference):
    """SIGKILL to node 1's torchrun agent (its process group; its rank runs in a session of its own): the
    kernel sends that rank SIGTERM, and the per-step all_reduce stops every rank of the job at the same
    step with a checkpoint; every rank is gone within 30 s (node 0's agent then waits in torchrun's exit
    barrier for the dead one, up to its 300 s: ended here). Both nodes started again resume the job and
    end bitwise equal to the job never interrupted."""
    nodes = make_nodes(tmp_path, corpus)
    ranks_ended = []

    def end_when_the_ranks_have(agents):
        deadline = time.time() + 30
        while any(processes_in(node, workers_only=True) for node in nodes) and time.time() < deadline:
            time.sleep(0.1)
        ranks_ended.append(not any(processes_in(node, workers_only=True) for node in nodes))
        for pid in agents:
            os.killpg(pid, signal.SIGKILL)

    def kill_node_1_s_agent_at_step_6(k, line):
        if line.startswith("step 6:") and not ranks_ended:
            ranks_ended.append("killed")
            agents = [[pid for pid in processes_in(node) if pid not in processes_in(node, True)] for node in nodes]
            os.killpg(agents[1][0], signal.SIGKILL)  # the agent's own session (run_nodes)
            threading.Thread(target=end_when_the_ranks_have, args=(agents[0],)).start()

    results = run_nodes(nodes, static(free_port()), [*ARGS, "--tokenizer", tokenizer_of(reference)],
                          kill_node_1_s_agent_at_step_6)
    assert ranks_ended == ["killed", True], ranks_ended
    stopped_at = int(re.search(r"stopped by signal at step (\d+) on every rank", results[0][1])[1])
    assert 6 <= stopped_at < 12 and f"saved run/checkpoints/{checkpoints.step_name(stopped_at)}" in results[0][1]
    results = run_nodes(nodes, static(free_port()), [*ARGS, "--tokenizer", tokenizer_of(reference)])
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    assert f"resumed from run/checkpoints/{checkpoints.step_name(stopped_at)}" in results[0][1]
    assert same_weights(final_weights(reference), final_weights(os.path.join(nodes[0], "run")))


def test_a_node_without_the_init_from_source_gets_it_from_rank_0(tmp_path, corpus, reference):
    """--init-from on node-local disks: node 0 has the source folder, node 1 has another model under that name
    (with the same tokenizer): every rank starts from node 0's weights."""
    from transformers import BertForPreTraining
    nodes = make_nodes(tmp_path, corpus)
    shutil.copytree(os.path.join(reference, "hf"), os.path.join(nodes[0], "source"))
    other = BertForPreTraining.from_pretrained(os.path.join(nodes[0], "source"))
    torch.nn.init.normal_(other.bert.embeddings.word_embeddings.weight)
    other.save_pretrained(os.path.join(nodes[1], "source"))
    shutil.copytree(os.path.join(reference, "tokenizer"), os.path.join(nodes[1], "source"), dirs_exist_ok=True)
    args = list(ARGS)
    args[args.index("--max-steps") + 1] = "2"
    # an nsp source (the run's Hugging Face export) into an nsp run: every weight comes from it, nothing fresh
    results = run_nodes(nodes, static(free_port()), [*args, "--init-from", "source", "--lr", "0"])
    assert all(rc == 0 for rc, _, _ in results), results
    assert "starts fresh" not in results[0][2]
    assert same_weights(final_weights(reference), final_weights(os.path.join(nodes[0], "run")))
