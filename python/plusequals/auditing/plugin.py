"""The pytest plugin (entry point ``pytest11``): ``pytest --plusequals-audit`` audits every
outermost ``nn.Module`` call each test makes (fixtures' setup is not audited) and fails a test
with findings, showing rustc's diagnostics; ``--plusequals-audit-backward`` also runs a backward
from each call's outputs that need grad. Off unless asked for: without the options a test runs
as it would without the plugin.
"""

from __future__ import annotations

from typing import Any, Generator

import pytest

from .diagnostics import build, not_audited_text, render
from .scope import AuditScope

SECTION = "plusequals audit"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("plusequals", "plusequals: rustc's verdicts on PyTorch code")
    group.addoption(
        "--plusequals-audit",
        action="store_true",
        help="audit every outermost nn.Module call of each test; a test with findings fails",
    )
    group.addoption(
        "--plusequals-audit-backward",
        action="store_true",
        help="as --plusequals-audit, and a backward from each call's outputs that need grad",
    )


def _enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("plusequals_audit") or config.getoption("plusequals_audit_backward"))


def _report(item: pytest.Item, scope: AuditScope, fail: bool) -> None:
    """Fails the test when its calls broke a rule (``fail``: the test itself passed); otherwise
    shows the diagnostics (warnings, or findings of a test that failed on its own) beside it."""
    unused = scope.finish([str(item.path)])
    calls = [(c.module, c.report) for c in scope.calls]
    diagnostics = build(calls, unused)
    if not diagnostics:
        said = [*scope.notes(), not_audited_text(scope.not_audited)]
        if any(said):  # calls in workers, calls the audit stepped aside for: said, never dropped
            item.add_report_section("call", SECTION, "".join(f"note: {s}\n" for s in said if s))
        return
    text = render(calls, unused, color=False, not_audited=scope.not_audited, notes=scope.notes())
    if fail and any(d.level == "error" for d in diagnostics):
        pytest.fail("plusequals audit: the test's module calls broke rustc's rules\n\n" + text, pytrace=False)
    item.add_report_section("call", SECTION, text)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    if not _enabled(item.config):
        return (yield)
    scope = AuditScope(backward=bool(item.config.getoption("plusequals_audit_backward")))
    try:
        with scope:
            result = yield
    except BaseException:
        _report(item, scope, fail=False)
        raise
    _report(item, scope, fail=True)
    return result
