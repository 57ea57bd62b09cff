"""A small YAML cannot exhaust memory: nested aliases ("billion laughs") in a recipe or a profile are refused in one
line naming the file, before any value is built; a few plain aliases still load. The bomb is run under a memory
bound in a child process: what the run does with the settings (json into summary.json) used to take it past 4 GB."""

import resource
import subprocess
import sys

import pytest
from testing_utils import PROFILES, REPO

from hf_zero.core.errors import UserError
from hf_zero.core.yaml_safe import MAX_VALUES, load_yaml
from hf_zero.plan.parse import load_yaml_config
from hf_zero.plan.profiles import load_profile


def _laughs(indent: str, levels: int = 9) -> str:
    """l0 holds 9 values, each level 9 aliases of the one before: 9**9 (387 million) values once expanded."""
    lines = [f"{indent}l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"{indent}l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.fixture
def bomb(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("model_name_or_path: tiny-llama\nlr_scheduler_kwargs:\n" + _laughs("  "))
    assert len(path.read_text()) < 1300
    return path


def test_a_recipe_with_nested_aliases_is_refused_in_one_line(bomb):
    with pytest.raises(UserError) as err:
        load_yaml_config(str(bomb))
    assert err.value.line() == (f"--config {bomb}: holds aliases that expand to more than {MAX_VALUES:,} values "
                                "(nested YAML anchors and aliases); write the values out instead of aliasing them")


def test_plain_aliases_load_and_a_self_containing_one_is_refused():
    assert load_yaml("a: &x {lr: 1}\nb: *x\n", "f") == {"a": {"lr": 1}, "b": {"lr": 1}}
    assert load_yaml("", "f") is None
    with pytest.raises(UserError, match="an alias that contains itself"):
        load_yaml("a: &x [1, *x]\n", "f")
    # six levels (531,441 values): loaded instantly by yaml.safe_load, 31 MB once written into summary.json
    with pytest.raises(UserError, match="more than"):
        load_yaml("k:\n" + _laughs("  ", levels=6), "f")


def test_a_profile_with_nested_aliases_is_refused_naming_it(tmp_path):
    text = (PROFILES / "fsdp2.yaml").read_text().replace("fsdp_config:\n", "fsdp_config:\n  fsdp_extra:\n"
                                                         + _laughs("    "), 1)
    path = tmp_path / "laughs.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_profile(str(path))
    assert err.value.line().startswith("profile laughs.yaml: holds aliases that expand to more than")


def test_the_bomb_under_a_memory_bound_is_one_line(bomb):
    """A child process limited to 1 GiB of address space reads the recipe and writes its settings as a run does."""
    code = ("import json, sys\nfrom hf_zero.core.errors import UserError\n"
            "from hf_zero.plan.parse import load_yaml_config\n"
            "try:\n    print(len(json.dumps(load_yaml_config(sys.argv[1]))))\n"
            "except UserError as err:\n    print('hf-zero: error: ' + err.line())\n")

    def bound():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    proc = subprocess.run([sys.executable, "-c", code, str(bomb)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, preexec_fn=bound)
    assert proc.returncode == 0 and "MemoryError" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"hf-zero: error: --config {bomb}: holds aliases that expand to more than")
