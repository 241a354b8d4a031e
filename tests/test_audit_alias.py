"""Two names for one tensor (``E0499``) as rustc's non-lexical lifetimes judge them: a borrow
ends at its last use, so two names for one value are an error only when their uses interleave.

* legal: a helper writes through its parameter and the caller reads the name it lent after the
  helper returned (``fn f(m: &mut T)`` then ``f(&mut m); m``), also when the caller lent a
  container or a container's slot, in a loop, or wrote through a name taken from another
  (``for t in ts``, ``h = m``) and then read the one it was taken from;
* illegal: a name taken before the write and used after it (the seed's ``h = x; x += a; h``),
  also when the write is a helper's, in a loop, or when a name taken from another is used again
  after that other was read.

Shapes are generated (hypothesis) as source text, each line marked with what it is; the real
case is a torchvision Faster R-CNN train step (its ``Matcher`` writes ``matches`` through a
helper's parameter), clean and bitwise equal to a plain step.
"""

from __future__ import annotations

import copy
import itertools
import re
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from plusequals.auditing import audit

# Ways to write through a name `{n}`: each is an in-place write into the tensor object it names
# (`{n}[0] = ...` writes a view of it, which E0499 does not compare: see the guide's limits).
WRITES = (
    "{n}.add_(1.0)",
    "{n} += 1.0",
    "{n}[torch.tensor([0, 2])] = 0.5",
    "{n}.mul_(2.0)",
    "{n}.clamp_(min=0.0)",
    "{n}.copy_({n} * 2.0)",
    "torch.add({n}, 1.0, out={n})",
    "{n}.index_fill_(0, torch.tensor([1]), 0.0)",
)

_counter = itertools.count()


def run_shape(body: List[str], helper: Optional[str]) -> Tuple[object, Dict[str, str]]:
    """Audits ``f(x)`` whose body is ``body`` (lines; a line ending in ``# mark`` is looked for
    by that mark), with ``helper(m)`` writing ``helper`` through its parameter; returns the
    report and ``mark -> path:line``."""
    filename = f"<alias-shape-{next(_counter)}>"
    lines = ["def helper(m):", f"    {helper or 'pass'}", "def f(x):", "    m = x * 1.0"]
    lines += ["    " + line for line in body]
    marks = {}
    for i, line in enumerate(lines, start=1):
        if "# " in line:
            marks[line.rsplit("# ", 1)[1]] = f"{filename}:{i}"
    namespace: dict = {"torch": torch}
    exec(compile("\n".join(lines) + "\n", filename, "exec"), namespace)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        report = audit(namespace["f"], torch.randn(4, 3, generator=g))
    assert report.error is None, report.error
    return report, marks


def write(name: str, how: int) -> str:
    return WRITES[how].format(n=name)


def through(name: str, how: int, by_helper: bool) -> str:
    """The write through ``name``: in place, or by the helper given ``name``."""
    return f"helper({name})" if by_helper else write(name, how)


def loop(lines: List[str], times: int) -> List[str]:
    """``lines`` run ``times`` times (1: as they are)."""
    return lines if times == 1 else [f"for _ in range({times}):"] + ["    " + line for line in lines]


CONTAINERS = {"list": "[{v}, x * 2.0]", "tuple": "({v}, x * 2.0)", "dict": "{{'k': {v}, 'o': x * 2.0}}"}
SLOT = {"list": "[0]", "tuple": "[0]", "dict": "['k']"}

hows = st.integers(0, len(WRITES) - 1)


@settings(max_examples=examples(60), deadline=None)
@given(hows, st.integers(1, 3), st.sampled_from(["name", "slot", "container", "loop variable"]))
def test_a_helper_writing_through_its_parameter_then_the_callers_read_is_legal(how, times, lent):
    """``f(&mut m); m``: the caller lends ``m`` (or a container's slot, or the container, or each
    element in a loop over it) to a helper that writes through its parameter and returns None;
    the caller reads it after the helper returned: the parameter's borrow ended with its frame."""
    kind = "list"
    if lent == "name":
        body, helper = loop(["helper(m)"], times), write("m", how)
        body.append("return m.sum()")
    else:
        body = [f"ms = {CONTAINERS[kind].format(v='m')}"]
        if lent == "slot":
            body += loop([f"helper(ms{SLOT[kind]})"], times)
            helper = write("m", how)
        elif lent == "container":
            body += loop(["helper(ms)"], times)
            helper = write(f"m{SLOT[kind]}", how)
        else:
            body += loop(["for t in ms:", "    helper(t)"], times)
            helper = write("m", how)
        body.append(f"return ms{SLOT[kind]}.sum() + m.sum()" if lent == "slot" else f"return ms{SLOT[kind]}.sum()")
    report, _ = run_shape(body, helper)
    assert report.clean, report.findings


@settings(max_examples=examples(60), deadline=None)
@given(hows, st.integers(1, 3), st.sampled_from(list(CONTAINERS)), st.booleans())
def test_a_name_taken_from_another_then_written_and_the_other_read_is_a_reborrow(how, times, kind, by_helper):
    """``let h = &mut m; *h += 1; m``, and ``for t in ts.iter_mut() { .. }; ts``: the name
    written through was taken from the one read afterwards, and is not used after that read."""
    report, _ = run_shape(loop(["h = m", through("h", how, by_helper)], times) + ["return m.sum()"], write("m", how))
    assert report.clean, report.findings
    body = [f"ts = {CONTAINERS[kind].format(v='m')}"]
    if kind == "dict":
        body += loop(["for t in ts.values():", "    " + through("t", how, by_helper)], times)
    else:
        body += loop(["for t in ts:", "    " + through("t", how, by_helper)], times)
    report, _ = run_shape(body + [f"return ts{SLOT[kind]}.sum()"], write("m", how))
    assert report.clean, report.findings


@settings(max_examples=examples(60), deadline=None)
@given(hows, st.integers(1, 3), st.sampled_from(["name", *CONTAINERS]), st.booleans())
def test_a_name_taken_before_the_write_and_used_after_it_is_E0499(how, times, holder, by_helper):
    """The seed's ``h = x; x += a; h``: ``h`` is taken before the write through ``m`` (in place
    or lent to a helper) and used after it: the uses interleave, ``E0499`` at the write with the
    read's line."""
    kept, read = ("h = m", "h") if holder == "name" else (f"h = {CONTAINERS[holder].format(v='m')}", f"h{SLOT[holder]}")
    body = (
        [kept] + loop([through("m", how, by_helper) + "  # write"], times) + [f"s = {read}.sum()  # read", "return s"]
    )
    report, marks = run_shape(body, write("m", how) + "  # helper write")
    (f,) = report.findings
    assert f.code == "E0499" and f.read_at == marks["read"], f
    assert f.where == marks["helper write" if by_helper else "write"]


@settings(max_examples=examples(40), deadline=None)
@given(hows, st.sampled_from(list(CONTAINERS)), st.booleans())
def test_a_reborrow_used_again_after_the_name_it_was_taken_from_is_E0499(how, kind, by_helper):
    """``let h = &mut m; *h += 1; m.sum(); h.sum()``: the read of ``m`` falls inside ``h``'s
    borrow; the same in a loop over a container whose element is used after the container's read."""
    body = ["h = m", through("h", how, by_helper) + "  # write", "s = m.sum()", "return s + h.sum()  # read"]
    report, marks = run_shape(body, write("m", how) + "  # helper write")
    (f,) = report.findings
    assert f.code == "E0499" and f.read_at == marks["read"], f
    assert f.where == marks["helper write" if by_helper else "write"]
    each = "ts.values()" if kind == "dict" else "ts"
    body = [f"ts = {CONTAINERS[kind].format(v='m')}", "s = 0.0", f"for t in {each}:"]
    body += ["    " + through("t", how, by_helper), f"    s = s + ts{SLOT[kind]}.sum()", "    s = s + t.sum()  # read"]
    report, marks = run_shape(body + ["return s"], write("m", how))
    assert report.codes == ["E0499"] and report.findings[0].read_at == marks["read"], report.findings


def test_the_fixed_twin_of_a_normalising_helper_is_clean_and_the_seed_still_caught():
    """A function clones its input, hands the clone to a helper that normalises it in place and
    returns the clone (the fix of an in-place bug): legal. The seed's ``h = x; x += a; h += b``
    next to it: E0499."""
    report, _ = run_shape(["y = x.clone()", "helper(y)", "return y"], "m.sub_(m.mean()).div_(m.std())")
    assert report.clean, report.findings
    report, marks = run_shape(["h = m", "m += 1.0  # write", "h += 2.0  # read", "return h"], None)
    assert [(f.code, f.where, f.read_at) for f in report.findings] == [("E0499", marks["write"], marks["read"])]


# ----------------------------------------------------------------------------- the real case
tv = pytest.importorskip("torchvision", reason="the detection step needs torchvision (the test extra)")


def _detection_step(model, images, targets):
    losses = model(images, targets)
    return sum(losses[k] for k in sorted(losses))


def test_a_torchvision_detection_train_step_is_clean_and_runs_as_without_the_audit():
    """torchvision's ``Matcher`` writes ``matches`` through ``set_low_quality_matches_``'s
    parameter and then returns it: a reborrow, no finding. The audited step computes the same
    losses and gradients, bit for bit, as a plain one from the same seed."""
    from torchvision.models import detection

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        kw = {"min_size": 64, "max_size": 64, "num_classes": 3, "weights": None, "weights_backbone": None}
        plain = detection.fasterrcnn_mobilenet_v3_large_320_fpn(**kw).train()
    audited = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 64, 64, generator=g) for _ in range(2)]
    targets = [
        {"boxes": torch.tensor([[4.0, 6.0, 30.0, 40.0], [20.0, 8.0, 60.0, 50.0]]), "labels": torch.tensor([1, 2])},
        {"boxes": torch.tensor([[10.0, 10.0, 50.0, 40.0]]), "labels": torch.tensor([2])},
    ]

    outs = []

    def step(model, images, targets):
        out = _detection_step(model, images, targets)
        outs.append(out.detach())
        return out

    with torch.random.fork_rng(devices=[]):  # the samplers draw from the global generator
        torch.manual_seed(2)
        loss = _detection_step(plain, images, targets)
        loss.backward()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        report = audit(step, audited, images, targets, backward=True)
    assert report.error is None and report.backward_error is None, (report.error, report.backward_error)
    assert report.findings == [], report.findings
    assert torch.equal(outs[0], loss.detach())
    for (name, p), q in zip(plain.named_parameters(), audited.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


# How a second name gets the tensor object without being taken from the first in the code: an
# attribute, a dict the frame does not hold, a function's return. (`h = m`: taken, for contrast.)
SECOND = {
    "attribute": ("box.t = m", "h = box.t"),
    "global dict": ("CACHE['t'] = m", "h = CACHE['t']"),
    "call": ("box.t = m", "h = box.get()"),
    "taken": ("pass", "h = m"),
}


@settings(max_examples=examples(40), deadline=None)
@given(hows, st.sampled_from(sorted(SECOND)), st.booleans())
def test_the_limit_a_second_name_not_taken_in_the_code_is_read_as_taken_before_the_write(how, second, by_helper):
    """The limit the guide states: ``h`` names ``m``'s tensor but was not taken from ``m`` in the
    code (through an attribute, a dict, a call), so the audit cannot tell a reborrow of ``m``
    (``let h = &mut *m; *h += 1; m``: legal) from a second borrow taken while ``m`` lives (Rust
    refuses it): writing through ``h`` and then reading ``m`` is ``E0499``, where ``h = m``, taken
    in the code, is a reborrow and clean. Telling them apart needs how each binding was made at run
    time, from the frame's start (every frame traced); and names taken in the code are not values
    (``sample, res = block(sample)`` takes ``res`` from the old ``sample``)."""
    store, load = SECOND[second]
    body = [store, load, through("h", how, by_helper) + "  # write", "return m.sum()  # read"]
    filename = f"<alias-limit-{next(_counter)}>"
    lines = [
        "class Box:",
        "    def get(self):",
        "        return self.t",
        "box = Box()",
        "CACHE = {}",
        "def helper(m):",
        f"    {write('m', how)}  # helper write",
        "def f(x):",
        "    m = x * 1.0",
    ] + ["    " + line for line in body]
    marks = {line.rsplit("# ", 1)[1]: f"{filename}:{i}" for i, line in enumerate(lines, 1) if "# " in line}
    namespace: dict = {"torch": torch}
    exec(compile("\n".join(lines) + "\n", filename, "exec"), namespace)
    with torch.no_grad():
        report = audit(namespace["f"], torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    assert report.error is None, report.error
    if second == "taken":
        assert report.clean, report.findings
    else:
        (f,) = report.findings
        assert f.code == "E0499" and f.read_at == marks["read"], f
        assert f.where == marks["helper write" if by_helper else "write"]


# A temporary that an aten composite makes and writes: dropout's mask (``empty_like(x).bernoulli_(1 - p)``
# and ``div_``, on the CPU), which no frame can name.
DROPOUT = "d = torch.nn.functional.dropout(m * 1.0, 0.5, training=True)"


def _findings(report) -> list:
    """The findings and moves, each shape's file named alike (each run of a shape is a new file)."""
    return [re.sub(r"<alias-shape-\d+>", "<shape>", repr(f)) for f in report.findings + report.moves]


def _audited_with(threshold: int, body: List[str], helper: Optional[str]) -> Tuple[list, int]:
    """``run_shape`` with the write watch's own-reference count set to ``threshold``; its findings,
    and how many writes had the frames searched for other names."""
    from plusequals.auditing import mode

    searched = []
    search = mode.WriteWatch._aliases
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mode, "_WRITES_OWN", threshold)
        patch.setattr(mode.WriteWatch, "_aliases", lambda self, t: searched.append(1) or search(self, t))
        with torch.random.fork_rng():
            torch.manual_seed(0)
            report, _ = run_shape(body, helper)
    return _findings(report), len(searched)


@settings(max_examples=examples(30), deadline=None)
@given(hows, st.sampled_from(["name", *CONTAINERS]), st.booleans(), st.booleans(), st.data())
def test_a_temporary_no_frame_holds_is_not_searched_and_no_finding_changes(how, holder, by_helper, read, data):
    """A written tensor that nothing but the write references (``sys.getrefcount`` at its own
    count) cannot have a name in any frame, so the frames are not searched for one. The count is
    exact: one lower and dropout's mask is searched. Searching every write instead finds the same:
    generated shapes (the seed's ``h = x; x += a; h`` or its legal twin) with dropout's writes
    around them."""
    from plusequals.auditing import mode

    kept = "h = m" if holder == "name" else f"h = {CONTAINERS[holder].format(v='m')}"
    use = "h" if holder == "name" else f"h{SLOT[holder]}"
    body = [kept, through("m", how, by_helper), f"s = {use}.sum()" if read else "s = m.sum()", "return s + d.sum()"]
    body.insert(data.draw(st.integers(0, len(body) - 1)), DROPOUT)
    helper = write("m", how)
    found, searched = _audited_with(mode._WRITES_OWN, body, helper)
    every, all_searched = _audited_with(-1, body, helper)
    assert found == every
    assert all_searched - searched == 2  # dropout's bernoulli_ and div_ on its mask
    _, one_lower = _audited_with(mode._WRITES_OWN - 1, body, helper)
    assert one_lower == all_searched
