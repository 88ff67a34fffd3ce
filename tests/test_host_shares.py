"""Each host reads only its share (data/shares.py): the processes of a multi-process run each tokenize
a contiguous run of the input files, pack them into their own rows, and measure every token of the
corpus once, under its one-process sequence index: the metrics of one process. In process (the
exchange faked by threads: every token against the whole corpus's cache) and end to end with 2
(explicit coordinator) and 4 (`--distributed`, SLURM's environment; killed and resumed) processes."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import TOKENIZER_JSON, build_hf_checkpoint
from isojax.data import load_corpus, pack_batches, tokenize_corpus
from isojax.data.shares import HostShare
from isojax.errors import UserError
from test_parallel import _assert_same, _env, _free_port

REPO = Path(__file__).resolve().parents[1]
WORDS = "the of and to in a is that for it as was with be by on not he this are or his from".split()


def write_corpus(folder: Path, seed: int = 0, one_file: bool = False) -> None:
    """Seven JSON lines files of unequal sizes (one_file: their lines in one file, and a small text
    file after it): two Pile sources in some, a source named after its folder (or file) in the
    records without meta; the fifth file holds a source no earlier file has."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for f, n_docs in enumerate([30, 5, 18, 40, 9, 25, 12]):
        with open(folder / ("big.jsonl" if one_file else f"shard{f}.jsonl"), "a") as out:
            for i in range(n_docs):
                rec = {"text": " ".join(rng.choice(WORDS, size=int(rng.integers(2, 60))))}
                if (i + f) % 3:
                    rec["meta"] = {"pile_set_name": ["Enron Emails", "HackerNews"][i % 2] if f != 4 else "Late"}
                out.write(json.dumps(rec) + "\n")
    if one_file:
        (folder / "z.txt").write_text("a small text file after it")


def test_shares_are_the_inputs_in_order_balanced_by_bytes(tmp_path):
    """The shares' records, in process order, are the corpus's; no share holds more than two
    count-ths of the bytes (a file larger than one is split)."""
    write_corpus(tmp_path / "c")
    corpus = load_corpus([str(tmp_path / "c")], unit="document")
    whole, total = list(corpus.documents()), sum(os.path.getsize(inp.path) for inp in corpus.inputs)
    for count in (1, 2, 3, 4, 7, 9):
        shares = [corpus.share(p, count) for p in range(count)]
        assert [doc for share in shares for doc in share.documents()] == whole, count
        size = lambda inp: inp.byte_range[1] - inp.byte_range[0] if inp.byte_range else os.path.getsize(inp.path)
        assert max(sum(map(size, share.inputs)) for share in shares) <= 2 * total / count, count
    assert corpus.shareable()
    assert not load_corpus([str(tmp_path / "c")], max_tokens=1000).shareable()  # a budget: every process reads it


def test_a_large_json_lines_file_is_split_by_lines(tmp_path):
    """A plain .jsonl larger than a process's part is read in byte ranges, each the lines that start
    in it: the shares' records, in process order, are the file's; a bad record keeps its line."""
    write_corpus(tmp_path / "c", one_file=True)
    corpus = load_corpus([str(tmp_path / "c")], unit="document")
    whole = list(corpus.documents())
    for count in (2, 3, 4, 7, 50):
        shares = [corpus.share(p, count) for p in range(count)]
        assert [doc for share in shares for doc in share.documents()] == whole, count
        assert sum(len(share.inputs) for share in shares) == count + 1, count  # the text file is one piece
    lines = (tmp_path / "c" / "big.jsonl").read_text().splitlines(keepends=True)
    lines[100] = "{not json\n"
    (tmp_path / "c" / "big.jsonl").write_text("".join(lines))
    corpus = load_corpus([str(tmp_path / "c")], unit="document", max_bad_records=0)
    with pytest.raises(UserError, match=r"big.jsonl:101: malformed JSON"):
        for p in range(4):
            list(corpus.share(p, 4).documents())


def _hosts(corpus, count, tmp_path, max_len):
    """count HostShares of one corpus, each with its own token cache, trading through a dict."""
    board, changed = {}, threading.Condition()

    def exchange(index):
        def trade(name, value):
            with changed:
                board[name, index] = value
                changed.notify_all()
                changed.wait_for(lambda: all((name, p) in board for p in range(count)))
                return [board[name, p] for p in range(count)]
        return trade

    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    return [HostShare(corpus, tok, cache_dir=tmp_path / f"cache{p}", max_len=max_len, index=p, count=count,
                      exchange=exchange(p)) for p in range(count)]


def _each(hosts, f):
    """[f(host) for host in hosts], at once: the hosts trade at the start of a pass."""
    out = [None] * len(hosts)

    def run(i):
        out[i] = f(hosts[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _tokens(batches_per_host, names):
    """Counter of (global sequence, position, token id, source) over every host's rows of every step;
    the steps agree on source, tokens and sequences on every host."""
    seen, steps = collections.Counter(), []
    for step in zip(*batches_per_host, strict=True):
        assert len({(b.group, b.n_tokens, b.n_sequences, json.dumps(b.cursor)) for b in step}) == 1
        steps.append(step[0])
        for b in step:
            real = b.segment_ids_BxT > 0
            seen.update(zip(b.sequences_BxT[real].tolist(), b.positions_BxT[real].tolist(), b.tokens_BxT[real].tolist(),
                            [names[b.group]] * int(real.sum())))
    return seen, steps


@pytest.mark.parametrize("count,one_file", [(2, False), (4, False), (3, True)])
def test_every_token_once_under_its_one_process_index(tmp_path, count, one_file):
    """Each host tokenizes only its files (or lines of one file); over all hosts' rows every token of
    the whole corpus's cache comes once, with its one-process sequence index (the sample's key),
    position and source; a step's counts are every host's; a cursor resumes at the same step on
    every host."""
    write_corpus(tmp_path / "c", one_file=one_file)
    corpus = load_corpus([str(tmp_path / "c")], unit="document")
    whole = tokenize_corpus(corpus, Tokenizer.from_file(str(TOKENIZER_JSON)), cache_dir=tmp_path / "whole", max_len=16)
    hosts = _hosts(corpus, count, tmp_path, 16)
    for h in hosts:
        h.wait()
    assert [h.source_names for h in hosts] == [whole.source_names] * count
    assert hosts[0].source_counts() == whole.source_counts() and hosts[0].n_sequences == whole.n_sequences
    assert hosts[0].fingerprint == whole.fingerprint
    # each host tokenized its own files only: its cache holds a part of the tokens, together all of them
    local = [h.local.n_tokens if h.local is not None else 0 for h in hosts]
    assert sum(local) == whole.n_tokens and max(local) < whole.n_tokens
    assert len({str(h.local.path) for h in hosts if h.local is not None}) == sum(h.local is not None for h in hosts)
    rows, local_rows = 2 * count, 2
    subset = np.arange(local_rows)
    packs = _each(hosts, lambda h: list(pack_batches(h, rows=rows, row_len=16, row_subset=subset, prefetch=0)))
    seen, steps = _tokens(packs, whole.source_names)
    want = collections.Counter()
    for i in range(whole.n_sequences):
        seq = whole.sequence(i).tolist()
        want.update((i, pos, t, whole.source_names[whole.source_ids[i]]) for pos, t in enumerate(seq))
    assert seen == want
    assert sum(s.n_tokens for s in steps) == whole.n_tokens and sum(s.n_sequences for s in steps) == whole.n_sequences
    stats = hosts[0].plan_stats(rows=rows, row_len=16, local_rows=local_rows)
    assert stats.batches == len(steps) and stats.tokens == whole.n_tokens
    k = len(steps) // 2
    resumed = _each(hosts, lambda h: list(pack_batches(h, rows=rows, row_len=16, row_subset=subset, prefetch=0,
                                                       start_cursor=steps[k - 1].cursor)))
    for before, after in zip(packs, resumed):
        assert len(after) == len(before) - k
        assert all(np.array_equal(a.tokens_BxT, b.tokens_BxT) and np.array_equal(a.sequences_BxT, b.sequences_BxT)
                   for a, b in zip(before[k:], after))


def test_a_host_without_text_feeds_padding_and_errors_name_their_process(tmp_path):
    """More processes than text files: two have no share and feed padding; a bad file fails its
    own process with its error and the others with the same line, naming the process."""
    (tmp_path / "t").mkdir()
    for name in "abc":
        (tmp_path / "t" / f"{name}.txt").write_text(" ".join([name * 3] * 40))
    hosts = _hosts(load_corpus([str(tmp_path / "t")], unit="sentence"), 5, tmp_path, 64)
    assert sum(h.local is None for h in hosts) == 2 and hosts[0].n_tokens > 0
    seen, _ = _tokens(_each(hosts, lambda h: list(pack_batches(h, rows=5, row_len=64, row_subset=[0], prefetch=0))),
                      hosts[0].source_names)
    assert sum(seen.values()) == hosts[0].n_tokens
    write_corpus(tmp_path / "c")
    (tmp_path / "c" / "shard6.jsonl").write_bytes(b"\xff\n" * 200)  # 200 bad records: over the limit
    corpus = load_corpus([str(tmp_path / "c")], unit="document", max_bad_records=3)
    hosts = _hosts(corpus, 2, tmp_path, 64)
    errors = []
    for h in hosts:
        with pytest.raises(Exception) as e:
            h.wait()
        errors.append(str(e.value))
    assert "shard6.jsonl" in errors[1] and errors[0] == f"process 1: {errors[1]}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shares")
    build_hf_checkpoint(tmp / "ckpt", vocab_size=50304, hidden_size=32, num_layers=2, num_heads=2)
    write_corpus(tmp / "corpus")
    return tmp


COMMON = ["--unit", "document", "--seq-len", "64", "--batch-tokens", "512", "--no-plots", "--sample-states", "400",
          "--centered"]


@pytest.fixture(scope="module")
def one(setup):
    """The metrics of one process on one device."""
    proc = subprocess.run([sys.executable, "-m", "isojax.extract", "--model", str(setup / "ckpt"), "--data",
                           str(setup / "corpus"), *COMMON, "--out", str(setup / "one")], cwd=REPO, env=_env(setup, 1),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((setup / "one" / "metrics.json").read_text())


def _check_shares(setup, out: Path, errs: list[str], count: int, one: dict) -> None:
    """The metrics of one process, the sample's tokens included; each process tokenized only its share."""
    two = json.loads((out / "metrics.json").read_text())
    _assert_same(one, two, f"{count} processes")
    for a, b in zip(one["layers"], two["layers"]):
        for key, value in a["intrinsic_dimension"].items():
            other = b["intrinsic_dimension"][key]
            assert value is None and other is None or abs(value - other) <= 1e-4 * value, (a["name"], key)
        assert abs(a["centered_inter_sim"] - b["centered_inter_sim"]) <= 1e-6
    shares = json.loads((out / "manifest.json").read_text())["host_shares"]
    total = sum(f.stat().st_size for f in (setup / "corpus").iterdir())
    assert sum(s["tokens"] for s in shares) == one["tokens"] and sum(s["bytes"] for s in shares) == total
    # what each process's own token cache holds (ISOJAX_CACHE per process): its share's tokens, no more
    cached = [sum(json.loads(m.read_text())["n_tokens"] for m in (setup / f"cache{count}-{p}").rglob("meta.json"))
              for p in range(count)]
    assert cached == [s["tokens"] for s in shares] and max(cached) < one["tokens"]
    for p, err in enumerate(errs):
        assert f"process {p} of {count}: its share, {shares[p]['bytes']:,} of {total:,} bytes" in err, err[-2000:]


def _free_slurm_port() -> int:
    """A free port where SLURM's environment puts the coordinator: 61440 + job id % 4096."""
    import socket
    for port in np.random.default_rng().permutation(np.arange(61440, 65536)).tolist():
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 61440-65535")


def _launch(setup, out, count, env_of, *extra):
    return [subprocess.Popen([sys.executable, "-m", "isojax.extract", "--model", str(setup / "ckpt"), "--data",
                              str(setup / "corpus"), *COMMON, "--out", str(out), *env_of(p)[1], *extra], cwd=REPO,
                             env={**_env(setup, 2 if count == 2 else 1), **env_of(p)[0],
                                  "ISOJAX_CACHE": str(setup / f"cache{count}-{p}")},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(count)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_read_their_shares_and_equal_one(setup, one, tmp_path):
    """Two processes of 2 host devices each, explicit coordinator."""
    port = _free_port()
    procs = _launch(setup, tmp_path / "two", 2, lambda p: ({}, ["--coordinator", f"localhost:{port}", "--num-processes",
                                                                 "2", "--process-id", str(p)]))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    _check_shares(setup, tmp_path / "two", [err for _, err in outs], 2, one)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_processes_distributed_killed_and_resumed_equal_one(setup, one, tmp_path):
    """Four processes of one device each, `--distributed` in SLURM's environment, each SIGKILLed
    once its second checkpoint is written (or ended by a peer's death: every process has begun
    the first by then, and a failing process finishes it), then resumed: one process's metrics."""
    port = _free_slurm_port()
    slurm = lambda p: ({"SLURM_JOB_ID": str(port - 61440), "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "4",
                        "SLURM_PROCID": str(p), "SLURM_LOCALID": str(p), "SLURM_STEP_NUM_NODES": "1"},
                       ["--distributed"])
    out = tmp_path / "four"
    procs = _launch(setup, out, 4, lambda p: ({**slurm(p)[0], "ISOJAX_FAULT": "checkpoint_written:2"}, slurm(p)[1]),
                    "--checkpoint-every-tokens", "1000")
    for p in procs:
        try:
            p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # a process whose peers died first may be left waiting on them
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.communicate()
    assert not (out / "metrics.json").exists() and any((out / "checkpoint").iterdir())
    written = sorted(str(p.relative_to(out)) for p in (out / "checkpoint").glob("*/*"))
    procs = _launch(setup, out, 4, slurm, "--resume")
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "resuming after" in outs[0][1], (written, outs[0][1][:3000])
    _check_shares(setup, out, [err for _, err in outs], 4, one)


FINISH = """
import os, sys, pathlib
from isojax.device import mesh
p, port, scenario, d = int(sys.argv[1]), sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4])
def note(event):  # one line, one write, appended: the order the events happened in
    with open(d / "events", "a") as f:
        f.write(f"{event}\\n")
mesh.initialize(f"localhost:{port}", 2, p, shutdown_timeout_s=600)
import jax
from jax._src import distributed
jax.devices()  # the backend up, as at the end of a run
leave = distributed.global_state.shutdown
distributed.global_state.shutdown = lambda: (note(f"p{p} enters the shutdown barrier"), leave())
if scenario == "late" and p == 1:  # the slow host: it comes once process 0 waits in finish
    client = distributed.global_state.client
    client.blocking_key_value_get_bytes("isojax/finished/0", 600_000)
if scenario == "never" and p == 0:  # the host that never comes: it leaves once process 1 has ended
    client = distributed.global_state.client
    while not (d / "p1 ended").exists():
        import time; time.sleep(0.1)
    os._exit(0)
note(f"p{p} finishes")
mesh.finish(600 if scenario == "late" else 3)
"""


@pytest.mark.multiprocess
def test_the_end_waits_for_a_slow_host_and_a_missing_one_is_a_warning(tmp_path):
    """48.15: jax.distributed's shutdown barrier ended a resumed 4-process run on a loaded machine
    (the coordination service's fatal error, which no handler catches). mesh.finish, after the results
    are committed, waits in the key-value store: no process enters the barrier before every process
    has finished (the order of events, not clocks); a process that never comes is a warning, and the
    other leaves with exit status 0."""
    def launch(scenario):
        d = tmp_path / scenario
        d.mkdir()
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, "-c", FINISH, str(p), str(port), scenario, str(d)], cwd=REPO,
                                  env=_env(tmp_path, 1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for p in range(2)]
        return d, procs

    d, procs = launch("late")
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    events = (d / "events").read_text().splitlines()
    assert events[:2] == ["p0 finishes", "p1 finishes"] and sorted(events[2:]) == \
        ["p0 enters the shutdown barrier", "p1 enters the shutdown barrier"], events
    assert "warning" not in outs[0][1] + outs[1][1]

    d, procs = launch("never")
    _, err = procs[1].communicate(timeout=300)
    (d / "p1 ended").touch()
    procs[0].communicate(timeout=300)
    assert procs[1].returncode == 0, err[-2000:]
    assert "isojax: warning: the results are complete, but exchange 'finished': process 0 of 2 did not publish " \
           "within 3 s" in err and "--shutdown-timeout SECONDS waits longer" in err, err[-2000:]
    assert (d / "events").read_text().splitlines() == ["p1 finishes"]  # no barrier: nothing to time out
