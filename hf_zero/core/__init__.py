"""What every layer uses, loading no transformers: errors, files, the console and the rank, distributed waits, run
locks, start-up phases, a curriculum stage's fields (config.py) and where recipe values come from (validate.py).
The recipes' argument classes (TrainingArguments subclasses) live above, in plan/arguments.py."""
