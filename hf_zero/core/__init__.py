"""What every layer uses: errors, files, the console and the rank, distributed waits, run locks, start-up phases,
the recipe arguments (config.py, multimodal_args.py) and where their values come from (validate.py)."""
