"""Stage input processors: what one stage sends the next for each scheduler output (spec §4)."""
