"""Distillation: teacher-to-student training (arrives with the distillation issue)."""
