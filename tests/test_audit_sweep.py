"""The false-positive sweep: popular models, forward and backward in train mode, must give no
finding (``plusequals/cases/sweep.py``), and each checks its row of the guide's table, which must
list every model once. ``make test`` runs one model of each architecture (``sweep.representatives``:
17 torchvision code families, every transformers and diffusers model); the others carry the
``sweep`` marker, which ``make test`` leaves out and ``make sweep`` runs, after regenerating the
tables. Plain ``pytest`` runs them all. The heaviest (``sweep.SLOW``) are also marked slow.
"""

from __future__ import annotations

import pytest

from plusequals.cases import sweep
from support.docs import guide_block

pytest.importorskip("torchvision", reason="the sweep needs torchvision (the test extra)")


def entry(family: str, name: str) -> sweep.SweepModel:
    return next(e for e in sweep.entries(family) if e.name == name)


def assert_clean(row: sweep.SweepResult) -> None:
    r = row.report
    assert r.findings == [] and r.error is None and r.backward_error is None, (row.name, r.findings[:3], r.error)
    assert r.backward_skipped is None and r.ops >= 40  # the forward's ops (backward's C++ formulas are not dispatched)


def _models(slow: bool) -> list:
    return [(f, e.name) for f in sweep.families() for e in sweep.entries(f) if ((f, e.name) in sweep.SLOW) == slow]


def check(family: str, name: str) -> None:
    """The model is clean and its README row current; three CNNs' in-place activations are moves."""
    row = sweep.run(entry(family, name))
    assert_clean(row)
    assert sweep.markdown([row]).splitlines()[-1] in guide_block("audit-sweep").splitlines()
    if name in sweep.MOVES:  # each in-place activation is a move, not an E0596
        assert sum(m.count for m in row.report.moves) == sweep.MOVES[name]
        assert all(m.writer and m.writer.endswith("(inplace=True)") for m in row.report.moves)


DEFAULT = _models(slow=False)
SUBSET = [(e.family, e.name) for e in sweep.representatives()]


@pytest.mark.parametrize("family,name", SUBSET, ids=[f"{f}-{n}" for f, n in SUBSET])
def test_a_model_of_each_architecture_is_clean_and_its_readme_row_current(family, name):
    check(family, name)


def test_the_subset_is_one_model_of_each_architecture():
    """make test's subset covers every architecture once, the models whose moves are counted among
    them; the rest of the sweep is every other model."""
    everything = [(f, e.name) for f in sweep.families() for e in sweep.entries(f)]
    arch = {(f, e.name): (f, sweep.architecture(e)) for f in sweep.families() for e in sweep.entries(f)}
    assert sorted(arch[m] for m in SUBSET) == sorted(set(arch.values()))
    assert {("torchvision", n) for n in sweep.MOVES} <= set(SUBSET)
    assert sorted(SUBSET + REST) == sorted(everything) and not set(SUBSET) & set(REST)
    assert len({a for f, a in arch.values() if f == "torchvision"}) >= 15


def test_the_readme_table_lists_every_model_of_the_sweep_once():
    """The table's rows (of the installed families) are the sweep's models, in its order: at least
    80 torchvision models and 10 transformers architectures; each slow one is a model of it."""
    installed = sweep.families()
    rows = [tuple(cell.strip() for cell in line.split("|")[1:3]) for line in guide_block("audit-sweep").splitlines()]
    listed = [row for row in rows[2:] if row[0] in installed]
    models = [(f, e.name) for f in installed for e in sweep.entries(f)]
    assert listed == models and set(sweep.SLOW) <= set(rows)
    count = {family: len([f for f, _ in rows if f == family]) for family in ("torchvision", "transformers")}
    assert count["torchvision"] >= 80 and count["transformers"] >= 10
    assert {("torchvision", n) for n in sweep.MOVES} <= set(DEFAULT) and len(DEFAULT) >= 60


def test_the_meta_device_gives_what_cpu_tensors_give():
    """The sweep runs torchvision on the meta device: on real CPU tensors resnet18 gives the same
    (no finding, the same moves at the same lines)."""
    cpu, meta = (sweep.run(entry("torchvision", "resnet18"), device) for device in ("cpu", "meta"))
    assert_clean(cpu)
    assert [m.key() + (m.count,) for m in cpu.report.moves] == [m.key() + (m.count,) for m in meta.report.moves]
    assert len(cpu.report.moves) == sweep.MOVES["resnet18"]


REST = [m for m in DEFAULT + _models(slow=True) if m not in SUBSET]


@pytest.mark.sweep
@pytest.mark.parametrize(
    "family,name",
    [pytest.param(*m, marks=[pytest.mark.slow] if m in sweep.SLOW else []) for m in REST],
    ids=[f"{f}-{n}" for f, n in REST],
)
def test_every_other_model_is_clean_and_its_readme_row_current(family, name):
    check(family, name)
