"""Worker processes: a DataLoader transform that writes into the dataset's tensor is the same
E0596 with ``num_workers=0``, with forked workers and with spawned ones; the workers audit
their calls and the parent merges them (``note: 8 of these calls ran in 2 forked worker
processes``), never silently dropped. The program's output is its own, bit for bit."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plusequals.auditing.children import dump, load
from plusequals.auditing.report import AuditReport, Finding
from plusequals.auditing.scope import AuditedCall
from support.programs import python

pytest_plugins = ["pytester"]

LOADER = """\
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Normalize(nn.Module):
    def forward(self, x):
        x.sub_(0.5).div_(0.25)
        return x


class Images(Dataset):
    def __init__(self):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.images = torch.rand(8, 3, 4, 4)
        self.transform = Normalize()

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.transform(self.images[i])


if __name__ == "__main__":
    workers, context = int(sys.argv[1]), (sys.argv[2] if sys.argv[2] != "none" else None)
    loader = DataLoader(Images(), batch_size=4, num_workers=workers, multiprocessing_context=context)
    print([b.sum().item() for b in loader])
"""


def _plain() -> str:
    """What the program prints without the audit (in this process, with no worker: the batches
    do not depend on where they were made)."""
    import torch

    namespace: dict = {"__name__": "loader"}
    exec(LOADER, namespace)
    loader = torch.utils.data.DataLoader(namespace["Images"](), batch_size=4)
    return f"{[b.sum().item() for b in loader]}\n"


@pytest.mark.parametrize(("workers", "context"), [(0, "none"), (2, "fork"), (2, "spawn")])
def test_a_transforms_write_is_found_in_worker_processes_too(tmp_path, workers, context):
    (tmp_path / "loader.py").write_text(LOADER)
    as_json = python(
        tmp_path, "-m", "plusequals", "audit", "run", "--format", "json", "loader.py", str(workers), context
    )
    assert as_json.returncode == 1, as_json.stderr
    assert as_json.stdout == _plain()  # the batches, bit for bit
    report = json.loads(as_json.stderr)
    found = [(f["code"], f["op"], f["line"], f["count"]) for f in report["findings"]]
    assert found == [("E0596", "aten.sub_.Tensor", 10, 8), ("E0596", "aten.div_.Tensor", 10, 8)]
    assert report["watched"]["calls"] == 8
    assert report["workers"] == ({context: {"processes": 2, "calls": 8}} if workers else {})
    if context == "fork":  # the text, once (spawned workers are the slowest to start)
        text = python(tmp_path, "-m", "plusequals", "audit", "run", "loader.py", str(workers), context)
        assert text.returncode == 1 and text.stdout == as_json.stdout
        assert "note: 8 of these calls ran in 2 forked worker processes\n" in text.stderr
        assert text.stderr.rstrip().endswith("error: 2 errors (E0596 x2) in 8 audited calls")


PLUGIN_TESTS = """\
import torch
from torch import nn
from torch.utils.data import DataLoader


class Scale(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x


class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.items, self.scale = torch.ones(4, 2), Scale()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.scale(self.items[i])


def test_loader():
    assert [b.sum().item() for b in DataLoader(Data(), batch_size=2, num_workers=2)] == [8.0, 8.0]
"""


def test_the_plugin_fails_a_test_whose_forked_workers_broke_a_rule(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_workers=textwrap.dedent(PLUGIN_TESTS))
    result = pytester.runpytest_subprocess("-p", "plusequals.auditing.plugin", "--plusequals-audit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*error[[]E0596[]]: `Scale` wrote into `x`*", "*note: 4 of these calls ran in 2 forked worker processes*"]
    )


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)
_FINDINGS = st.builds(
    Finding,
    code=st.sampled_from(["E0596", "E0382", "E0502", "E0499", "move"]),
    module=_TEXT,
    where=_TEXT,
    op=_TEXT,
    message=_TEXT,
    read_at=st.none() | _TEXT,
    count=st.integers(1, 100),
    writer=st.none() | _TEXT,
)


@given(
    findings=st.lists(_FINDINGS, max_size=4),
    moves=st.lists(_FINDINGS, max_size=2),
    ops=st.integers(0, 10**6),
    error=st.none() | _TEXT,
    cut=st.integers(1, 40),
)
def test_a_workers_line_reads_back_as_it_was_written_and_a_cut_line_is_skipped(
    tmp_path_factory, findings, moves, ops, error, cut
):
    path = tmp_path_factory.mktemp("worker") / "1.jsonl"
    report = AuditReport(findings=findings, moves=moves, ops=ops, error=error, unused_allows=[("a.py:1", "E0596")])
    dump(str(path), "fork", AuditedCall("Net", "a.py:3", report, transform=True), ["/x/a.py"])
    dump(str(path), "fork", AuditedCall("under a tracer (torch.jit.trace)", "", None), [])  # type: ignore[arg-type]
    first, second = path.read_text().splitlines()
    back = load(first)
    assert back is not None and back["report"] == report
    assert (back["kind"], back["module"], back["caller"], back["files"]) == ("fork", "Net", "a.py:3", ["/x/a.py"])
    assert back["transform"] is True
    assert load(second) == {
        "kind": "fork",
        "pid": os.getpid(),
        "module": "under a tracer (torch.jit.trace)",
        "caller": "",
        "files": [],
        "transform": False,
        "sites": {},
        "report": None,
    }
    assert load(first[: min(cut, len(first) - 1)]) is None  # a worker killed while writing


FORKSERVER = """\
import multiprocessing as mp

import torch
from torch import nn


def work(q):
    q.put(nn.Linear(2, 2)(torch.ones(1, 2)).shape[1])


if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    q = ctx.Queue()
    ps = [ctx.Process(target=work, args=(q,)) for _ in range(2)]
    for p in ps:
        p.start()
    print(sorted(q.get() for _ in ps))
    for p in ps:
        p.join()
"""


def test_forkserver_workers_are_not_audited_and_the_summary_says_so(tmp_path):
    (tmp_path / "server.py").write_text(FORKSERVER)
    proc = python(tmp_path, "-m", "plusequals", "audit", "run", "server.py")
    assert proc.returncode == 0 and proc.stdout == "[2, 2]\n", proc.stderr
    assert proc.stderr == (
        "note: 2 forkserver worker processes not audited (their server runs unaudited)\nno errors in 0 audited calls\n"
    )
