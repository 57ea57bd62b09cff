"""From a command line to running ranks: `hf-zero train`/`profiles`, the launcher, the worker wrapper, Slurm."""
