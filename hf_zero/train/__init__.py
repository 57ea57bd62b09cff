"""The model, the Trainer subclass and what happens around each step."""
