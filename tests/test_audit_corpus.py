"""The audit on real bugs: twenty in-place and aliasing bugs from public issues,
each a minimal module with the original's structure and its fixed twin
(``plusequals/cases/corpus.py``, with the URLs). Each bug must be found at the line its fix
changed or at the read that broke; each fixed twin must give no finding.
"""

from __future__ import annotations

import pytest

from plusequals.cases import corpus
from support.docs import guide_block


@pytest.fixture(scope="module")
def results():
    return corpus.results()


def test_the_corpus_has_twenty_real_bugs_from_distinct_sources():
    assert len(corpus.CAUGHT) >= 20
    assert all(c.url.startswith("https://github.com/") for c in corpus.CAUGHT + corpus.MISSED)
    assert corpus.MISSED == ()  # every bug found so far is caught
    assert len({c.name for c in corpus.CAUGHT}) == len(corpus.CAUGHT)
    assert {c.code for c in corpus.CAUGHT} == {"E0596", "E0382", "E0502", "E0499"}


@pytest.mark.parametrize("index", range(len(corpus.CAUGHT)), ids=[c.name for c in corpus.CAUGHT])
def test_each_bug_is_caught_at_its_line_and_its_fixed_twin_is_silent(results, index):
    r = results[index]
    assert r.hit is not None, (corpus.expected_line(r.case), r.bug.findings)
    assert r.fixed.findings == [] and r.fixed.error is None and r.fixed.backward_error is None
    if r.case.code == "E0502":  # PyTorch's own backward refuses the bug, and only the bug
        assert "modified by an inplace operation" in (r.bug.backward_error or "")


def test_two_live_names_for_one_tensor_in_one_function_is_E0499():
    """The ControlNet bug writes through `res`, which is also `sample`, and `sample` is read
    afterwards: E0499 at the write, with the read's line; so does the seed's `h = x; x += 1; h += 2`
    (a view of a temporary, its reborrow, is test_audit_rule.py's)."""
    import torch
    from torch import nn

    from plusequals.auditing import audit

    case = next(c for c in corpus.CAUGHT if c.code == "E0499")
    (f,) = corpus.run_case(case, fixed=False).findings
    assert f.where == corpus.expected_line(case)
    assert f.read_at == corpus.expected_line(case._replace(line=(case.line[0], "return self.mid(sample)")))

    class TwoNames(nn.Module):
        def forward(self, x):
            x = x * 1
            h = x
            x += 1  # E0499: h is read below
            h += 2
            return h

    (g,) = audit(TwoNames(), torch.randn(3)).findings
    assert g.code == "E0499" and g.where.endswith(str(TwoNames.forward.__code__.co_firstlineno + 3))


def test_the_readmes_corpus_table_is_current(results):
    assert guide_block("audit-corpus") == corpus.markdown(results + corpus.results(corpus.MISSED))


def test_two_names_are_caught_once_a_module_boundary_or_autograd_is_between_them():
    """What is caught of the same pattern: when the in-place add happens in a module that was
    given the tensor, the caller's other name read afterwards is E0382, with the read's line (and
    had autograd saved the tensor, the write would be E0502, as in the corpus)."""
    import torch
    from torch import nn

    from plusequals.auditing import audit
    from plusequals.auditing.frames import short_path

    class AddResidual(nn.Module):
        def forward(self, res, extra):
            res += extra
            return res

    class ControlNetThroughAModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down, self.mid, self.add = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), AddResidual()

        def forward(self, sample, extra):
            sample = self.down(sample)
            res_samples = (sample,)
            new = tuple(self.add(r, extra) for r in res_samples)
            return self.mid(sample) + new[0]

    x, extra = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        report = audit(ControlNetThroughAModule(), x, extra)
    (f,) = report.findings
    line = ControlNetThroughAModule.forward.__code__.co_firstlineno + 4
    assert f.code == "E0382" and f.read_at == f"{short_path(__file__)}:{line}", f
