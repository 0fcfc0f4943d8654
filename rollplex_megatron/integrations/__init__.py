"""Rollplex inside other frameworks: `verl/` (an engine and a trainer registered through verl's plugin seams)."""
