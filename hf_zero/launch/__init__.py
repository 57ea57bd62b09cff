"""From a resolved run to running ranks: the launcher (`hf-zero train`'s process), the `accelerate launch` line,
the worker wrapper of each rank, interrupts, the parent watch and the Slurm script."""
