"""What every layer uses: errors, files, console, waits, profiles, recipe arguments and their reconciliation."""
