"""The one room where hf_zero reaches into the libraries under it: every read or write of a library's private name
and every runtime patch of a library object lives here, behind a named function the rest of hf_zero calls.

registry.py is the room's index: each entry says what it changes, why no public API does, the versions it was
checked against, and when it can go. tests/test_library_internals.py fails on any such reach outside this folder
(except the ones still listed there as not yet moved) and on any entry without its reason, versions or end.
One module per library: torch.py, transformers.py, accelerate.py, deepspeed.py, trl.py, peft.py, bitsandbytes.py,
gguf.py, huggingface_hub.py, parsers.py (argparse, as transformers and accelerate build it), and lean_import.py
(TrainingArguments and the Trainer without peft). Nothing here imports another hf_zero module: it sits in core's
layer (tests/test_layers.py), and a patch that needs hf_zero's own code is handed it (check_dcp_metadata_first).
"""
