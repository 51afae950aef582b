"""The hosts of the multi-host simulation: a fork server whose children are ``tailor`` commands.

Each operation of a schedule is one real command, as a host would run it: its own process (its own
pid, its own locks and leases, its own cache directory), started by ``fork`` from a process that has
already imported tailorstore, so that a command costs milliseconds instead of an interpreter's
start. The simulation (testbed/simulation.py) talks to this process over its stdin and stdout, one
JSON object a line:

- ``{"spawn": ID, "args": [...], "env": {...}, "out": PATH, "fault": {...} | null}`` starts a command;
- ``{"cont": ID}`` resumes one that stopped at its fault; ``{"kill": ID}`` ends one;
- it answers ``{"id": ID, "pid": PID}``, then ``{"id": ID, "stopped": true}`` when the command stopped
  itself at its fault, and ``{"id": ID, "rc": CODE}`` when it ended (``-9`` when it was killed).

A fault stops (SIGSTOP) or kills (SIGKILL) the command at its ``nth`` request of a ``kind`` (``*``:
any). On S3 the stop lands at the object-store client's call, after every check the library makes
before that request (fences included): it is the freeze of a VM right before a request leaves. On a
POSIX store it is the library's request failpoint (core/failpoints.py), or a named failpoint where
the fault names one. The command learns nothing of this beyond what the code under test exposes, so
the same server drives older trees of the code (``PYTHONPATH``) for the regression seeds.

This process itself is single-threaded, so forking it is safe; it never opens a store.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import sys
from typing import Any

# imported before any fork, so that every command starts warm; an older tree may lack some
WARM_MODULES = (
    "tailorstore.cli.app",
    "tailorstore.ingest.commit",
    "tailorstore.ingest.finalize",
    "tailorstore.curate.gc",
    "tailorstore.curate.thinning",
    "tailorstore.restore.checkout",
    "tailorstore.report.verify",
    "tailorstore.store.backends.s3",
    "tailorstore.store.s3",  # the name an older tree (before store/ had sub-packages) gives it
    "obstore",
)


def _kind_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if name == "put":
        return "put-create" if kwargs.get("mode") == "create" else "put"
    if name in ("get", "get_range"):
        return "get"
    if name == "delete":
        return "delete-many" if len(args) > 1 and isinstance(args[1], list) else "delete"
    return name


def _stop_at_requests(fault: dict[str, Any]) -> None:
    """Wrap the object-store client's calls: the fault acts at its ``nth`` request of ``kind``."""
    import obstore

    kind, nth, action = fault["kind"], int(fault["nth"]), fault["action"]
    seen = [0]

    def wrap(name: str) -> None:
        original = getattr(obstore, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if kind in ("*", _kind_of(name, args, kwargs)):
                seen[0] += 1
                if seen[0] == nth:
                    os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(obstore, name, call)

    for name in ("put", "get", "get_range", "head", "list", "delete"):
        if hasattr(obstore, name):
            wrap(name)


def _child(order: dict[str, Any]) -> None:
    """Run one command in this forked child and leave with its exit code."""
    code = 1
    try:
        out = os.open(order["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(order["out"] + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.update(order["env"])
        fault = order.get("fault")
        if fault and fault.get("where") == "client":
            _stop_at_requests(fault)
        if order["args"][0] == "@dcp-save":  # the DCP writer's save (testbed/sim_dcp.py), not a command
            code = _beside("sim_dcp").main(order["args"][1:])
        else:
            from tailorstore.cli.app import run

            sys.argv = ["tailor", *order["args"]]
            run()
            code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # a bug: its traceback is on stderr, as the command line would show it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _beside(name: str) -> Any:
    """A module of testbed/ next to this script, which runs as a file (not as ``testbed.sim_host``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _say(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _older_cli() -> None:
    """With ``TAILOR_SIM_CLI`` (an older tree's ``cli/``): make it ``tailorstore.cli``, which the
    editable install otherwise maps to this tree's folder whatever ``PYTHONPATH`` says."""
    folder = os.environ.get("TAILOR_SIM_CLI")
    if not folder:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tailorstore.cli", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tailorstore.cli"] = module
    spec.loader.exec_module(module)


def serve() -> None:
    _older_cli()
    for name in WARM_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    children: dict[int, int] = {}  # pid -> id
    pids: dict[int, int] = {}  # id -> pid
    pending = b""
    _say({"ready": True})
    while True:
        ready, _, _ = select.select([0], [], [], 0.003)
        if ready:
            data = os.read(0, 65536)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                order = json.loads(line)
                if "spawn" in order:
                    pid = os.fork()
                    if pid == 0:
                        _child(order)
                    children[pid], pids[order["spawn"]] = order["spawn"], pid
                    _say({"id": order["spawn"], "pid": pid})
                elif "cont" in order and order["cont"] in pids:
                    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: its rc is on its way
                        os.kill(pids[order["cont"]], signal.SIGCONT)
                elif "kill" in order and order["kill"] in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pids[order["kill"]], signal.SIGKILL)
                        os.kill(pids[order["kill"]], signal.SIGCONT)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if os.WIFSTOPPED(status):
                _say({"id": children[pid], "stopped": True})
                continue
            rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
            ended = children.pop(pid)
            pids.pop(ended, None)  # a kill sent again after its end must not reach a process that reused the pid
            _say({"id": ended, "rc": rc})
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)


if __name__ == "__main__":
    serve()
