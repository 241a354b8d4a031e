"""Where a write happened: the frame a finding's ``where`` names (never the line that called the
audit), the column Python gives for it, and the file a ``where`` string came from.

``where`` is ``path:line`` with the path shortened against ``sys.path`` (:func:`.frames.short_path`);
:func:`resolve` turns it back into a :class:`Site` with the real file (for ``linecache``), the
path relative to the working directory (for SARIF) and the column, where one is known.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

from . import frames

__all__ = ["Site", "entry", "export", "is_library", "resolve", "restore", "write_site"]

# where -> (column, end column), 1-based, end exclusive: from the frame's co_positions at the write
_COLUMNS: Dict[str, Tuple[int, int]] = {}
# where (a line in a library) -> the innermost frame outside libraries that called into it
_ENTRIES: Dict[str, str] = {}
_LIBRARIES = tuple(
    {os.path.abspath(p) + os.sep for p in (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])}
)


def is_library(file: str) -> bool:
    """Whether ``file`` is an installed library's (``site-packages``, ``dist-packages``, the
    standard library): not the user's own code, wherever the environment lives."""
    parts = file.replace("\\", "/").split("/")
    return "site-packages" in parts or "dist-packages" in parts or os.path.abspath(file).startswith(_LIBRARIES)


def entry(where: Optional[str]) -> Optional[str]:
    """For a write in a library, ``path:line`` of the user's own frame that called into it."""
    return _ENTRIES.get(where) if where else None


def _note_entry(where: str, frame: FrameType) -> None:
    if where in _ENTRIES or not is_library(frame.f_code.co_filename):
        return
    caller: Optional[FrameType] = frame.f_back
    while caller is not None and (is_library(caller.f_code.co_filename) or not frames.is_user(caller)):
        caller = caller.f_back
    if caller is not None:
        _ENTRIES[where] = frames.location(caller)
        span = _positions(caller)
        if span is not None:
            _COLUMNS.setdefault(_ENTRIES[where], span)


_CODE_POSITIONS: Dict[CodeType, List[Tuple[Any, ...]]] = {}


def _positions(frame: FrameType) -> Optional[Tuple[int, int]]:
    """The columns of the instruction ``frame`` is at (3.11+), when it starts and ends on its line."""
    code = frame.f_code
    try:
        found = _CODE_POSITIONS.get(code)
        if found is None:
            found = _CODE_POSITIONS[code] = list(code.co_positions())
        positions = found[frame.f_lasti // 2]
    except (AttributeError, IndexError):
        return None
    line, end_line, col, end_col = positions
    if col is None or line != frame.f_lineno:
        return None
    return col + 1, (end_col + 1 if end_col is not None and end_line == line else col + 2)


def _module_frame(frame: Optional[FrameType], stop: Optional[FrameType], ident: Optional[int]) -> Optional[FrameType]:
    """The innermost frame of the running module's ``forward`` (or any ``forward``) below ``stop``,
    else the innermost frame outside the audit's machinery."""
    first: Optional[FrameType] = None
    while frame is not None and frame is not stop:
        code = frame.f_code
        if code.co_filename not in frames._AUDIT:
            first = first or frame
            me = frame.f_locals.get("self") if code.co_varnames[:1] == ("self",) else None
            if code.co_name == "forward" and (ident is None or id(me) == ident):
                return frame
        frame = frame.f_back
    return first


def write_site(frame: FrameType, modules: Any) -> str:
    """``path:line`` of a write seen at ``frame`` (the dispatch mode's): the innermost user frame
    below the audit's own frame; when there is none (a ``Sequential``'s ``nn.ReLU(inplace=True)``,
    torch's code called by torch's code), the frame of the module that wrote, in torch."""
    stop = getattr(modules, "_stop", None)
    found = frames.user_frame(frame, stop)
    if found is None:
        stack = getattr(modules, "stack", [])
        found = _module_frame(frame, stop, stack[-1].ident if stack else None)
        if stop is not None and (found is None or found.f_code.co_name != "forward"):
            # no Python forward runs (a ScriptModule's TorchScript): the user's line that called
            # it, the boundary where its arguments were checked
            found = frames.user_frame(stop.f_back) or found
    where = frames.location(found)
    span = _positions(found) if found is not None else None
    if span is not None:
        _COLUMNS[where] = span
    if found is not None:
        _note_entry(where, found)
    return where


class Site(NamedTuple):
    file: str  # the file as Python ran it (for linecache)
    path: str  # relative to the working directory when under it, else as ``where`` gave it (short)
    line: int
    column: Optional[int] = None  # 1-based
    end_column: Optional[int] = None  # exclusive


def _file_of(short: str) -> str:
    if os.path.isabs(short):
        return short
    for filename, shortened in reversed(list(frames._SHORT.items())):  # the newest, if two files share it
        if shortened == short:
            return filename
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.curdir), short)
        if os.path.exists(candidate):
            return candidate
    return short


def relative(file: str) -> str:
    """``file`` relative to the working directory when it is under it (SARIF's uri), else as it is."""
    cwd = os.getcwd() + os.sep
    return file[len(cwd) :] if file.startswith(cwd) else file


def resolve(where: Optional[str]) -> Optional[Site]:
    """The :class:`Site` of a ``path:line`` string; None for ``?`` or anything else."""
    if not where or ":" not in where:
        return None
    short, _, line = where.rpartition(":")
    if not line.isdigit():
        return None
    file = _file_of(short)
    column, end = _COLUMNS.get(where, (None, None))
    shown = relative(file) if os.path.isabs(file) else short
    return Site(file, short if os.path.isabs(shown) else shown, int(line), column, end)


def export(wheres: Iterable[Optional[str]]) -> Dict[str, Dict[str, Any]]:
    """What this process knows of each ``where`` (its real file, its caret's columns, the user's
    line that called into a library), for a parent process to :func:`restore`: a worker's
    finding then renders as the same finding made in the parent."""
    out: Dict[str, Dict[str, Any]] = {}
    todo = [w for w in wheres if w]
    while todo:
        where = todo.pop()
        if where in out or ":" not in where:
            continue
        short = where.rpartition(":")[0]
        known: Dict[str, Any] = {"file": _file_of(short)}
        if where in _COLUMNS:
            known["columns"] = list(_COLUMNS[where])
        if where in _ENTRIES:
            known["entry"] = _ENTRIES[where]
            todo.append(_ENTRIES[where])
        out[where] = known
    return out


def restore(known: Dict[str, Dict[str, Any]]) -> None:
    """Takes in what :func:`export` gave in another process (what this one knows already stays)."""
    for where, k in known.items():
        file, short = k.get("file"), where.rpartition(":")[0]
        if isinstance(file, str) and os.path.isabs(file):
            frames._SHORT.setdefault(file, short)
        columns = k.get("columns")
        if isinstance(columns, list) and len(columns) == 2 and all(isinstance(c, int) for c in columns):
            _COLUMNS.setdefault(where, (columns[0], columns[1]))
        if isinstance(k.get("entry"), str):
            _ENTRIES.setdefault(where, k["entry"])
