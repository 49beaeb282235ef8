"""Evaluation's parts beside evaluate.py: seeded held-out sampling and grading (evaluation/heldout.py), an
evaluation folder's resume key and records (evaluation/eval_folder.py)."""
