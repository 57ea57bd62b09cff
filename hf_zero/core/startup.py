"""Where start-up goes, and a start-up that talks.

Each process of a run says what it starts doing (`phase`): the command (`hf-zero train`: the preflight, the offline
assets), the launcher (the run plan, starting the ranks), then every rank (imports, process group, data, model,
engine). A phase lasts until the next one starts; the clock starts at HF_ZERO_T0, the wall time the command began,
set by the first hf_zero process of the launch (or by `hf-zero bench` just before it launches) and inherited by every
process after it. The launcher hands its phases to the ranks in HF_ZERO_STARTUP_PHASES, so rank 0 holds the whole
story: summary.json records it (`startup_s`), `hf-zero bench` prints it beside the plain script's.

Start-up that talks: a heartbeat thread (the command's, until rank 0 is running; then rank 0's, until its first
optimizer step begins) prints the current phase with the seconds since the command began every HEARTBEAT_S. A quick
start-up prints nothing more; a minute of ZeRO-3 start-up is never silent.
Always on: a phase costs one `time.time()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

__all__ = ["T0_ENV", "PHASES_ENV", "HEARTBEAT_S", "ALIVE_NAME", "start_clock", "t0", "phase", "current", "phases",
           "hand_on", "durations", "breakdown", "finish", "end_command", "start_heartbeat", "hand_over_at",
           "take_over", "stop_heartbeat", "progress", "now_doing"]

T0_ENV = "HF_ZERO_T0"
PHASES_ENV = "HF_ZERO_STARTUP_PHASES"
HEARTBEAT_S = 10.0
ALIVE_NAME = "rank0-started"  # in the launch's status folder: the launcher's heartbeat hands over to rank 0's
SAID_NAME = "heartbeat-said"  # beside it: when the launcher last printed, so that rank 0 keeps the same beat

_own: list[tuple[str, float]] = []  # (what this process started doing, wall time)
_said = [0.0]  # wall time of the heartbeat's last line
_progress: list = [None]  # how far the current phase is, said after it by the heartbeat (progress())
# end: when start-up ended (the first step began); folder: the launch's status folder, where the heartbeat is handed on
_state: dict = {"end": None, "folder": None}
_stop = threading.Event()
_thread: list[threading.Thread] = []


def start_clock(env=os.environ) -> float:
    """The command's start: kept if a process before this one set it (a launcher under hf-zero train or bench), else
    now, with this process's phases begun afresh (an in-process caller runs one command after another)."""
    if not env.get(T0_ENV):
        env[T0_ENV] = repr(time.time())
        env.pop(PHASES_ENV, None)
        _own.clear()
        _said[0] = 0.0
        _state.update(end=None, folder=None)
    return float(env[T0_ENV])


def end_command(env=os.environ) -> None:
    """The command that started the clock is over: nothing of it reaches a later launch from this process."""
    stop_heartbeat()
    for name in (T0_ENV, PHASES_ENV):
        env.pop(name, None)


def t0() -> float:
    try:
        return float(os.environ[T0_ENV])
    except (KeyError, ValueError):
        return _own[0][1] if _own else time.time()


def phase(doing: str, say: bool = False) -> None:
    """This process starts `doing` (words a person reads: "building the model under zero.Init"); `say`: print it
    now (the command's first line)."""
    now = time.time()
    if _state["end"] is not None:  # training runs: what it waits for is no start-up phase
        return
    _own.append((doing, now))
    _progress[0] = None
    if say:
        _line(doing, now)


def progress(text: str | None) -> None:
    """How far the current phase has come ("held-out set 1/2, batch 3/13, about 20 s left"): the heartbeat's lines
    say it after the phase, so a long phase's lines differ and tell how long it takes. No phase of its own:
    summary.json's startup_s keeps the phase whole."""
    if _state["end"] is None:
        _progress[0] = text


def now_doing() -> str:
    """What the heartbeat says: the current phase, and how far it has come when that is known."""
    doing = _own[-1][0] if _own else "starting"
    return f"{doing}: {_progress[0]}" if _progress[0] else doing


def current() -> str | None:
    """What this process is doing now, while it starts up."""
    return _own[-1][0] if _own and _state["end"] is None else None


def phases() -> list[tuple[str, float]]:
    """The launch's phases so far: those of the processes before this one (the launcher's), then this one's."""
    try:
        before = [(str(d), float(t)) for d, t in json.loads(os.environ.get(PHASES_ENV) or "[]")]
    except (ValueError, TypeError):
        before = []
    return before + [p for p in _own if p not in before]


def hand_on(env=os.environ) -> None:
    """Pass this process's phases to the processes it starts (the launcher's to the ranks)."""
    env[PHASES_ENV] = json.dumps(phases())


def durations(marks: list, start: float, end: float) -> list[tuple[str, float]]:
    """Seconds of each phase: from its start to the next one's (the last one to `end`), in order; the time from
    `start` to the first phase is "Python start-up and imports". Phases named alike are added up."""
    marks = sorted(marks, key=lambda m: m[1])
    edges = [("Python start-up and imports", start), *marks]
    out: dict[str, float] = {}
    for (doing, begin), (_, until) in zip(edges, [*edges[1:], ("end", end)]):
        out[doing] = out.get(doing, 0.0) + max(until - begin, 0.0)
    return list(out.items())


def finish(at: float | None = None) -> None:
    """Start-up is over (the first optimizer step began at `at`): the heartbeat stops, phases are no longer kept."""
    _state["end"] = at or time.time()
    stop_heartbeat()


def breakdown() -> dict[str, float]:
    """This run's start-up phases in seconds (from HF_ZERO_T0 to the first step), for summary.json."""
    end = _state["end"] or time.time()
    return {doing: round(s, 2) for doing, s in durations(phases(), t0(), end) if round(s, 2)}


def _line(doing: str, now: float) -> None:
    _said[0] = now
    line = f"[hf_zero] {doing} ({now - t0():.0f} s)"
    if "tqdm" in sys.modules:  # above a progress bar on screen (an evaluation's before the first step), not inside it
        sys.modules["tqdm"].tqdm.write(line, file=sys.stdout)
    else:
        sys.stdout.write(line + "\n")  # one write: no other thread's text inside the line
    sys.stdout.flush()
    if _state["folder"] is not None:
        with contextlib.suppress(OSError):
            (_state["folder"] / SAID_NAME).write_text(repr(now))


def hand_over_at(folder: Path) -> None:
    """The launcher's heartbeat ends once rank 0 has taken it over in `folder` (the launch's status folder)."""
    _state["folder"] = Path(folder)


def take_over(folder: Path | None, beat: bool = True) -> None:
    """A machine's first rank ends its launcher's heartbeat (in `folder`); with `beat` (rank 0, the console) it goes
    on with it, on the launcher's beat (the time of its last line, read from `folder`)."""
    if folder is not None:
        with contextlib.suppress(OSError, ValueError):
            _said[0] = float((Path(folder) / SAID_NAME).read_text())
        with contextlib.suppress(OSError):
            (Path(folder) / ALIVE_NAME).write_text(str(os.getpid()))
    if beat:
        start_heartbeat()


def start_heartbeat(every: float = HEARTBEAT_S) -> None:
    """Print the current phase every `every` seconds, until `stop_heartbeat()` or the hand-over file exists."""
    if _thread and _thread[0].is_alive():
        return
    _stop.clear()
    _said[0] = _said[0] or time.time()

    def beat():
        while not _stop.wait(min(1.0, every / 4)):
            folder = _state["folder"]  # the launcher's (set once it exists): it stops once rank 0 has taken over
            if folder is not None and (folder / ALIVE_NAME).exists():
                return
            now = time.time()
            if now - _said[0] >= every:
                _line(now_doing(), now)

    thread = threading.Thread(target=beat, name="hf_zero-heartbeat", daemon=True)
    _thread[:] = [thread]
    thread.start()


def stop_heartbeat() -> None:
    _stop.set()
