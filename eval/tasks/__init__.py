"""Bundled zero-shot task definitions (YAML), loaded by slimlm.eval.zeroshot.load_task."""
