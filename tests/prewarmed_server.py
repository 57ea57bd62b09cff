"""A Python that has imported torch, transformers, datasets and hf_zero once, and forks a fresh process per command
(tests/testing_utils.py, `run_cmd` and `run_as_user`): an `hf-zero check` started as its own interpreter spends
7 of its 10 s here importing, and the suite starts a hundred of them.

Each command runs in a child forked from this process before it ran anything, so it starts from the same state as
a new interpreter that had just imported these modules: its own pid, working folder, environment, stdin from
/dev/null, stdout and stderr into the files the test reads, exit code or signal as `subprocess.run` reports them.
Only what an import does is shared, so the test side starts one server per environment (an import may read a
variable) and uses none that printed anything while importing (that output would be missing from the commands').

Started as `prewarmed_server.py FD KIND`, for one kind of command ("entry": `hf-zero`, "script": a recipe).
Protocol, one JSON line each way (requests on stdin, answers on the pipe whose fd is FD): {"argv", "cwd",
"env", "out", "err", "kind": "entry"|"script"} -> {"pid"} once forked, then {"rc"} when the child has ended."""

import importlib
import json
import os
import sys

# peft too: hf_zero imports it only where a LoRA model is built (integrations/lean_import.py), which most of the
# suite's commands do, each paying its ~1.5 s again in a fork of a server without it. A full fine-tune's own imports
# are held to "no peft" by tests/launch/test_lean_launch.py, in interpreters of their own.
PREWARM = ("hf_zero.cli", "hf_zero.core.config", "hf_zero.preflight.checks", "hf_zero.plan.one_stage", "datasets",
           "hf_zero.commands.check", "hf_zero.commands.estimate", "hf_zero.commands.export",
           "hf_zero.commands.preview", "hf_zero.commands.init", "hf_zero.commands.convert", "peft")


def _child(req) -> None:
    """Becomes the command; never returns."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # a timeout kills the command and whatever it started
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        target, args = req["argv"][0], req["argv"][1:]
        # argv[0] as `python -m hf_zero.cli` or `python SCRIPT` would set it
        sys.argv = [sys.modules[target].__file__ if req["kind"] == "entry" else target, *args]
        try:
            if req["kind"] == "entry":  # the `hf-zero` command: its entry point, as the console script calls it
                sys.exit(importlib.import_module(target).main())
            else:  # python SCRIPT: the script's folder first on sys.path
                sys.path[0] = os.path.dirname(os.path.abspath(target))
                runpy.run_path(target, run_name="__main__")
            code = 0
        except SystemExit as exc:  # as the interpreter maps it: None -> 0, an int as it is, anything else printed, 1
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - an uncaught error ends an interpreter with its traceback and 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    if sys.argv[2] == "entry":
        # `hf-zero` sets up the console before it loads any library (some read their switches only on import):
        # so does a server for its commands. A recipe script imports its libraries first, as its server does.
        from hf_zero.core.console import quiet_environment

        quiet_environment()
    for name in PREWARM:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    answer = os.fdopen(int(sys.argv[1]), "w", buffering=1)  # stdout and stderr hold what the imports printed
    answer.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answer.close()
            _child(req)
        answer.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)  # -N for a signal, as subprocess reports it
        answer.write(json.dumps({"rc": rc}) + "\n")


if __name__ == "__main__":
    main()
