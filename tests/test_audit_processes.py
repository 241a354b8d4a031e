"""Findings made in other processes render exactly as the same findings made in the parent: a
DataLoader worker's finding keeps its caret's column (the child's ``co_positions``, carried in
its file: on a line with two writes, the caret stays under the right one), and a hogwild program
(``torch.multiprocessing`` trainers sharing one model) has its trainers' calls audited and
reported by the parent, the program's output its own."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from plusequals.auditing import sites
from support.programs import python

LOADER = """\
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Shift(nn.Module):
    def forward(self, x):
        a = x.clone(); a.sub_(0.5); x.sub_(0.5)  # noqa: E702
        return x * a


class Samples(Dataset):
    def __init__(self):
        self.rows = torch.arange(32.0).reshape(8, 4)
        self.transform = Shift()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.transform(self.rows[i])


if __name__ == "__main__":
    workers, context = int(sys.argv[1]), (sys.argv[2] if sys.argv[2] != "none" else None)
    loader = DataLoader(Samples(), batch_size=4, num_workers=workers, multiprocessing_context=context)
    print([b.sum().item() for b in loader])
"""


def test_a_forked_workers_finding_renders_as_the_same_finding_without_workers(tmp_path):
    (tmp_path / "loader.py").write_text(LOADER)
    alone = python(tmp_path, "-m", "plusequals", "audit", "run", "loader.py", "0", "none")
    forked = python(tmp_path, "-m", "plusequals", "audit", "run", "loader.py", "2", "fork")
    assert alone.returncode == forked.returncode == 1, (alone.stderr, forked.stderr)
    assert forked.stdout == alone.stdout
    note = "note: 8 of these calls ran in 2 forked worker processes\n"
    assert forked.stderr.replace(note, "") == alone.stderr  # every line, the carets' columns too
    # the caret under the write into `x`, not under `a.sub_` earlier on the line (what the
    # line's text alone would give), and the help names `x`
    assert "  --> loader.py:10:37\n" in alone.stderr
    assert " " * 36 + "^^^^^^ aten.sub_.Tensor writes into `x`" in alone.stderr
    assert "help: write `x = x - ...`" in alone.stderr


def test_what_a_process_knows_of_a_line_is_restored_in_another_without_overwriting():
    where, entry = "pe_test_restore/lib.py:3", "pe_test_restore/user.py:7"
    sites._COLUMNS[where], sites._ENTRIES[where] = (5, 9), entry
    sites._COLUMNS[entry] = (1, 4)
    try:
        known = sites.export([where, None, "?"])
        assert known[where]["columns"] == [5, 9] and known[where]["entry"] == entry
        assert known[entry]["columns"] == [1, 4]
        del sites._COLUMNS[where], sites._ENTRIES[where], sites._COLUMNS[entry]
        sites.restore(known)
        assert sites._COLUMNS[where] == (5, 9) and sites.entry(where) == entry and sites._COLUMNS[entry] == (1, 4)
        sites.restore({where: {"columns": [1, 2], "entry": "other.py:1"}})  # what is known stays
        assert sites._COLUMNS[where] == (5, 9) and sites.entry(where) == entry
        sites.restore({"x.py:1": {"columns": ["a", 2], "entry": 3}})  # a malformed record: ignored
        assert "x.py:1" not in sites._COLUMNS and sites.entry("x.py:1") is None
    finally:
        for table in (sites._COLUMNS, sites._ENTRIES):
            for key in (where, entry):
                table.pop(key, None)


HOGWILD = """\
import sys

import torch
import torch.multiprocessing as mp
from torch import nn


class Halve(nn.Module):
    def forward(self, x):
        x.mul_(0.5)
        return x


def train(rank, model, steps, done):
    torch.manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    done.put(rank)


if __name__ == "__main__":
    how, processes, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(Halve(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    model.share_memory()  # hogwild: every trainer updates the same parameters
    ctx = mp.get_context(how)
    done = ctx.SimpleQueue()
    if how == "spawn":  # torch.multiprocessing.spawn
        mp.spawn(train, args=(model, steps, done), nprocs=processes, join=True)
    else:
        trainers = [ctx.Process(target=train, args=(rank, model, steps, done)) for rank in range(processes)]
        for p in trainers:
            p.start()
        for p in trainers:
            p.join()
    print(sorted(done.get() for _ in range(processes)))
"""


@pytest.mark.parametrize("how", ["spawn", "fork"])
def test_hogwild_trainers_are_audited_and_reported_by_the_parent(tmp_path, how):
    """Two trainers, three steps each: six model calls, each audited in its trainer; the write
    into the batch (E0596) is reported once, seen six times, with the processes named. The
    program prints what it prints unaudited: the ranks that finished (no plain run: it would
    start three more interpreters to print the same line)."""
    (tmp_path / "hogwild.py").write_text(HOGWILD)
    audited = python(tmp_path, "-m", "plusequals", "audit", "run", "hogwild.py", how, "2", "3")
    assert audited.returncode == 1, audited.stderr  # the findings, from the trainers
    assert audited.stdout == "[0, 1]\n"
    err = audited.stderr
    assert err.startswith("error[E0596]: ")
    assert "  --> hogwild.py:10:9\n" in err and "   = note: the same write, seen 6 times\n" in err
    assert f"note: 6 of these calls ran in 2 {how}ed worker processes\n" in err
    assert err.rstrip().endswith("error: 1 error (E0596) in 6 audited calls")


TORCHVISION = """\
import sys

import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    def __init__(self):
        self.images = torch.rand(4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
        self.norm = T.Normalize((0.5,) * 3, (0.25,) * 3, inplace=True)

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.norm(self.images[i])


if __name__ == "__main__":
    print([b.sum().item() for b in DataLoader(Images(), batch_size=2, num_workers=int(sys.argv[1]))])
"""


def test_a_workers_library_write_is_placed_at_the_users_line_in_sarif(tmp_path):
    """torchvision's ``Normalize(inplace=True)`` in forked workers, audited from a subfolder of a
    git repository: each SARIF result lies at the user's line that called into torchvision (what
    the worker knew of the library's caller), as without workers, never a result without a location."""
    import json

    import jsonschema

    pytest.importorskip("torchvision")
    schema = json.loads((Path(__file__).parent / "data" / "sarif-schema-2.1.0.json").read_text())
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "images.py").write_text(TORCHVISION)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    logs = []
    for workers in ("0", "2"):
        out = f"out{workers}.sarif"
        proc = python(
            tmp_path / "src", "-m", "plusequals", "audit", "run", "--format", "sarif", "-o", out, "images.py", workers
        )
        assert proc.returncode == 1, proc.stderr
        logs.append(json.loads((tmp_path / "src" / out).read_text()))
        jsonschema.validate(logs[-1], schema)
    (alone,), (forked,) = [log["runs"] for log in logs]
    assert alone["results"] and forked["results"] == alone["results"]
    for result in forked["results"]:
        (location,) = result["locations"]
        assert location["physicalLocation"]["artifactLocation"] == {"uri": "src/images.py", "uriBaseId": "%SRCROOT%"}
        assert location["physicalLocation"]["region"]["startLine"] == 17
