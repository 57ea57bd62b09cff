"""The checks `hf-zero train` and `hf-zero check` run before any process starts (recipe, data, model, launch), and
the cheap ones the ranks run again before the engine is built (at_start.py)."""
