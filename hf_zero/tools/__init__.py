"""The other commands: check, preview, generate."""
