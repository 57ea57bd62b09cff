"""The run resolved once: profiles, recipe YAML + flags, one owner per setting, the world size and the
RunPlan every rank reads."""
