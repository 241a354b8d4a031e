"""The false-positive sweep (issue 31): popular models, forward and backward in train mode, must
give no finding (``plusequals/audit/sweep.py``). The fast tests run a representative subset
(``sweep.SMALL``: the three CNNs the issue counted 17, 35 and 50 findings on, and some of each
other family) and check their rows of the README's table; the full sweep (80 torchvision models, 15 transformers
architectures, 3 diffusers models, about 2 minutes on 2 cores) is marked slow and runs when
``PLUSEQUALS_FULL_SWEEP=1`` (``make test`` has no room for it); it checks the whole README table.
"""

from __future__ import annotations

import os

import pytest

from plusequals.audit import sweep
from test_audit_corpus import readme_block

pytest.importorskip("torchvision", reason="the sweep needs torchvision (the test extra)")


def entry(family: str, name: str) -> sweep.Entry:
    return next(e for e in sweep.entries(family) if e.name == name)


def assert_clean(row: sweep.Row) -> None:
    r = row.report
    assert r.findings == [] and r.error is None and r.backward_error is None, (row.name, r.findings[:3], r.error)
    assert r.backward_skipped is None and r.ops > 100


@pytest.mark.parametrize("family,name", sweep.SMALL, ids=[n for _, n in sweep.SMALL])
def test_a_representative_model_is_clean_and_its_readme_row_current(family, name):
    pytest.importorskip(family)
    row = sweep.run(entry(family, name))
    assert_clean(row)
    table = readme_block("audit-sweep").splitlines()
    assert sweep.markdown([row]).splitlines()[-1] in table
    if name in sweep.MOVES:  # each in-place activation the issue counted as E0596 is a move
        assert sum(m.count for m in row.report.moves) == sweep.MOVES[name]
        assert all(m.writer and m.writer.endswith("(inplace=True)") for m in row.report.moves)


def test_the_meta_device_gives_what_cpu_tensors_give():
    """The sweep runs torchvision on the meta device: on real CPU tensors resnet18 gives the same
    (no finding, the same moves at the same lines)."""
    cpu, meta = (sweep.run(entry("torchvision", "resnet18"), device) for device in ("cpu", "meta"))
    assert_clean(cpu)
    assert [m.key() + (m.count,) for m in cpu.report.moves] == [m.key() + (m.count,) for m in meta.report.moves]
    assert len(cpu.report.moves) == sweep.MOVES["resnet18"]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PLUSEQUALS_FULL_SWEEP"), reason="2 minutes: PLUSEQUALS_FULL_SWEEP=1 runs it")
def test_the_full_sweep_is_clean_and_the_readme_table_current():
    rows = [sweep.run(e) for family in sweep.families() for e in sweep.entries(family)]
    for row in rows:
        assert_clean(row)
    assert len([r for r in rows if r.family == "torchvision"]) >= 80
    assert len([r for r in rows if r.family == "transformers"]) >= 10
    assert readme_block("audit-sweep") == sweep.markdown(rows)
