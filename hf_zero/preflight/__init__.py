"""The checks `hf-zero train` and `hf-zero check` run before any process starts: recipe, data, model, launch."""
