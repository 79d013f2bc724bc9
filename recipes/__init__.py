"""Recipes (installed as slimlm.recipe; each YAML file becomes an option of the recipe group)."""
