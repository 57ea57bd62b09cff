"""`hf-zero train`'s own process (the checks, the offline assets, the run plan, up to accelerate's launch) imports
none of what only the ranks use: the ranks import it anyway, so there it was duplicate start-up work. And a full
fine-tune's rank imports no peft: only a LoRA run's does, as it builds its model."""

import json
import subprocess
import sys

import pytest
from testing_utils import REPO, TINY

from hf_zero.launch.launch_command import prepare_assets

# What the ranks import and the launcher must not: peft (with bitsandbytes and torch's compiler behind it),
# datasets, DeepSpeed, and transformers' model and tokenizer code.
HEAVY = ("peft", "bitsandbytes", "datasets", "deepspeed", "torch._inductor", "transformers.modeling_utils",
         "transformers.trainer", "transformers.models.llama.modeling_llama", "transformers.tokenization_utils_base")

# accelerate's launch_command stood in: what this process has imported when the ranks would start, then exit 0.
_PROBE = """
import json, sys
import accelerate.commands.launch as launch

def stand_in(args):
    json.dump(sorted(sys.modules), open(sys.argv[1], "w"))

launch.launch_command = stand_in
from hf_zero.cli import main
assert main(sys.argv[2:]) == 0
# The same process building a LoRA model afterwards: transformers sees peft, and sees a peft model as one.
import peft, transformers
from transformers import trainer_utils
config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, vocab_size=16)
model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(r=2, target_modules=["q_proj"]))
print("peft model:", trainer_utils._is_peft_model(model), trainer_utils._is_peft_model(model.base_model.model))
"""


@pytest.mark.recipe_run
def test_train_launcher_imports_nothing_the_ranks_import(tmp_path):
    prepare_assets(["--config", str(TINY)])  # built once before (the first run builds them in this process)
    seen = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(seen), "train", "--config", str(TINY), "--profile",
                           "zero2", "--output_dir", str(tmp_path / "out"), "--max_steps", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = set(json.loads(seen.read_text()))
    assert "accelerate.commands.launch" in modules and "hf_zero.preflight.checks" in modules  # it got that far
    assert [m for m in HEAVY if m in modules] == []
    assert "peft model: True False" in proc.stdout


# What a rank of recipes/curriculum.py imports before it builds its model (the recipe's top, then its entry's).
_RANK_PROBE = """
import runpy, sys
runpy.run_path(sys.argv[1], run_name="recipe")
import hf_zero.checkpoint.final, hf_zero.data.stages, hf_zero.train.model, hf_zero.train.run, hf_zero.train.samples
import hf_zero.train.trainer
print("imported:", [m for m in ("peft", "bitsandbytes") if m in sys.modules], "transformers.trainer" in sys.modules)
# A LoRA run's model: peft now, and transformers' checks see its model as a peft model (saving adapters relies on it).
import peft, transformers
from transformers import trainer, trainer_utils
config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, vocab_size=16)
model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(r=2, target_modules=["q_proj"]))
print("peft model:", trainer_utils._is_peft_model(model), isinstance(model, trainer.PeftModel),
      trainer_utils._is_peft_model(model.base_model.model))
"""


@pytest.mark.recipe_run
def test_a_full_fine_tunes_rank_imports_no_peft():
    proc = subprocess.run([sys.executable, "-c", _RANK_PROBE, str(REPO / "recipes" / "curriculum.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported: [] True" in proc.stdout
    assert "peft model: True True False" in proc.stdout
