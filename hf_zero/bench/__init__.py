"""`hf-zero bench`: DDP vs ZeRO vs FSDP2 on the same training, and the one-GPU speed table."""
