"""One module per `hf-zero` subcommand (train, check, estimate, bench, preview, slurm, ...): each gives
`add_arguments(parser)` and `run(args)`, and hf_zero/cli.py imports only the one it runs."""
