"""A Python that has imported torch and plusequals, and forks a fresh-looking interpreter for each
program a test runs (support.programs.python): each Python start in the suite spent about 2 s of
CPU importing torch before the program did anything, and the suite starts dozens.

Run as a script, this file is the server: it imports torch and plusequals, says ``ready`` on its
control pipe, then reads one request per line (JSON: argv, cwd, env, the files for stdout and
stderr), forks, answers the child's pid, waits for it and answers its exit code as subprocess
gives it (negative: killed by that signal). The child becomes the program as ``python -X
faulthandler ARGV`` would start it: stdin from /dev/null, stdout and stderr into the request's
files, the request's cwd and environment, ``sys.argv`` and ``sys.path[0]`` as CPython sets them
for a script, ``-m`` or ``-c``, the program run in a new ``__main__`` module, and Python's own
exit (its threads joined, atexit run, an uncaught exception printed by ``sys.excepthook``, exit
status 1). This file's frames are left out of the traceback.

Python, libgomp and torch's import read the environment at start-up, so a program asked for with
another one than the server's forks from a new server started with it (programs.python decides).
What a fork cannot give is left to a fresh interpreter: interpreter options other than ``-X
faulthandler``, and a program that must not find torch or plusequals imported already.
"""

from __future__ import annotations

import builtins
import gc
import json
import os
import sys
import types


def _serve() -> tuple[dict, list[str]]:
    """The server's loop; returns (the request, the end of sys.path) in each child, and exits in
    the server when the client closes the pipe."""
    import torch  # noqa: F401  (the preload)

    import plusequals  # noqa: F401

    # sys.path after this file's folder and PYTHONPATH's entries (the child makes those again in
    # its own cwd: an empty entry is the cwd)
    base = sys.path[1 + len(_pythonpath()) :]
    # What the server holds stays out of the children's collections: their garbage collection
    # (at exit, too) would otherwise touch, and copy, every page of it.
    gc.freeze()
    # The control pipe on fds of its own; 0 and 1 (which each child redirects) to /dev/null.
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    os.write(ctl_out, b"ready\n")
    with os.fdopen(ctl_in, "rb", buffering=0) as requests:
        while line := requests.readline():
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(ctl_out)
                return request, base
            os.write(ctl_out, f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            os.write(ctl_out, f"{os.waitstatus_to_exitcode(status)}\n".encode())
    sys.exit(0)


def _pythonpath() -> list[str]:
    """PYTHONPATH's entries, absolute in the cwd, as Python puts them on sys.path."""
    value = os.environ.get("PYTHONPATH")
    return [os.path.abspath(entry) for entry in value.split(os.pathsep)] if value else []


def _become(request: dict, base: list[str]) -> None:
    """This child becomes ``python -X faulthandler *request["argv"]``, and runs it."""
    stdio = {0: (os.devnull, os.O_RDONLY), 1: (request["stdout"], os.O_WRONLY), 2: (request["stderr"], os.O_WRONLY)}
    for fd, (path, flags) in stdio.items():
        new = os.open(path, flags)
        os.dup2(new, fd)
        os.close(new)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    argv = request["argv"]
    if argv[0] == "-c":
        sys.argv, first = ["-c", *argv[2:]], ""
        code = compile(argv[1], "<string>", "exec")
        program = lambda: exec(code, main.__dict__)  # noqa: E731
    elif argv[0] == "-m":
        import runpy

        sys.argv, first = [argv[1], *argv[2:]], os.getcwd()
        program = lambda: runpy._run_module_as_main(argv[1], alter_argv=True)  # noqa: E731
    else:
        script = os.path.abspath(argv[0])
        sys.argv, first = list(argv), os.path.dirname(script)
        main.__file__, main.__cached__ = script, None
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec")
        program = lambda: exec(code, main.__dict__)  # noqa: E731
    sys.path[:] = [first, *_pythonpath(), *base]
    _run(program)


def _run(program) -> None:
    """Runs the program; an exception it leaves is printed as Python prints it (without this
    file's frames), and the exit status is 1."""
    try:
        program()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - as the interpreter's top level
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


if __name__ == "__main__":
    _become(*_serve())
