"""The writes: a TorchDispatchMode that sees every aten op, takes the tensors its schema says it
writes, and asks who owned that memory.

* A running module's argument: the caller's names that held it are watched (``E0382`` when one
  is read after the write). Whether the write is ``E0596`` depends on who else holds the memory
  after the call (:meth:`ModuleWatch.kept`): a parameter, a buffer, a tensor attribute of a
  watched module, or an argument of the audited call itself (the user's tensor, whose later
  reads the audit cannot see). Held by none of them, and read by no name afterwards, it was a
  temporary that the module took by value: a *move*, recorded in ``moves``, never a finding.
* A tensor autograd saved: ``E0502``, once the write is known to have bumped the version counter.
  The same mode shows :class:`.saved.SavedTensors` each op's outputs' autograd nodes, at the next
  op (autograd attaches them once the op has returned through it).

In backward the mode watches only the Python code that backward runs (a checkpoint's
recomputation, a custom Function's backward, hooks): :class:`PythonCalls`, a TorchFunctionMode,
runs each torch call made from Python under it. The ops of autograd's own C++ formulas, which
write nothing a program holds, are not dispatched to Python at all.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Dict, List, Literal, NamedTuple, Optional, Set, Tuple

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .exports import Export, Exports
from .frames import (
    MoveTracer,
    call_names,
    function_holding,
    holders,
    is_user,
    line_names,
    location,
    mutation_site,
    short_path,
    taken_from,
    user_frame,
)
from .memory import WRITES, Span, Writes, span, writes, writes_of
from .modules import Arg, Call, ModuleWatch
from .report import Finding
from .saved import Saved, SavedTensors, hooks_active, overwritten, reachable
from .sites import write_site

__all__ = ["FindingLog", "PythonCalls", "WriteWatch"]


class WatchedWrite(NamedTuple):
    """A write that the names watched with it make a finding if they are read afterwards.
    ``kind`` says which: ``"move"``, a write into a running module's argument (a name that held
    the value, read after, is ``E0382``); ``"alias"``, a write through one name into a tensor
    object another live name still holds (that name, read after, is ``E0499``)."""

    kind: Literal["move", "alias"]
    seq: int
    module: str
    where: str
    op: str
    writer: Optional[str]


class Reborrow(NamedTuple):
    """A name that the names written through were taken from (``for t in ts``, ``t = ts[i]``,
    ``h = x``): reading it after the write is legal (a reborrow ends at its last use), unless one
    of ``through`` is used after that read (then the uses interleave)."""

    alias: WatchedWrite
    through: Tuple[str, ...]


class Interleaved(NamedTuple):
    """``source`` was read at ``read_at`` after the write through ``alias``; one of the names
    taken from it is watched: its next read is ``E0499``."""

    alias: WatchedWrite
    source: str
    read_at: str


class Candidate(NamedTuple):
    """A write into saved tensors: a finding once the write bumped a version (see saved.py)."""

    seq: int
    module: str
    where: str
    op: str
    phase: str  # "forward", or "backward" (a checkpoint's recomputation)
    entries: List[Saved]
    writer: Optional[str]


class FindingLog:
    """The findings in the order their writes happened, the same write counted once."""

    def __init__(self) -> None:
        self._found: Dict[tuple, List[Any]] = {}
        self._moves: Dict[int, Finding] = {}  # seq -> the move, until a name that held it is read
        self._later: Dict[int, List[int]] = {}  # seq -> later writes into the memory its names held
        self.seq = 0

    def next(self) -> int:
        self.seq += 1
        return self.seq

    def add(self, seq: int, finding: Finding) -> None:
        entry = self._found.get(finding.key())
        if entry is None:
            self._found[finding.key()] = [seq, finding]
        else:
            entry[1] = Finding(**{**entry[1].__dict__, "count": entry[1].count + 1})

    def move(self, seq: int, finding: Finding) -> None:
        self._moves[seq] = finding

    def same_value(self, first: int, seq: int) -> None:
        """``seq`` wrote into memory that the names moved by write ``first`` still hold."""
        if first != seq:
            self._later.setdefault(first, []).append(seq)

    def on_read(self, frame: FrameType, name: str, move: Any) -> None:
        read_at = location(frame)
        if isinstance(move, Interleaved):
            a = move.alias
            message = (
                f"`{move.source}` was read at {move.read_at}, after the write through `{name}` ({a.op} at "
                f"{a.where}), and `{name}`, taken from it, is used again here: their uses interleave"
            )
            self.add(a.seq, Finding("E0499", a.module, a.where, a.op, message, read_at, writer=a.writer))
            return
        if move.kind == "alias":
            message = (
                f"`{name}` names the tensor that was written through another name ({move.op} at {move.where}) "
                "and is read after the write: two live names for one tensor, one of them written"
            )
            self.add(move.seq, Finding("E0499", move.module, move.where, move.op, message, read_at, writer=move.writer))
            return
        for seq in (move.seq, *self._later.get(move.seq, ())):
            self._moves.pop(seq, None)  # read after: not a move, a use after move
        by = f" ({move.writer})" if move.writer else ""
        message = (
            f"`{name}` is read after `{move.module or '(root)'}`{by} wrote into its value ({move.op} at "
            f"{move.where}): the value was moved into the module, and this is a use after move"
        )
        finding = Finding("E0382", move.module, move.where, move.op, message, read_at, writer=move.writer)
        self.add(move.seq, finding)

    def findings(self) -> List[Finding]:
        return [f for _, f in sorted(self._found.values(), key=lambda e: e[0])]

    def moves(self) -> List[Finding]:
        """The writes into a temporary that nothing else held and no name read afterwards, the
        same write counted once (code ``"move"``: Rust accepts them, they are never findings)."""
        found: Dict[tuple, Finding] = {}
        for seq in sorted(self._moves):
            f = self._moves[seq]
            seen = found.get(f.key())
            found[f.key()] = f if seen is None else Finding(**{**seen.__dict__, "count": seen.count + 1})
        return list(found.values())


# The references to a written tensor that the write itself holds when ``_check`` counts them: the
# op's argument (its slot in ``args``, a list or ``kwargs``), torch's own while it dispatches the
# op to Python, the list ``written``, ``_check``'s loop variable and getrefcount's argument. Never
# fewer (tests/test_audit_alias.py pins the count: dropout's mask has exactly these); more (the
# same tensor given twice) only means a search that finds nothing.
_WRITES_OWN = 5


def _op_name(func: Any) -> str:
    return str(func)  # as torch names it: aten.add_.Tensor, aten.relu_.default


class WriteWatch(TorchDispatchMode):
    def __init__(self, modules: ModuleWatch, saved: SavedTensors, log: FindingLog) -> None:
        super().__init__()
        self.modules, self.saved, self.log = modules, saved, log
        self.tracer = MoveTracer(self._read)
        self.candidates: List[Candidate] = []
        self.ops = 0
        self.phase = "forward"
        # the outputs of the ops since the last settle, and whether saved-tensors hooks were active
        # then: autograd attaches their nodes once each op has returned through it (and may dispatch
        # ops of its own meanwhile), so they are read at the next write, module boundary or confirm
        self._pending: List[Tuple[Any, bool, Optional[Dict[int, Optional[Span]]]]] = []
        # the tensors exported to NumPy or DLPack in the forward (see exports.py): their bytes are
        # compared before each op while any is live; ``exported`` is that list, tested per op
        self.exports = Exports(self._exported_write, modules.stop)
        self.exported = self.exports.live
        self.unversioned: List[Candidate] = []  # writes outside ATen into saved tensors
        self._installed: List[bool] = []
        modules.boundary = self.boundary
        modules.mutated = self._mutated

    def __enter__(self) -> "WriteWatch":
        # the exports are watched in the forward only (in backward, ops reach the watch only
        # from the Python code that backward runs)
        forward = self.phase == "forward"
        if forward:
            self.exports.install()
        self._installed.append(forward)
        try:
            return super().__enter__()
        except BaseException:
            self._leave_exports()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._leave_exports()

    def _leave_exports(self) -> None:
        if self._installed.pop():
            self.exports.uninstall()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if self.exported:  # a write through NumPy or DLPack since the last op is seen before this one
            self.exports.check()
        found: Writes = WRITES.get(func) or writes_of(func)
        written: List[Tensor] = []
        if found.positions:
            with torch._C.DisableTorchFunction():
                written, metadata_only = writes(func, args, kwargs)
                if written:
                    self.settle()
                    self._check(func, written, metadata_only)
        out = func(*args, **kwargs)
        if self.exported:  # an aten write into exported memory is this watch's own (also through `.data`)
            self.exports.rebase([span(t) for t in written])
        if torch.is_grad_enabled() and _may_save(func, args, kwargs):
            # a parameter's memory as the op used it: its `.data` may be swapped before the
            # next settle (no op shows that), and autograd then saved other data than it computed with
            params = [a for a in args if type(a) is Parameter]
            self._pending.append((out, hooks_active(), {id(a): span(a) for a in params} if params else None))
        return out

    def boundary(self) -> None:
        """A module call begins or ends: what autograd saved so far is settled, and the names
        moved by writes inside a call are traced from now on (their frames wait for it)."""
        if self.exported:
            self.exports.check()
        self.settle()
        self.tracer.arm()

    def forget(self) -> None:
        """Drops the outputs not settled yet (the audit keeps nothing alive once it returns)."""
        self._pending.clear()
        self.exports.lines.stop()
        self.exports.live.clear()
        self.unversioned.clear()

    def settle(self) -> None:
        """Shows the saved tensors the autograd nodes of the ops since the last settle (all of
        them in the running module) and what they reach."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        module = self.modules.current()
        # Reading a saved output unpacks it (an aten.detach): the audit's own op, which neither this
        # watch nor a dispatch mode of the program (a counter, a profiler) beneath it may see.
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            for out, quiet, at_op in pending:
                if isinstance(out, Tensor):
                    self.saved.note(out.grad_fn, quiet, module, at_op)
                elif isinstance(out, (tuple, list)):
                    for t in out:
                        if isinstance(t, Tensor):
                            self.saved.note(t.grad_fn, quiet, module, at_op)

    def _check(self, func: Any, written: List[Tensor], metadata_only: bool) -> None:
        where: Optional[str] = None
        for t in written:
            s = span(t)
            if s is None:
                continue
            s = self._same_memory(t, s)
            owner = self.modules.owner(s, t, metadata_only)
            entries = self.saved.saving(s)  # a metadata-only write (`unsqueeze_`) bumps the version too
            # a module's own parameter or buffer (BatchNorm's running statistics) is no second name
            own = owner is not None or metadata_only or self.phase != "forward" or self.modules.kept(s) is not None
            # Nothing outside this write holds ``t`` when it has no reference but the write's own
            # (_WRITES_OWN): a temporary that an aten composite made and wrote (dropout's mask). A
            # name in any frame would be one more reference, so no frame is searched for one.
            aliases = [] if own or sys.getrefcount(t) <= _WRITES_OWN else self._aliases(t)
            if owner is None and not entries and not aliases:
                continue
            where = where or write_site(sys._getframe(), self.modules)  # never the audit's caller
            seq, op = self.log.next(), _op_name(func)
            if owner is not None:
                self._moved(seq, op, where, s, *owner)
            if aliases:
                alias = WatchedWrite(
                    "alias", seq, self.modules.running(sys._getframe()), where, op, self.modules.writer()
                )
                for frame, name, through in aliases:
                    self.tracer.watch(frame, name, Reborrow(alias, through) if through else alias)
            if entries:
                module = self.modules.running(sys._getframe())
                self.candidates.append(Candidate(seq, module, where, op, self.phase, entries, self.modules.writer()))

    def _same_memory(self, t: Tensor, s: Span) -> Span:
        """An argument's bytes written through a storage of their own (``torch.from_numpy`` of the
        array it was made from): the argument's memory. Not where an export watches those bytes
        (an exported array's tensor): the export reports the write, as one through its view."""
        moved = self.modules.same_memory(t, s)
        if moved is s or any(e.span.overlaps(moved) for e in self.exported):
            return s
        return moved

    def _aliases(self, t: Tensor) -> List[Tuple[FrameType, str, Tuple[str, ...]]]:
        """The other names for the tensor object ``t`` (directly or in a tuple, list or dict) in
        the user frame that writes it and the user frames that called it, each with the names
        written through that were taken from it (empty: the name was taken before the write,
        and any later read interleaves). The names a frame writes or lends through are not
        among them: the writing line's, and in a frame that called the writer, the call's (the
        names lent to a helper: once its frame returns, its parameter's borrow has ended).
        Views are not the tensor object (a view is a reborrow)."""
        site = user_frame(sys._getframe(), self.modules.stop)
        found: List[Tuple[FrameType, str, Tuple[str, ...]]] = []
        frame: Optional[FrameType] = site
        while frame is not None and frame is not self.modules.stop:
            if is_user(frame):
                lent = call_names(frame) | (line_names(frame) if frame is site else set())
                held = list(holders(frame, lambda v: v is t))
                through = tuple(n for n in held if n in lent)
                for n in held:
                    if n not in lent:
                        taken = tuple(w for w in through if n in taken_from(frame.f_code, w))
                        found.append((frame, n, taken))
            frame = frame.f_back
        return found

    def _read(self, frame: FrameType, name: str, info: Any) -> None:
        """A watched name is read: a source of the names written through starts watching them
        (a use of one of them now interleaves); anything else is the log's."""
        if isinstance(info, Reborrow):
            later = Interleaved(info.alias, name, location(frame))
            holder: Optional[FrameType] = frame  # read in a comprehension: the names are its caller's
            while holder is not None and not any(w in holder.f_locals for w in info.through):
                holder = holder.f_back
            for w in info.through if holder is not None else ():
                self.tracer.watch(holder, w, later)
            return
        self.log.on_read(frame, name, info)

    def _moved(self, seq: int, op: str, where: str, s: Span, call: Call, arg: Arg) -> None:
        writer = self.modules.writer()
        who = f"`{call.module or '(root)'}` ({writer or call.cls})"

        def overlaps(value: Any) -> bool:
            if not isinstance(value, Tensor):
                return False
            other = span(value)
            return other is not None and other.overlaps(s)

        holder = self.modules.kept(s)
        if holder is None:
            function = function_holding(sys._getframe(), self.modules.stop, overlaps)
            holder = f"an input of `{function}`, which keeps it for backward" if function else None
        if holder is not None:
            message = (
                f"{who} wrote into its argument `{arg.label}`, which is also {holder} and outlives the call: "
                "the module only borrowed it (`&`); in Rust the write needs `&mut` or ownership (forward_owned)"
            )
            self.log.add(seq, Finding("E0596", call.module, where, op, message, writer=writer))
        else:
            message = f"{who} wrote into its argument `{arg.label}`, a temporary nothing else held: a move"
            self.log.move(seq, Finding("move", call.module, where, op, message, writer=writer))
        move = WatchedWrite("move", seq, call.module, where, op, writer)
        for frame in self.modules.frames_above(call):
            for name in holders(frame, overlaps):
                # the frames above the call run only once it has returned: traced from its end
                self.log.same_value(self.tracer.watch(frame, name, move, now=False).seq, seq)

    def _mutated(self, call: Call, label: str, kind: str, holder: str) -> None:
        """``call`` mutated a list or dict of tensors it was given that ``holder`` keeps: ``E0596``
        (a ``&Vec<Tensor>`` or ``&HashMap<_, Tensor>`` cannot be mutated), at the line of its
        ``forward`` (or function) that does it."""
        fn = call.obj.forward if isinstance(call.obj, torch.nn.Module) else call.obj
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is None:
            where, how = "?", "mutated"
        else:
            line, how = mutation_site(code, label.split("[", 1)[0])
            where = f"{short_path(code.co_filename)}:{line}"
        rust = "&HashMap<_, Tensor>" if kind == "dict" else "&Vec<Tensor>"
        message = (
            f"`{call.module or '(root)'}` ({call.cls}) mutated the {kind} `{label}` it was given, which is also "
            f"{holder} and outlives the call: the {kind} was only borrowed (`{rust}`), which Rust does not let "
            "it mutate"
        )
        self.log.add(self.log.next(), Finding("E0596", call.module, where, f"{kind}.{how}", message))

    def _exported_write(self, e: Export, where: str) -> None:
        """The bytes of a tensor exported to NumPy or DLPack changed outside ATen, at ``where``
        (the exporting frame's line): judged as an aten write there would be (``E0596`` or a move
        for a running call's argument, and the names that held it watched for ``E0382``), except
        that a saved tensor so written is ``E0502`` whether or not a version moved (none did:
        backward will not refuse it, and silently computes with the new values)."""
        if self.phase != "forward":
            return
        self.settle()
        seq, op = self.log.next(), f"{e.how}() {'capsule' if 'dlpack' in e.how else 'view'}"
        owner = self.modules.owner(e.span, e.tensor, False)
        if owner is not None:
            self._moved(seq, op, where, e.span, *owner)
        entries = self.saved.saving(e.span)
        if entries:
            module = self.modules.running(sys._getframe())
            self.unversioned.append(Candidate(seq, module, where, op, self.phase, entries, self.modules.writer()))

    def _unversioned(self, live: Optional[Set[Any]]) -> None:
        """``E0502`` for each write outside ATen into a saved tensor whose node a backward from
        the outputs would run (``live``; ``None``: any node)."""
        for c in self.unversioned:
            hit = [e for e in c.entries if live is None or e.node in live]
            if hit:
                e = hit[0]
                saver = f" in `{e.module}`" if e.module else ""
                others = f" (and {len(hit) - 1} more)" if len(hit) > 1 else ""
                message = (
                    f"wrote through a {c.op} outside ATen into the tensor that {type(e.node).__name__}{saver} "
                    f"saved for backward ({e.attr.lstrip('_')}){others}: autograd borrowed it until backward, and "
                    "no version counter moved: backward will not refuse it, and computes with the new values"
                )
                self.log.add(c.seq, Finding("E0502", c.module, c.where, c.op, message, writer=c.writer))
        self.unversioned.clear()

    def _swapped(self, entries: List[Saved]) -> None:
        """``E0502`` for each parameter whose ``.data`` was swapped (``.data =``, ``set_``) after
        autograd saved it: backward will compute with other data than the forward did, and no
        version counter notices. At the forward's line that swaps it, if found."""
        for e in entries:
            s = span(e.tensor)
            name = self.modules.kept(s) if s is not None else None
            where = self.modules.swap_site(e.module)
            message = (
                f"the `.data` of {name or 'a parameter'} was swapped after {type(e.node).__name__}"
                f"{f' in `{e.module}`' if e.module else ''} saved it for backward ({e.attr.lstrip('_')}): "
                "autograd borrowed it until backward, which will compute with other data than the forward used "
                "(`.data =` bumps no version: PyTorch never notices)"
            )
            self.log.add(self.log.next(), Finding("E0502", e.module, where, ".data =", message))

    def confirm(self, roots: Optional[List[Any]]) -> None:
        """Turns the candidates into ``E0502`` findings where the write bumped the version of a
        saved tensor whose node a backward from ``roots`` would run (``None``: any node); a
        callable audited (not a module) is checked for the lists and dicts it mutated."""
        for call in [c for c in self.modules.stack if c.containers and c.caller is None]:
            self.modules.check_containers(call)
        self.exports.finish()
        self.boundary()
        swapped = self.saved.swapped()
        if not self.candidates and not swapped and not self.unversioned:
            return
        live = None if roots is None else reachable(roots)
        self._swapped([e for e in swapped if live is None or e.node in live])
        self._unversioned(live)
        for c in self.candidates:
            hit = [e for e in overwritten(c.entries) if live is None or e.node in live]
            if hit:
                e = hit[0]
                saver = f" in `{e.module}`" if e.module else ""
                others = f" (and {len(hit) - 1} more)" if len(hit) > 1 else ""
                during = " (during backward, recomputing)" if c.phase == "backward" else ""
                message = (
                    f"overwrote{during} the tensor that {type(e.node).__name__}{saver} saved for backward "
                    f"({e.attr.lstrip('_')}){others}: autograd borrowed it until backward, which will refuse it"
                )
                self.log.add(c.seq, Finding("E0502", c.module, c.where, c.op, message, writer=c.writer))
        self.candidates.clear()


_BELOW_AUTOGRAD = torch._C.DispatchKey.ADInplaceOrView


_FACTORY: Dict[Any, bool] = {}  # op -> whether its schema takes `pin_memory` (a factory: ones, zeros_like)


def _requires_grad(a: Any) -> bool:
    if isinstance(a, Tensor):
        return a.requires_grad
    return isinstance(a, (list, tuple)) and any(isinstance(t, Tensor) and t.requires_grad for t in a)


def _may_save(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op's output may get an autograd node that saved something: not when no tensor
    it was given requires grad, nor for a factory (autograd gives its output no history). The
    watch keeps no reference to such an output: autograd's ``make_variable`` would see a second
    one and hand the program a detached copy instead (an ``aten.detach`` the program never ran)."""
    factory = _FACTORY.get(func)
    if factory is None:
        factory = _FACTORY[func] = any(a.name == "pin_memory" for a in func._schema.arguments)
    if factory:
        return False
    return any(_requires_grad(a) for a in args) or any(_requires_grad(a) for a in kwargs.values())


class PythonCalls(TorchFunctionMode):
    """Backward's watch: each torch call that Python code makes during backward (a checkpoint's
    recomputation, a custom Function's backward, a hook) runs under the write watch; not those
    of a kernel written in Python (a meta kernel, a decomposition), which run below autograd."""

    def __init__(self, watch: WriteWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if torch._C._dispatch_tls_is_dispatch_key_excluded(_BELOW_AUTOGRAD):
            return func(*args, **(kwargs or {}))
        with self.watch:
            return func(*args, **(kwargs or {}))
