"""Distillation: the `distill` stage, which trains the run's current model (the student) to match
a teacher, by default the run's original model.

stage.py: the stage and its parameters; train.py: the training loop on `accelerate`, with
checkpoints a rerun resumes from; losses.py: the divergences between teacher and student;
teacher.py: the teacher's signal, online or its top-k log-probs cached on disk; data.py: the
training windows and the order they are visited in; draft.py: the student measured as a
speculative-decoding draft for its teacher.
"""
