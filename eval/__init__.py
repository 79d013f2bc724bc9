"""Evaluation: how much accuracy compression cost and what it bought in size and speed.

The `evaluate` stage (stage.py) scores the current model: perplexity and KL to the original
model (perplexity.py, kl.py; offloaded.py for a checkpoint larger than memory), zero-shot tasks
(zeroshot.py with the bundled tasks/; harness.py and harness_model.py bridge
lm-evaluation-harness), size (size.py) and speed (speed.py, bandwidth.py). report.py and
plots.py write a run's report; compare.py is `slimlm compare`.
"""
