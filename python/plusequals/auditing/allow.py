"""``# plusequals: allow(E0596, E0502)``: rustc's ``#[allow]``, on the line that writes.

A finding whose ``where`` line carries an allow naming its code is silenced (kept in
``AuditReport.allowed``). An allow, in a file the audit ran code of, that silenced nothing is
reported back (``AuditReport.unused_allows``, a warning), so stale allows do not pile up.
"""

from __future__ import annotations

import functools
import inspect
import io
import linecache
import os
import re
import tokenize
from typing import Any, Dict, FrozenSet, Iterable, List, Set, Tuple

import torch

from .sites import entry, is_library, relative, resolve

__all__ = ["Allows", "allows_in", "source_files"]

_ALLOW = re.compile(r"#\s*plusequals:\s*allow\(([^)]*)\)")
_TORCH = os.path.dirname(torch.__file__) + os.sep


def allows_in(file: str) -> Dict[int, FrozenSet[str]]:
    """``line -> codes`` of the allow comments in ``file`` (comments only: read with tokenize)."""
    linecache.checkcache(file)  # the file as it is now, not as an earlier run cached it
    return dict(_allows("".join(linecache.getlines(file))))


@functools.lru_cache(maxsize=64)
def _allows(text: str) -> Dict[int, FrozenSet[str]]:
    """:func:`allows_in` of a file's ``text``, tokenized once per text: every ``audit()`` call reads
    the files of its model's code again, and a long one took 15 ms to tokenize at each."""
    found: Dict[int, FrozenSet[str]] = {}
    if "plusequals" not in text:
        return found
    try:
        comments = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return found
    for token in comments:
        match = _ALLOW.search(token.string)
        if match:
            codes = frozenset(c.strip() for c in match.group(1).split(",") if c.strip())
            found[token.start[0]] = found.get(token.start[0], frozenset()) | codes
    return found


def source_files(model: Any) -> Set[str]:
    """The files of the model's code (its modules' classes, or the callable), torch's left out."""
    classes = dict.fromkeys(type(m) for m in model.modules()) if isinstance(model, torch.nn.Module) else {}
    # a ScriptModule's class has no Python forward: the class itself, and its file
    objects = [getattr(getattr(cls, "forward", None), "__code__", cls) for cls in classes] or [model]
    files: Set[str] = set()
    for obj in objects:
        try:
            file = obj.co_filename if inspect.iscode(obj) else inspect.getsourcefile(obj)
        except (TypeError, OSError):
            file = None
        if file and not os.path.abspath(file).startswith(_TORCH):
            files.add(os.path.abspath(file))
    return files


class Allows:
    """The allows of the files watched, and which of their codes silenced a finding."""

    def __init__(self) -> None:
        self.files: Set[str] = set()
        self.used: Set[Tuple[str, int, str]] = set()

    def watch(self, files: Iterable[str]) -> None:
        self.files.update(files)

    def silences(self, finding: Any) -> bool:
        """Whether an allow on the writing line, or (for a write in a library) on the user's
        line that called into the library, names the finding's code."""
        for where in (finding.where, entry(finding.where)):
            site = resolve(where)
            if site is None or not os.path.isabs(site.file) or site.file.startswith(_TORCH):
                continue
            if not is_library(site.file):
                self.files.add(site.file)  # an allow elsewhere in a file that wrote can be unused
            if finding.code in allows_in(site.file).get(site.line, ()):
                self.used.add((site.file, site.line, finding.code))
                return True
        return False

    def apply(self, report: Any) -> None:
        """Moves the silenced findings of ``report`` from ``findings`` to ``allowed``."""
        kept = []
        for f in report.findings:
            (report.allowed if self.silences(f) else kept).append(f)
        report.findings = kept

    def unused(self) -> List[Tuple[str, str]]:
        """``(path:line, code)`` of each allowed code that silenced nothing."""
        out = []
        for file in sorted(self.files):
            for line, codes in sorted(allows_in(file).items()):
                out += [(f"{relative(file)}:{line}", c) for c in sorted(codes) if (file, line, c) not in self.used]
        return out
