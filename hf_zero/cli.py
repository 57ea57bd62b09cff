"""`hf-zero`: one command with sub-commands. Each lives in its own module and is imported only when called, so
`hf-zero --help` answers without loading torch."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from hf_zero.core.console import VERBOSE_ENV, quiet_environment, verbose
from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.launch.worker import write_failure

__all__ = ["main", "COMMANDS", "escaped_error"]

EXIT_BUG = 1  # an exception hf-zero did not expect: its own bug, not the input's

# What `hf-zero --help` opens with: for a person running it (the module docstring is for the code's readers).
DESCRIPTION = ("Fine-tune a causal LM or a classifier with Accelerate, DeepSpeed ZeRO, FSDP2 and PEFT: plan the "
               "memory, check the recipe, train, answer prompts with the result, export it.")

# name -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("hf_zero.commands.train",
              "launch a recipe under a profile (picks one from the hardware when none is given)"),
    "init": ("hf_zero.commands.init", "write a commented recipe YAML for a model and your data file, to grow from"),
    "profiles": ("hf_zero.commands.profiles", "list the profiles, or say which one this machine would use"),
    "estimate": ("hf_zero.commands.estimate", "memory per rank for every strategy, before you pay for GPUs"),
    "check": ("hf_zero.commands.check",
              "preflight: every configuration mistake in one line each, before any process starts"),
    "export": ("hf_zero.commands.export",
               "write a Hugging Face folder from any checkpoint (ZeRO shards consolidated)"),
    "convert": ("hf_zero.commands.convert",
                "rewrite a checkpoint for another profile (ZeRO stage, FSDP2) so a run resumes from it there"),
    "bench": ("hf_zero.commands.bench",
              "DDP vs ZeRO-1/2/3/offload and FSDP2 side by side: time, memory, loss parity"),
    "slurm": ("hf_zero.commands.slurm", "write an sbatch script that runs a recipe on N nodes"),
    "preview": ("hf_zero.commands.preview",
                "show a recipe's samples as the model will see them: format, trained tokens, lengths"),
    "generate": ("hf_zero.commands.generate",
                 "answer a prompt with a trained model or adapter (and its chat template)"),
}


class _Parser(argparse.ArgumentParser):
    """argparse prints usage and exits on bad flags; hf_zero wants the one-line error and exit code 2.

    Every `--multi-word` flag is also taken as `--multi_word`, the recipe flags' spelling (as `accelerate launch`
    takes both), through a second, hidden argument with the same destination: --help lists each flag once.
    `dash_only` names flags whose underscore spelling is a recipe flag of another meaning, passed on to the recipe."""

    dash_only: tuple = ()
    underscored: tuple = ()

    def error(self, message):
        raise UserError(self.prog, message, f"see `{self.prog} --help`")

    def add_argument(self, *flags, **kwargs):
        action = super().add_argument(*flags, **kwargs)
        aliases = tuple("--" + f[2:].replace("-", "_") for f in flags
                        if f.startswith("--") and "-" in f[2:] and f not in self.dash_only)
        if aliases:
            super().add_argument(*aliases, **{**kwargs, "dest": action.dest, "help": argparse.SUPPRESS,
                                              "required": False})
            self.underscored += aliases
        return action

    def format_help(self):
        text = super().format_help()
        if self.underscored:
            dashed = self.underscored[-1].replace("_", "-")
            text += f"\nFlags take dashes or underscores ({dashed} or {self.underscored[-1]}).\n"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-zero", description=DESCRIPTION, allow_abbrev=False,
                     epilog="`hf-zero COMMAND --help` lists a command's flags.")
    parser.add_argument("-V", "--version", action="store_true", help="print hf-zero's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str):
    """`hf-zero NAME`'s parser, and the module that runs it."""
    module = importlib.import_module(COMMANDS[name][0])
    sub = _Parser(prog=f"hf-zero {name}", description=COMMANDS[name][1], allow_abbrev=False,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.dash_only = getattr(module, "DASH_ONLY", ())
    module.add_arguments(sub)
    try:  # one console rule for every command (hf_zero.core.console); `train` says more about its own --verbose
        sub.add_argument("--verbose", action="store_true",
                         help="show the libraries' warnings and progress bars (hidden by default)")
    except argparse.ArgumentError:
        pass
    return sub, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    name = "hf-zero"
    try:
        if not argv or argv[0] in ("-h", "--help"):
            parser.print_help()
            return 0
        if argv[0] in ("-V", "--version"):
            print(f"hf-zero {_version()}")
            return 0
        if argv[0] not in COMMANDS:
            raise UserError("hf-zero", f"unknown command {argv[0]!r}", f"use one of: {', '.join(COMMANDS)}")
        name = argv[0]
        sub, module = command_parser(name)
        args, extra = sub.parse_known_args(argv[1:])
        if extra and not getattr(module, "ACCEPTS_EXTRA", False):
            raise UserError(f"hf-zero {name}", f"unrecognized arguments: {' '.join(extra)}",
                            f"see `hf-zero {name} --help`")
        if getattr(args, "verbose", False):
            os.environ[VERBOSE_ENV] = "1"
        quiet_environment()  # before the command loads any library
        args.extra = extra
        args.command = name
        args.argv = argv  # as typed, for "resume with: hf-zero ..." lines
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"hf-zero: error: {err.line()}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"hf-zero: {_command(name)} interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001  (every command ends in one line, whatever escaped it)
        failed, code = escaped_error(name, err)
        if verbose() or "--verbose" in argv:
            traceback.print_exc()
        print(f"hf-zero: error: {failed.line()}", file=sys.stderr)
        return code


def _command(name: str) -> str:
    return "hf-zero" if name == "hf-zero" else f"hf-zero {name}"


def escaped_error(name: str, err: Exception) -> tuple[UserError, int]:
    """The one line and exit code for an exception a command did not turn into a UserError itself: a failed write
    (a full disk under `hf-zero export`) or a file the system refuses is the user's to fix (exit 2); anything else
    is a bug in hf-zero (exit 1), named with its type and first line, its traceback shown by --verbose."""
    failed = write_failure(err)
    if failed is not None:
        return failed, EXIT_USAGE
    why = str(err).splitlines()[0][:200] if str(err).strip() else ""
    if isinstance(err, OSError) and err.filename is not None:
        what = os.fsdecode(err.filename) if isinstance(err.filename, bytes) else str(err.filename)
        return UserError(_command(name), f"cannot use {what}: {err.strerror or why}",
                         "check that path (its kind, permissions and free space)"), EXIT_USAGE
    return UserError(_command(name), f"{type(err).__name__}: {why}" if why else type(err).__name__,
                     "an unexpected error (a bug in hf-zero): --verbose shows its traceback"), EXIT_BUG


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf_zero")
    except PackageNotFoundError:  # a checkout used without installing
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
