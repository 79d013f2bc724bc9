"""Data bundled with slimlm so the demo needs nothing else (see README.md here)."""
