"""support/programs.py's python(): a program forked from the preloaded Python (support/preloaded.py)
sees what a fresh ``python -X faulthandler`` gives it, from its arguments to its exit status, but
the modules already imported (torch and plusequals; which is why a test that needs a bare
interpreter asks for ``fresh=True``)."""

from __future__ import annotations

import json
import subprocess

import pytest

from support.programs import python

# What a program can see of how it was started, as JSON on stdout.
FACTS = """\
import json, os, sys, threading
main = sys.modules["__main__"]
facts = {
    "argv": sys.argv, "path0": sys.path[0], "path": sys.path[1:], "cwd": os.getcwd(), "name": __name__,
    "file": globals().get("__file__"), "env": dict(os.environ), "main": main.__dict__ is globals(),
    "stdin": sys.stdin.read(), "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    "threads": threading.active_count(), "flags": sys.flags.dev_mode,
}
print(json.dumps(facts, sort_keys=True))
"""
EXITS = {
    "exit 3": "import sys; sys.exit(3)",
    "exit message": "import sys; sys.exit('bye')",
    "uncaught": "def f():\n    raise ValueError('boom')\nf()",
    "atexit and a thread": (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()"
    ),
    "excepthook": "import sys\nsys.excepthook = lambda *a: print('hook', a[1])\nraise KeyError(1)",
    "abort": "import os; os.abort()",
}


def both(tmp_path, *args):
    """The program's run forked and fresh (each in its own copy of ``tmp_path``)."""
    runs = []
    for fresh in (False, True):
        cwd = tmp_path / ("fresh" if fresh else "forked")
        cwd.mkdir(exist_ok=True)
        runs.append(python(cwd, *args, fresh=fresh))
    return runs


@pytest.mark.parametrize(
    "args", [["facts.py", "a", "b"], ["-m", "facts", "a"], ["-c", FACTS, "a"]], ids=["script", "-m", "-c"]
)
def test_a_forked_program_sees_how_it_was_started_as_a_fresh_one_does(tmp_path, args):
    """Its argv, sys.path (an empty entry in PYTHONPATH is its own cwd), cwd, ``__name__``,
    ``__file__``, ``__main__``, environment, stdin, open fds and threads."""
    for where in ("forked", "fresh"):
        (tmp_path / where).mkdir()
        (tmp_path / where / "facts.py").write_text(FACTS)
    forked, fresh = both(tmp_path, *args)
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    forked, fresh = json.loads(forked.stdout), json.loads(fresh.stdout)
    for facts, where in ((forked, "forked"), (fresh, "fresh")):
        facts["env"].pop("PYTEST_CURRENT_TEST")  # the test's name and phase, set by pytest as it goes
        text = json.dumps(facts).replace(str(tmp_path / where), "<cwd>")
        facts.clear()
        facts.update(json.loads(text))
    assert forked == fresh


@pytest.mark.parametrize("name", list(EXITS))
def test_a_forked_program_ends_as_a_fresh_one_does(tmp_path, name):
    forked, fresh = both(tmp_path, "-c", EXITS[name])
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    if name != "abort":  # faulthandler's dump lists the extension modules loaded, torch's among them
        assert forked.stderr == fresh.stderr
    else:
        assert forked.returncode == -6 and "Fatal Python error: Aborted" in forked.stderr


def test_a_timeout_kills_the_forked_program_and_the_next_one_runs(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        python(tmp_path, "-c", "import time; time.sleep(60)", timeout=1)
    assert python(tmp_path, "-c", "print('next')").stdout == "next\n"


def test_a_changed_environment_is_the_one_the_program_starts_with(tmp_path, monkeypatch):
    """Python, libgomp and torch read the environment when they start: a program asked for with
    another one than the server's is forked from a server started with it (PYTHONHASHSEED, read
    by Python alone at start-up, gives the same hash as a fresh interpreter's)."""
    code = "import os; print(os.environ['PYTHONHASHSEED'], hash('plusequals'))"
    said = []
    for seed in ("1", "2", "1"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        forked, fresh = both(tmp_path, "-c", code)
        assert forked.stdout == fresh.stdout
        said.append(forked.stdout)
    assert said[0] == said[2] != said[1]  # the seed changes the hash: the check can fail
