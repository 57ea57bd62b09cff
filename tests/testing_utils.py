"""Helpers shared by the test modules (here only; no test module imports another): paths, commands and recipes run
through the real launcher, the shared runs' flags (conftest.py's fixtures make the runs), the README's commands,
`hf-zero check` in-process, checkpoint helpers, short recipe YAMLs, free ports, a single-host Slurm."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from hf_zero.checkpoint.store import (
    MANIFEST_NAME,
    checkpoint_step,
    crc32_of,
    file_sizes,
    list_checkpoints,
    write_json_atomic,
    write_manifest,
)
from hf_zero.cli import main
from hf_zero.preflight.checks import CHECKS

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "accelerate_configs"
TINY = REPO / "recipes" / "configs" / "tiny_curriculum.yaml"
RECIPE = REPO / "recipes" / "curriculum.py"
# Every Python process a fast-tier test starts imports this folder's sitecustomize.py: a launcher or a rank marks it.
PROCESS_GUARD = Path(__file__).resolve().parent / "process_guard"
GROUP_MARKS_ENV = "HF_ZERO_TEST_GROUP_MARKS"


# ---------------------------------------------------------------- commands and launches

# 12 conversations: the chat case (the tiny tokenizer has no chat template: tokens added, embeddings grown).
CHAT_ROWS = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                           {"role": "assistant", "content": str(2 * i)}]} for i in range(12)]


def write_chat_rows(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT_ROWS))
    return path


def run_cmd(cmd, timeout=900, cwd=REPO, env=None, check=True):
    env = {**os.environ, **(env or {})}
    if os.environ.get("HF_ZERO_TEST_LAUNCH_LOG") and str(PROCESS_GUARD) not in env.get("PYTHONPATH", ""):
        # the launch counter (conftest.py) survives a test's own PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROCESS_GUARD), env.get("PYTHONPATH")]))
    cmd = [str(c) for c in cmd]
    proc = run_prewarmed(cmd, cwd, env, timeout) or subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
    )
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    return proc


def launch_recipe(profile, out_dir, *extra, config=TINY, recipe=RECIPE, nproc=None, timeout=900, check=True, env=None):
    """`accelerate launch --config_file PROFILE recipe --config C --output_dir OUT ...` in a subprocess."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", PROFILES / f"{profile}.yaml"]
    if nproc:
        cmd += ["--num_processes", nproc]
    cmd += [recipe, "--config", config, "--output_dir", out_dir, "--disable_tqdm", "true", *extra]
    return run_cmd(cmd, timeout=timeout, check=check, env=env)


def read_summary(out_dir) -> dict:
    return json.loads((Path(out_dir) / "summary.json").read_text())


# ---------------------------------------------------------------- a console holds only hf_zero's lines

# The lines hf_zero prints, as regexes matched at a line's start: its notes and errors, the lines it indents under
# them (a banner's details, the commands after a run's result, a preview's samples), a run's step, eval and banner
# lines, and each command's own report. Anything else (a library's warning, progress bar, notice or table) is noise.
HF_ZERO_LINES = (
    r"\[hf_zero\] ", r"\[hf_zero bench\] ", r"hf-zero: ", r"\s",
    r"step \d+/\d+ \| ", r"eval (before training|at step \d+)", r"={72}$", r"hf_zero \| profile ",  # a run
    r"(ok|FAIL|skip) [\w-]+: ",  # check
    r"stage '", r"plan: profile ",  # preview
    # estimate: its model line, the table's header and rows (a strategy name, then sizes), the legend, the advice
    r"model \S+: [\d,]+ params", r"strategy  ", r"(ddp|zero\d|fsdp2)\w*( 4-bit)? +(\d|0 B)", r"peak/(GPU|rank) = ",
    r"recommended: ", r"batch: \d+ micro x ",  # estimate: the batch line and precision, as check and train show them
    r"\|",  # bench's table
)
# What the launcher of a plain `accelerate launch` prints itself: no hf_zero code runs in that process.
ACCELERATE_LAUNCHER_LINES = (r"W\d{4} [\d:.]+ \d+ .*torch/distributed/run\.py",
                             r"\[[\d :,-]+\] \[WARNING\] \[real_accelerator")


def foreign_lines(text: str, *also: str) -> list[str]:
    """The lines of a captured console (stdout and stderr) that hf_zero did not print; `also`: more regexes of
    lines that belong (e.g. ACCELERATE_LAUNCHER_LINES). A progress bar's redraw or a colour code is never hf_zero's."""
    own = re.compile("|".join(f"(?:{p})" for p in (*HF_ZERO_LINES, *also)))
    return [line for line in text.splitlines()
            if "\r" in line or "\x1b[" in line or (line.strip() and not own.match(line))]


# ---------------------------------------------------------------- the shared runs (fixtures in conftest.py)

# Every strategy run: tokens seen (the stage switches show in them), a checkpoint every 5 steps (= the stage ends, so
# the evaluations come at 0, 5, 10, 15), the memory probe at the first step.
STRATEGY_FLAGS = ["--include_num_input_tokens_seen", "non_padding", "--save_strategy", "steps", "--save_steps", "5",
                  "--global_batch_size", "4", "--measure_memory", "true"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# LoRA under ZeRO-3, with reentrant gradient checkpointing (the combination that once failed). Rank 64: the adapter's
# states then outweigh a checkpoint's fixed files (RNG states, arguments), so its size shows what it holds.
LORA_R = 64
LORA_FLAGS = ["--use_peft", "true", "--lora_r", str(LORA_R), "--lora_dropout", "0", "--lora_target_modules",
              *LORA_TARGETS, "--gradient_checkpointing", "true", "--save_strategy", "steps", "--save_steps", "5"]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2")


@dataclass
class Run:
    out: Path
    stdout: str  # for the run through `hf-zero train`: its whole console (stdout and stderr), as a log file holds it
    stderr: str = ""
    args: list = field(default_factory=list)  # the hf-zero arguments that made it (`hf-zero train` runs only)
    log: Path | None = None
    times: list = field(default_factory=list)  # (seconds since the command started, line) (`hf-zero train` only)


def hf_zero_train(profile: str, out: Path, *extra) -> Run:
    """`hf-zero train` on 2 ranks, stdout and stderr captured to one file as a Slurm log would (no --disable_tqdm:
    the console must hold no progress-bar redraws on its own)."""
    args = ["train", "--profile", profile, "--config", TINY, "--output_dir", out, *extra]
    log = out.parent / f"{out.name}.log"
    times = []  # each line as it arrived: what a person watching the console sees, and when
    with open(log, "w") as f:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "hf_zero.cli", *map(str, args)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(900, proc.kill)
        timer.start()
        for line in proc.stdout:
            times.append((time.monotonic() - started, line.rstrip("\n")))
            f.write(line)
        proc.wait()
        timer.cancel()
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return Run(out, text, "", args, log, times)


class Lazy(dict):
    """d[key] made by make(key) on first read, then kept."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        self[key] = self._make(key)
        return self[key]


class OutAndRun:
    """view[name] = (output folder, run) of a lazy set of runs: launched when a test first reads it."""

    def __init__(self, runs):
        self._runs = runs

    def __getitem__(self, name):
        return self._runs[name].out, self._runs[name]


TINY24_FLAGS = ["--save_strategy", "steps", "--save_steps", "3", "--global_batch_size", "4"]


# ---------------------------------------------------------------- one optimizer step, for the memory probes

ONE_STEP = """\
# One stage, one optimizer step: enough to build the engine and see a whole step.
model_name_or_path: tiny-llama
max_seq_length: 64
eval_samples: 0
stages:
  - name: only
    data: recipes/data/tiny/short.jsonl
    steps: 1
per_device_train_batch_size: 2
learning_rate: 1.0e-3
seed: 42
dataloader_num_workers: 0
"""
ONE_STEP_LORA = ["--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0"]


# ---------------------------------------------------------------- the README's commands

def packed_losses_match_alone(model, rows: list[dict], collate, items_of, atol: float = 1e-4) -> int:
    """Per-token losses of packed multimodal rows (one forward, as the Trainer passes them) against each of their
    conversations run alone, unpacked: equal within `atol`. `items_of(ids)`: how many media items a conversation's
    ids hold (its items are the next ones of its row's `media`). Returns the conversations compared."""
    import torch

    from hf_zero.data.packing import IGNORE, documents_of

    def per_token(out, labels):
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                                 ignore_index=IGNORE, reduction="none")

    with torch.no_grad():
        batch = collate(rows)
        assert "attention_mask" not in batch and batch["use_cache"] is False
        packed = per_token(model(**batch), batch["labels"])
        compared = 0
        for r, row in enumerate(rows):
            offset, media = 0, list(row.get("media", ()))
            for doc in documents_of(row):
                n, take = len(doc["input_ids"]), items_of(doc["input_ids"])
                alone_batch = collate([{**doc, "media": media[:take]}])
                media = media[take:]
                alone = per_token(model(**alone_batch), alone_batch["labels"])[0]
                got = packed[r, offset:offset + n - 1]
                torch.testing.assert_close(got, alone, atol=atol, rtol=0)
                offset += n
                compared += 1
            assert not media  # every item went to a conversation
    return compared


README = REPO / "README.md"
DOCS = REPO / "docs"


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def docs_pages() -> list[Path]:
    """docs/ pages in the site's order (mkdocs.yml's nav), then any page the nav leaves out."""
    nav = [DOCS / p for p in _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])]
    return nav + sorted(set(DOCS.rglob("*.md")) - set(nav))


def shown_commands(text: str) -> list[str]:
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def readme_commands() -> list[str]:
    """The README's commands, then each docs page's, in the site's order; a command shown twice runs once, where it
    is first shown (later commands may read what earlier ones wrote)."""
    texts = [README.read_text()] + [p.read_text() for p in docs_pages()]
    return list(dict.fromkeys(c for text in texts for c in shown_commands(text)))


def run_as_user(cmd: str, checkout: Path, hf_home: Path) -> subprocess.CompletedProcess:
    """A shell command as a user types it in the checkout: its .venv's bin first on PATH, and not inside `make
    test`'s make (a nested make prints "Leaving directory" after the run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    env["PATH"] = f"{checkout / '.venv' / 'bin'}:{os.environ['PATH']}"
    env["HF_HOME"] = str(hf_home)
    return (_prewarmed_shell(cmd, checkout, env, timeout=1200)
            or subprocess.run(cmd, shell=True, cwd=checkout, env=env, capture_output=True, text=True, timeout=1200))


# ---------------------------------------------------------------- commands through a prewarmed Python

# HF_ZERO_TEST_PREWARM=0: every command in an interpreter of its own, as before (to compare, or to rule it out).
PREWARM_ENV = "HF_ZERO_TEST_PREWARM"
PREWARM_SERVER = Path(__file__).resolve().parent / "prewarmed_server.py"
# What differs from test to test and no import reads: one server serves them all.
_PER_TEST_VARS = {"PYTEST_CURRENT_TEST", GROUP_MARKS_ENV, "PWD", "OLDPWD", "_"}
# ... and what the commands read only as they run, never on import (each server has imported the libraries once, in
# its own environment; a forked command then runs in the request's): the search path for programs, make's own
# variables, the compiler and extension folder of a JIT build, and hf_zero's variables, which hf_zero reads in
# functions (tests/test_prewarmed_commands.py runs commands that read them). HF_ZERO_VERBOSE is the exception: the
# server sets up the console on start as `hf-zero` does, and a verbose command never goes to a server.
_RUN_TIME_VARS = {"PATH", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "CC", "CXX", "TORCH_EXTENSIONS_DIR"}


def _server_key(kind: str, env: dict) -> tuple:
    return (kind, *sorted((k, v) for k, v in env.items() if k not in _PER_TEST_VARS and k not in _RUN_TIME_VARS
                          and not (k.startswith("HF_ZERO_") and k != "HF_ZERO_VERBOSE")))


# Sub-commands that get an interpreter of their own: they start a launcher and ranks (their tests send signals to
# process groups), or a test is about what their fresh interpreter imports (tests/launch/test_lean_launch.py).
# `train` is forked all the same in a test that starts no process group (not marked multiproc, GROUP_MARKS_ENV set):
# there it stops before any launch (a bad input, --dry-run), as conftest's fast_tier_starts_no_process_group holds.
OWN_INTERPRETER = {"train", "bench", "slurm"}


def _own_interpreter(argv: list[str], env: dict) -> bool:
    """argv: the hf-zero command's words after `hf-zero`."""
    return bool(argv) and argv[0] in OWN_INTERPRETER and not (argv[0] == "train" and GROUP_MARKS_ENV in env)


_SERVERS: dict[tuple, "_PrewarmedPython"] = {}
_MAX_SERVERS = 3  # each holds torch, transformers and datasets (~0.6 GB); a worker uses two or three


class _PrewarmedPython:
    """One tests/prewarmed_server.py process for one environment; `run` forks a command from it."""

    def __init__(self, env: dict, kind: str):
        read_end, write_end = os.pipe()
        self.log = tempfile.NamedTemporaryFile(prefix="hf_zero_prewarm_", suffix=".log", delete=False)
        self.server = subprocess.Popen([sys.executable, str(PREWARM_SERVER), str(write_end), kind],
                                       stdin=subprocess.PIPE,
                                       stdout=self.log, stderr=self.log, env=env, cwd=REPO, pass_fds=(write_end,),
                                       text=True)
        os.close(write_end)
        self.kind, self.answers, self.pending = kind, read_end, b""
        ready = self._answer(timeout=600)
        # An import that printed something would have printed it in each command's own interpreter: not usable.
        self.usable = bool(ready and "ready" in ready) and os.path.getsize(self.log.name) == 0

    def _answer(self, timeout: float) -> dict | None:
        import select

        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.answers], [], [], left)[0]:
                return None
            chunk = os.read(self.answers, 4096)
            if not chunk:  # the server ended
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], cwd, env: dict, timeout: float):
        with tempfile.TemporaryDirectory(prefix="hf_zero_cmd_") as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            request = {"argv": argv, "kind": self.kind, "cwd": str(cwd), "env": env, "out": out, "err": err}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            started = self._answer(timeout=60)
            if not started:
                self.usable = False
                return None
            done = self._answer(timeout=timeout)
            if done is None:  # timed out (or the server died): as subprocess.run, kill it and what it started
                import signal

                try:
                    os.killpg(started["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._answer(timeout=60)
            text = {name: Path(path).read_text(errors="replace") if os.path.exists(path) else ""
                    for name, path in (("out", out), ("err", err))}
        if done is None:
            raise subprocess.TimeoutExpired(argv, timeout, text["out"], text["err"])
        return subprocess.CompletedProcess(argv, done["rc"], text["out"], text["err"])

    def close(self):
        self.server.kill()
        self.server.wait()
        os.close(self.answers)
        os.unlink(self.log.name)


def _close_servers():
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def run_prewarmed(cmd: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess | None:
    """`cmd` run in a process forked from a Python that has imported the libraries already, when it is an hf-zero
    command (not one in OWN_INTERPRETER) or a recipe script run by this interpreter; None otherwise (the caller
    runs it as its own process)."""
    if os.environ.get(PREWARM_ENV) == "0" or not cmd:
        return None
    if cmd[0] == sys.executable and cmd[1:3] == ["-m", "hf_zero.cli"]:
        kind, argv = "entry", ["hf_zero.cli", *cmd[3:]]
    elif cmd[0] == sys.executable and len(cmd) > 1 and Path(cmd[1]).resolve().parent == RECIPE.parent:
        kind, argv = "script", cmd[1:]
    else:
        return None
    if kind == "entry" and (_own_interpreter(argv[1:], env) or "--verbose" in argv):
        return None  # --verbose: the libraries' switches stay as they are, which a server has set on import
    if env.get("HF_ZERO_VERBOSE") == "1":
        return None
    # The fast tier's guard on PYTHONPATH (process_guard/) only acts as an interpreter starts: a forked command
    # never starts one, and what it starts gets the guard from the command's own environment.
    guard_free = {**env, "PYTHONPATH": os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p and p != str(PROCESS_GUARD))}
    key = _server_key(kind, guard_free)
    server = _SERVERS.pop(key, None)
    if server is None:
        if len(_SERVERS) >= _MAX_SERVERS:
            _SERVERS.pop(next(iter(_SERVERS))).close()  # the least recently used
        if not _SERVERS:
            import atexit

            atexit.register(_close_servers)
        server = _PrewarmedPython(env, kind)
    _SERVERS[key] = server  # most recently used last
    if not server.usable:
        return None
    proc = server.run(argv, cwd, env, timeout)
    if proc is not None:
        proc.args = cmd  # as the caller gave it, for its failure messages
    return proc


def _prewarmed_shell(cmd: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess | None:
    """A shell line made only of `[VAR=value ...] hf-zero ARGS [> FILE]` joined by `&&` (no pipes, expansions or
    other redirections), each part run as run_prewarmed runs it, stopping at the first that fails, as the shell
    would; None for any other line (the caller gives it to the shell)."""
    import shlex

    if re.search(r"[$`*?\\]", cmd):
        return None
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    parts = [[]]
    for word in lexer:
        if word == "&&":
            parts.append([])
        elif set(word) <= set("|&;<>()") and word != ">":
            return None
        else:
            parts[-1].append(word)
    venv_python = Path(cwd) / ".venv" / "bin" / "python"
    if not venv_python.exists() or venv_python.resolve() != Path(sys.executable).resolve():
        return None
    commands = []
    for part in parts:
        part_env, target = env, None
        while part and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", part[0]):
            name, value = part.pop(0).split("=", 1)
            part_env = {**part_env, name: value}
        if len(part) >= 2 and part[-2] == ">":
            target, part = part[-1], part[:-2]
        if not part or part[0] != "hf-zero" or ">" in part or _own_interpreter(part[1:], part_env):
            return None
        commands.append(([sys.executable, "-m", "hf_zero.cli", *part[1:]], part_env, target))
    out, err, rc = "", "", 0
    for i, (argv, part_env, target) in enumerate(commands):
        proc = run_prewarmed(argv, cwd, part_env, timeout)
        if proc is None:
            assert i == 0, "a prewarmed server went away between two parts of one line"
            return None
        if target is None:
            out += proc.stdout
        else:
            (Path(cwd) / target).write_text(proc.stdout)
        err, rc = err + proc.stderr, proc.returncode
        if rc != 0:
            break
    return subprocess.CompletedProcess(cmd, rc, out, err)


def readme_command(*words) -> str:
    """The one README command holding all these words."""
    (cmd,) = [c for c in readme_commands() if all(w in c for w in words)]
    return cmd


# ---------------------------------------------------------------- `hf-zero check` in-process

def check(capsys, *args, output_dir=None):
    """Run `hf-zero check` in-process: (exit code, {check: (ok, message)}), asserting the one-line format."""
    extra = ["--output-dir", str(output_dir)] if output_dir else []
    rc = main(["check", *args, *extra])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(" ", 2)[1].rstrip(":") for ln in lines] == list(CHECKS), lines
    assert all(ln.startswith(("ok ", "FAIL ", "skip ")) for ln in lines), lines
    # ok: True, FAIL: False, skip (not checked because what it needs failed earlier): None
    results = {ln.split(" ", 2)[1].rstrip(":"): ({"ok": True, "FAIL": False, "skip": None}[ln.split(" ")[0]],
                                                 ln.split(": ", 1)[1]) for ln in lines}
    assert rc == (2 if any(ok is False for ok, _ in results.values()) else 0)
    return rc, results


def failed(results) -> set:
    return {name for name, (ok, _) in results.items() if ok is False}


def skipped(results) -> set:
    return {name for name, (ok, _) in results.items() if ok is None}


def profile(tmp_path, base="zero2", replace=None, append="") -> str:
    text = (PROFILES / f"{base}.yaml").read_text()
    for old, new in (replace or {}).items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / f"my_{base}.yaml"
    path.write_text(text + append)
    return str(path)


def start_args(tmp_path):
    from hf_zero.plan.arguments import CurriculumArguments, ModelArguments
    from hf_zero.plan.parse import parse_recipe_args

    m, stages, kwargs, _ = parse_recipe_args((ModelArguments, CurriculumArguments),
                                             ["--config", str(TINY), "--output_dir", str(tmp_path / "o")])
    return kwargs, (m,), stages


def check_at_start(profile, training_kwargs: dict, parsed: tuple, stages: list, world: int,
                   config: str | None = None, env: dict | None = None) -> None:
    """The recipe's two start-up checks in the order a run makes them (hf_zero.train.run: the launch, then, once
    the offline assets are in the cache, the room), without a run between them."""
    from hf_zero.preflight.at_start import check_launch_at_start, check_room_at_start

    check_launch_at_start(profile, parsed, world, config, env)
    check_room_at_start(profile, training_kwargs, parsed, stages, world, env)


def read_activations(output_dir) -> list[dict]:
    """Every rank's activation record ({"rank", "steps": [{"step", "saved_bytes", "tokens"}]}, written by
    hf_zero.estimate.measure.ActivationRecorder), ordered by rank."""
    files = sorted(Path(output_dir).glob("activations_rank*.json"),
                   key=lambda p: int(p.stem[len("activations_rank"):]))
    return [json.loads(f.read_text()) for f in files]


# ---------------------------------------------------------------- checkpoints

def make_checkpoint(root: Path, step: int, eval_loss: float | None = None, payload: int = 1000) -> Path:
    folder = root / f"checkpoint-{step}"
    (folder / "global_step").mkdir(parents=True)
    (folder / "global_step" / "optim_states.pt").write_bytes(bytes(range(256)) * (payload // 256 + 1))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    write_json_atomic(folder / "hf_zero_checkpoint.json",
                      {"global_step": step, "metrics": {} if eval_loss is None else {"eval_loss": eval_loss}})
    write_manifest(folder, {rel: crc32_of(folder / rel) for rel in file_sizes(folder)})
    return folder


def with_meta(tmp_path, **meta):
    ck = make_checkpoint(tmp_path, 6)
    base = {"global_step": 6, "world_size": 2, "zero_stage": 2, "profile": "zero2", "global_batch": 4,
            "micro_batch": 2, "grad_accum": 1}
    write_json_atomic(ck / "hf_zero_checkpoint.json", {**base, **meta})
    write_manifest(ck, {rel: crc32_of(ck / rel) for rel in file_sizes(ck)})
    return ck


def published(out) -> list[int]:
    return [checkpoint_step(f) for f in list_checkpoints(out) if (f / MANIFEST_NAME).is_file()]


def max_weight_diff(a, b) -> float:
    wa, wb = (load_file(str(Path(run) / "final" / "model.safetensors")) for run in (a, b))
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def losses_after(out, step: int) -> list[float]:
    history = json.loads((Path(out) / "log_history.json").read_text())
    return [h["loss"] for h in history if "loss" in h and h["step"] > step]


# ---------------------------------------------------------------- scale-out: short configs, ports, libaio, Slurm

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_short_config(src: Path, dst: Path, steps: list[int], **overrides) -> Path:
    """`src` cut to the first len(steps) stages of the given lengths, without eval, data paths made absolute (the
    run may start elsewhere, e.g. under Slurm): the same model and data as the shipped YAML, fewer steps."""
    data = yaml.safe_load(Path(src).read_text())
    stages = []
    for stage, n in zip(data["stages"], steps):
        paths = stage["data"] if isinstance(stage["data"], list) else [stage["data"]]
        data_paths = [p if p.startswith("builtin:") else str((Path(src).parent / p).resolve()) for p in paths]
        # A warmup as long as the stage never reaches its peak LR, which the stage checks refuse: shorten it too.
        warmup = {"warmup_steps": min(stage["warmup_steps"], n - 1)} if "warmup_steps" in stage else {}
        stages.append({**stage, "steps": n, "data": data_paths, **warmup})
    data.update({"stages": stages, "eval_samples": 0, **overrides})  # eval_samples may be overridden
    dst.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


SLURM_CONF = """\
ClusterName=hfzero
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/slurmd
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def libaio_missing_reason() -> str | None:
    """Why NVMe offload cannot run here (None: it can), asked exactly as the preflight asks."""
    from hf_zero.core.ops import libaio_available

    if libaio_available():
        return None
    return "libaio not installed (run scripts/system_deps.sh: apt-get install -y libaio-dev)"


def slurm_missing_reason() -> str | None:
    """Why a real Slurm cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "starting slurmd/munged needs root"
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo") if not shutil.which(b)]
    if missing:
        return f"{', '.join(missing)} not installed (run scripts/system_deps.sh: apt-get install slurm-wlm munge)"
    if not Path("/etc/munge/munge.key").is_file():
        return "no /etc/munge/munge.key (reinstall munge)"
    return None


class SingleHostSlurm:
    """munged + slurmctld + slurmd on this host, all state in a private temp folder; stopped by their pid files.

    A private munge socket and free ports keep it apart from any other Slurm on the machine."""

    def __init__(self):
        self.host = socket.gethostname()
        self.state = Path(tempfile.mkdtemp(prefix="hfz-slurm-"))  # not under pytest's root-only 0700 tmp tree:
        self.state.chmod(0o755)  # munged runs as user munge and must reach its socket folder
        self.conf = self.state / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd, check=True, timeout=60) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def start(self) -> "SingleHostSlurm":
        munge = self.state / "munge"
        munge.mkdir()
        munge.chmod(0o755)  # munged insists that everyone can reach its socket
        shutil.chown(munge, "munge", "munge")
        for sub in ("ctld", "slurmd"):
            (self.state / sub).mkdir()
        self.conf.write_text(SLURM_CONF.format(host=self.host, state=self.state, cpus=os.cpu_count() or 2,
                                               ctld_port=free_port(), slurmd_port=free_port()))
        self.run("runuser", "-u", "munge", "--", "munged", f"--socket={munge}/munge.socket",
                 f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                 f"--seed-file={munge}/munged.seed")
        self.run("slurmctld", "-c", "-f", str(self.conf))
        self.run("slurmd", "-f", str(self.conf))
        deadline = time.time() + 60
        while time.time() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return self
            time.sleep(1)
        raise RuntimeError(f"the node never became idle (sinfo: {state!r}):\n{self.logs()}")

    def submit(self, script: Path) -> str:
        out = self.run("sbatch", "--parsable", str(script)).stdout.strip()
        return out.split(";")[0]

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", job_id, check=False).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "UNKNOWN")

    def wait(self, job_id: str, timeout: float = 600, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                  "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state in until:
                return state
            time.sleep(2)
        raise TimeoutError(f"job {job_id} still {self.job_state(job_id)} after {timeout} s")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
                         for p in sorted(self.state.rglob("*.log")))

    def stop(self) -> None:
        pids = []
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            try:
                pid = int((self.state / pid_file).read_text().strip())
                os.kill(pid, 15)
                pids.append(pid)
            except (OSError, ValueError):
                pass
        deadline = time.time() + 10  # a clean exit before the folder goes
        for pid in pids:
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
        shutil.rmtree(self.state, ignore_errors=True)

# ---------------------------------------------------------------- GPU runs (tests/train/test_gpu.py, QLoRA's GPU test)

# Two ranks cannot share one GPU: launches on a GPU machine use min(2, GPUs) ranks.
GPU_NPROC = min(2, torch.cuda.device_count())
GPU_RECIPE_YAML = REPO / "recipes" / "configs" / "smollm2_shakespeare.yaml"
# SmolLM2-135M's shape (the calibration's `smol-rand`), built with random weights: no download.
SMOL_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=1)
