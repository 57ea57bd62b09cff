"""Nothing runs, nothing is read, written or deleted outside the folders given (issue 39's attacks, in-process):
a payload behind a symlinked folder of a checkpoint, the `.metadata` torch unpickles with plain pickle, a `latest`
that names a path outside, manifest entries that leave the checkpoint, a conversion kept inside a checkpoint that
was altered after it was written, a truncated `.distcp`, an `OUT.partial/` hf_zero did not create, and a
checkpoint file linked to a file outside."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from hf_zero.checkpoint.convert import convert_to_universal, converted_for
from hf_zero.checkpoint.converted import record_conversion
from hf_zero.checkpoint.paths import read_tag
from hf_zero.checkpoint.safe_load import check_checkpoint, safe_checkpoint_loading
from hf_zero.checkpoint.store import MANIFEST_NAME, crc32_of, file_sizes, validate_checkpoint, write_manifest
from hf_zero.cli import main
from hf_zero.core.errors import UserError


class Payload:
    """Unpickled with plain pickle, it creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _dcp(folder: Path) -> Path:
    """A small real distributed checkpoint (an optimizer's: tensors and byte items) in `folder`."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(2, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    dcp.save({"optimizer": optim.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _manifest(checkpoint: Path) -> None:
    write_manifest(checkpoint, {rel: crc32_of(checkpoint / rel) for rel in file_sizes(checkpoint)})


# ---------------------------------------------------------------- item 1: code from a symlinked folder

def test_a_payload_behind_a_symlinked_folder_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "checkpoint-10"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    elsewhere = _dcp(tmp_path / "elsewhere" / "pytorch_model_fsdp_0")
    (elsewhere / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=4))
    (checkpoint / "pytorch_model_fsdp_0").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError) as err:
        check_checkpoint(checkpoint)  # Path.rglob skipped the linked folder: 0 files checked, no refusal
    assert err.value.line().startswith(f"checkpoint: {checkpoint / 'pytorch_model_fsdp_0'} is a symbolic link to "
                                       f"{elsewhere}, outside {checkpoint}; ")
    # export refuses it in one line before reading anything
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    assert not marker.exists() and not (tmp_path / "out").exists()
    # torch's own read of .metadata (plain pickle.load) is checked first under the guard, wherever it is called
    import torch.distributed.checkpoint as dcp

    with safe_checkpoint_loading(), pytest.raises(UserError, match=r"\.metadata holds posix\.system"):
        dcp.FileSystemReader(str(elsewhere)).read_metadata()
    assert not marker.exists()


def test_links_inside_the_checkpoint_are_checked_where_they_lead(tmp_path):
    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "checkpoint-10"
    (checkpoint / "sub").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, checkpoint / "sub" / "fine.pt")
    (checkpoint / "scheduler.pt").symlink_to(checkpoint / "sub" / "fine.pt")
    (checkpoint / "loop").symlink_to(checkpoint, target_is_directory=True)  # each real file is checked once
    assert check_checkpoint(checkpoint) == 1
    torch.save({"x": Payload(marker)}, checkpoint / "sub" / "fine.pt")
    with pytest.raises(UserError, match="holds posix.system"):
        check_checkpoint(checkpoint)
    # A protocol 0 pickle has no header byte: a .metadata is checked whatever it starts with.
    (checkpoint / "sub" / "fine.pt").unlink()
    (checkpoint / "scheduler.pt").unlink()
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=0))
    with pytest.raises(UserError, match=r"\.metadata holds posix\.system"):
        check_checkpoint(checkpoint)
    assert not marker.exists()


# ---------------------------------------------------------------- item 4: paths read from files

@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_latest_naming_a_folder_outside_is_refused_and_nothing_outside_is_deleted(tmp_path, how):
    victim = tmp_path / "victim"
    for folder in (victim, tmp_path / "victim_universal", tmp_path / "victim_universal.partial"):
        folder.mkdir()
        (folder / "precious.txt").write_text("mine")
    checkpoint = tmp_path / "run" / "checkpoint-10"
    checkpoint.mkdir(parents=True)
    (checkpoint / "latest").write_text(str(victim) if how == "absolute" else "../../victim")
    line = f"checkpoint: {checkpoint / 'latest'} names "
    for call in (lambda: check_checkpoint(checkpoint), lambda: convert_to_universal(checkpoint),
                 lambda: read_tag(checkpoint, "latest")):
        with pytest.raises(UserError) as err:
            call()
        assert err.value.line().startswith(line), err.value.line()
    (checkpoint / "latest").write_text("global_step10")
    (checkpoint / "latest_universal").write_text("../../victim_universal")
    with pytest.raises(UserError):
        converted_for(checkpoint, "deepspeed")
    for folder in (victim, tmp_path / "victim_universal", tmp_path / "victim_universal.partial"):
        assert (folder / "precious.txt").read_text() == "mine"


def test_manifest_entries_outside_the_checkpoint_make_it_damaged(tmp_path):
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "a.json").write_text("{}")
    (tmp_path / "secret").write_text("s")
    for rel in ("../secret", str(tmp_path / "secret")):
        entry = {"bytes": 1, "crc32": crc32_of(tmp_path / "secret")}
        (checkpoint / MANIFEST_NAME).write_text(json.dumps({"format": 1, "files": {rel: entry}}))
        assert validate_checkpoint(checkpoint) == f"{MANIFEST_NAME} names {rel!r}, outside the checkpoint"


def test_a_staging_area_linked_elsewhere_is_unlinked_not_written_through(tmp_path):
    from types import SimpleNamespace

    from hf_zero.checkpoint.resume import _choose
    from hf_zero.checkpoint.store import STAGING_DIR

    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (elsewhere / "checkpoint-5").mkdir(parents=True)
    (elsewhere / "checkpoint-5" / "mine.txt").write_text("mine")
    out.mkdir()
    (out / STAGING_DIR).symlink_to(elsewhere, target_is_directory=True)
    ctx = SimpleNamespace(training_args=SimpleNamespace(output_dir=str(out), resume_from_checkpoint=None))
    assert _choose(ctx, False)["resume"] is None
    assert not (out / STAGING_DIR).is_symlink() and (elsewhere / "checkpoint-5" / "mine.txt").read_text() == "mine"


# ---------------------------------------------------------------- item 3: the conversion kept inside

def _converted(tmp_path) -> Path:
    """A checkpoint with its manifest, then a universal conversion kept inside it and recorded."""
    checkpoint = tmp_path / "checkpoint-10"
    checkpoint.mkdir()
    torch.save({"w": torch.ones(3)}, checkpoint / "scheduler.pt")
    _manifest(checkpoint)
    universal = checkpoint / "global_step10_universal"
    (universal / "zero" / "w").mkdir(parents=True)
    torch.save({"param": torch.ones(64), "cat_dim": 0}, universal / "zero" / "w" / "fp32.pt")
    (universal / ".complete").write_text("ok\n")
    (checkpoint / "latest_universal").write_text(universal.name)
    return checkpoint


def test_a_conversion_is_trusted_only_as_recorded_in_the_manifest(tmp_path):
    checkpoint = _converted(tmp_path)
    assert not converted_for(checkpoint, "deepspeed")  # complete, but not recorded: an older or interrupted one
    record_conversion(checkpoint, "deepspeed")
    assert converted_for(checkpoint, "deepspeed") and validate_checkpoint(checkpoint) is None
    weights = checkpoint / "global_step10_universal" / "zero" / "w" / "fp32.pt"
    data = bytearray(weights.read_bytes())
    at = data.index(torch.ones(1).numpy().tobytes())  # flip bytes of the first weight, size unchanged
    data[at:at + 4] = b"\xff\xff\x7f\x7f"
    weights.write_bytes(bytes(data))
    assert not converted_for(checkpoint, "deepspeed")  # the checkpoint's own files still verify: it is redone
    assert validate_checkpoint(checkpoint) is None
    record_conversion(checkpoint, "deepspeed")
    (weights.parent / "extra.pt").write_bytes(weights.read_bytes())
    assert not converted_for(checkpoint, "deepspeed")


def test_a_truncated_distcp_is_one_line(tmp_path):
    folder = _dcp(tmp_path / "checkpoint-4" / "optimizer_0")
    assert check_checkpoint(folder.parent) == 1
    distcp = next(folder.glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:100])
    with pytest.raises(UserError) as err:
        check_checkpoint(folder.parent)
    assert err.value.line().startswith(f"checkpoint: {distcp} is truncated (100 bytes; its .metadata reads up to ")
    import torch.distributed.checkpoint as dcp

    # torch's own reader, under the guard (dcp.load wraps what it raises: the resume and export check first)
    with safe_checkpoint_loading(), pytest.raises(UserError, match="is truncated"):
        dcp.FileSystemReader(str(folder)).read_metadata()


# ---------------------------------------------------------------- item 4: export's folders

def _model_folder(root: Path) -> Path:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder = root / "final"
    folder.mkdir(parents=True)
    LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=32).save_pretrained(folder)
    save_file({"lm_head.weight": torch.ones(32, 8)}, str(folder / "model.safetensors"))
    return folder


def test_export_never_deletes_a_partial_folder_it_did_not_create(tmp_path, capsys):
    folder = _model_folder(tmp_path)
    out = tmp_path / "exported"
    partial = tmp_path / "exported.partial"
    partial.mkdir()
    (partial / "thesis.tex").write_text("years of work")
    assert main(["export", str(folder), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hf-zero: error: --out: {partial} exists and was not left by hf-zero export; it is where the export is "
        f"written until complete; move or remove {partial}, or choose another --out")
    assert (partial / "thesis.tex").read_text() == "years of work" and not out.exists()
    # One an interrupted export left (it holds the export's mark) is replaced; the mark never reaches the export.
    (partial / "thesis.tex").unlink()
    (partial / ".hf_zero_export_partial").write_text("")
    (partial / "half.safetensors").write_text("")
    assert main(["export", str(folder), "--out", str(out)]) == 0
    assert not partial.exists() and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_checkpoint_file_linked_outside_is_not_exported(tmp_path, capsys):
    folder = _model_folder(tmp_path)
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    (folder / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "exported"
    assert main(["export", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-zero: error: checkpoint: {folder / 'tokenizer.json'} is a symbolic link to {secret}")
    assert not out.exists() and not (tmp_path / "exported.partial").exists()


@pytest.mark.multiproc
def test_a_real_conversion_joins_the_manifest_and_an_altered_one_is_redone(strategy_runs, tmp_path, capsys):
    """zero2's checkpoint-15 (2 ranks) converted in place for fsdp2 (through DeepSpeed's universal checkpoint), as a
    resume under fsdp2 does; a flipped byte in a `.distcp` of the conversion makes the next resume convert again."""
    import shutil

    from hf_zero.checkpoint.convert import convert_in_place

    checkpoint = tmp_path / "checkpoint-15"
    shutil.copytree(strategy_runs["zero2"].out / "checkpoint-15", checkpoint)
    convert_in_place(checkpoint, "fsdp2", convert_to_universal)
    recorded = json.loads((checkpoint / MANIFEST_NAME).read_text())["converted"]
    tops = {rel.split("/", 1)[0] for rel in recorded}
    assert tops == {"latest_universal", "global_step15_universal", "pytorch_model_fsdp_0", "optimizer_0"}
    assert converted_for(checkpoint, "fsdp2") and converted_for(checkpoint, "deepspeed")
    assert validate_checkpoint(checkpoint) is None and check_checkpoint(checkpoint) > 7
    distcp = next((checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
    good = distcp.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    distcp.write_bytes(bytes(data))
    assert not converted_for(checkpoint, "fsdp2")
    capsys.readouterr()
    convert_in_place(checkpoint, "fsdp2", convert_to_universal)
    assert ("checkpoint-15: its conversion for fsdp2 is not the one recorded (pytorch_model_fsdp_0/"
            f"{distcp.name} does not match its checksum); converting again") in capsys.readouterr().out
    assert distcp.read_bytes() == good and converted_for(checkpoint, "fsdp2")
