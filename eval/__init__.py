"""Evaluation: how much accuracy compression cost and what it bought in size and speed."""
