"""Portus-style memory tier (issue 16): placeholder, the lead writes the public API at merge."""
