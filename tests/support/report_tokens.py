"""The numbers a results.json can justify, as the report formats them (shared by
test_report.py and test_readme.py)."""

from plusequals.bench.results import NUMBER, fmt


def tokens(obj, out: set, us: bool = False) -> set:
    """Every numeric leaf as REPORT.md formats it (and, with ``us``, each float x 1e3: a time in
    ms quoted in µs), and the digits inside its strings (versions, shape labels, notes)."""
    if isinstance(obj, dict):
        for v in obj.values():
            tokens(v, out, us)
    elif isinstance(obj, list):
        for v in obj:
            tokens(v, out, us)
    elif isinstance(obj, bool) or obj is None:
        pass
    elif isinstance(obj, (int, float)):
        out.update(NUMBER.findall(fmt(obj)))
        if us and isinstance(obj, float):
            out.update(NUMBER.findall(fmt(obj * 1e3)))
    elif isinstance(obj, str):
        out.update(NUMBER.findall(obj))
    return out
