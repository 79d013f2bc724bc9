"""slimlm: compress and distill language models, then run them on small hardware."""

__version__ = "0.1.0"
