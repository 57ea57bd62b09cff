"""Where a run's model and data come from (offline cache and assets), and how stage samples are made."""
