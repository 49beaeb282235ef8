"""Evaluation's parts beside evaluate.py: seeded held-out sampling and grading (heldout.py), an
evaluation folder's resume key and records (eval_folder.py)."""
