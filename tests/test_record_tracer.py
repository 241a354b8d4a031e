"""Which tracer the recorder (twin/record.py) starts, testable on any CPython: ``sys.monitoring``
where the interpreter has it (3.12+), ``sys.setprofile`` where not (3.11). The 3.12 path itself
ran the watch's tests on CPython 3.12.1 (docs/guide/guarantees.md, "The watch's contract"); here a
stand-in for ``sys.monitoring`` checks what the recorder asks of it."""

from __future__ import annotations

import cProfile
import pstats
import sys
import types

import torch

from plusequals.twin import record


class FakeMonitoring:
    """What the recorder uses of ``sys.monitoring``, recorded."""

    def __init__(self, taken: int = 0) -> None:
        self.events = types.SimpleNamespace(PY_START=1)
        self.tools = {t: "other" for t in range(taken)}
        self.callbacks: dict = {}
        self.set: dict = {}
        self.freed: list = []

    def get_tool(self, tool):
        return self.tools.get(tool)

    def use_tool_id(self, tool, name):
        assert tool not in self.tools
        self.tools[tool] = name

    def register_callback(self, tool, event, callback):
        self.callbacks[tool] = callback

    def set_events(self, tool, events):
        self.set[tool] = events

    def free_tool_id(self, tool):
        self.freed.append(tool)
        del self.tools[tool]


def test_monitoring_is_used_where_the_interpreter_has_it_and_every_frame_start_is_passed_on():
    mon = FakeMonitoring(taken=2)
    frames = []
    before = sys.getprofile()
    stop = record._start(frames.append, mon)
    assert mon.tools[2] == "plusequals.record" and mon.set[2] == mon.events.PY_START
    assert sys.getprofile() is before, "no profiler set"
    mon.callbacks[2](None, 0)  # as the interpreter calls it: from the started frame's first instruction
    assert frames == [sys._getframe()]
    stop()
    assert mon.freed == [2] and mon.set[2] == 0 and mon.callbacks[2] is None and 2 not in mon.tools


def test_no_free_tool_id_records_nothing_and_runs_the_call():
    mon = FakeMonitoring(taken=6)
    assert record._start(lambda frame: None, mon) is None
    recorder = record.Recorder()
    original = record._start
    record._start = lambda started, monitoring=None: original(started, mon)
    try:
        assert recorder.call(lambda: 42) == 42
    finally:
        record._start = original
    assert recorder.ran is None


def test_without_monitoring_the_profiler_is_used(monkeypatch):
    """3.11's path, on any interpreter: ``sys.monitoring`` absent, ``sys.setprofile`` records."""
    monkeypatch.delattr(sys, "monitoring", raising=False)
    frames = []

    def inner():
        return 1

    stop = record._start(frames.append)
    try:
        inner()
    finally:
        stop()
    assert any(f.f_code is inner.__code__ for f in frames)
    assert sys.getprofile() is None, "the previous profiler (none) put back"


def test_the_recorder_adds_every_call_to_one_run():
    def a():
        return 1

    def b():
        return 2

    recorder = record.Recorder()
    recorder.call(a)
    first = recorder.ran
    recorder.call(b)
    codes = {code for code, _, _ in recorder.ran.frames}
    assert a.__code__ in codes and b.__code__ in codes and recorder.ran is not first
    recorder.ops = "trace"
    assert recorder.ran.ops == "trace"


def test_a_python_profiler_already_set_sees_every_event_and_is_put_back(monkeypatch):
    monkeypatch.delattr(sys, "monitoring", raising=False)
    events, frames = [], []

    def theirs(frame, event, arg):
        events.append((frame.f_code.co_name, event))

    def inner():
        return 1

    sys.setprofile(theirs)
    try:
        stop = record._start(frames.append)
        inner()
        stop()
        assert sys.getprofile() is theirs
    finally:
        sys.setprofile(None)
    assert ("inner", "call") in events and ("inner", "return") in events
    assert any(f.f_code is inner.__code__ for f in frames)


def test_under_cprofile_the_trace_function_records_and_cprofile_keeps_profiling(monkeypatch):
    """3.11's path under cProfile (a profiler in C: Python cannot call what ``sys.getprofile()``
    gives): the trace function records the frames instead, and is taken off after; the profiler
    is left as it was, profiling, through ``from_torch`` (which used to fail its probe with
    "'Profile' object is not callable")."""
    from plusequals import RustBlock
    from plusequals.model.blocks import BasicTransformerBlock

    monkeypatch.delattr(sys, "monitoring", raising=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        block = BasicTransformerBlock(32, 4, 8, context_dim=24)
        x, c = torch.randn(2, 5, 32), torch.randn(2, 3, 24)

    def after():
        return 2

    def inner():
        return 1

    frames = []
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        held = sys.getprofile()
        stop = record._start(frames.append)
        inner()
        stop()
        assert sys.getprofile() is held and sys.gettrace() is None
        twin = RustBlock.from_torch(block)
        assert sys.getprofile() is held and sys.gettrace() is None
        after()
    finally:
        profiler.disable()
    assert any(f.f_code is inner.__code__ for f in frames)
    assert twin._follow.ran is not None, "the check's run was recorded"
    with torch.no_grad():
        torch.testing.assert_close(twin(x, c), block(x, c), rtol=1e-5, atol=1e-6)
    names = {fn for (_, _, fn) in pstats.Stats(profiler).stats}
    assert {"after", "from_torch"} <= names


def test_under_cprofile_and_a_tracer_nothing_is_recorded_and_both_are_left(monkeypatch):
    """3.11's path with both functions held (cProfile's, and a debugger's or coverage's trace
    function): nothing is recorded, and both are left as they were, seeing every call."""
    monkeypatch.delattr(sys, "monitoring", raising=False)
    traced = []

    def theirs(frame, event, arg):
        traced.append((frame.f_code.co_name, event))

    def inner():
        return 1

    profiler = cProfile.Profile()
    sys.settrace(theirs)
    profiler.enable()
    try:
        held = sys.getprofile()
        assert record._start(lambda frame: None) is None
        inner()
        assert sys.getprofile() is held and sys.gettrace() is theirs
    finally:
        profiler.disable()
        sys.settrace(None)
    assert ("inner", "call") in traced
    assert "inner" in {fn for (_, _, fn) in pstats.Stats(profiler).stats}
