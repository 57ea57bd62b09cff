"""Memory before launch (`hf-zero estimate`), and what the ranks really held (measured)."""
