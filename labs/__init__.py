"""The lab: GRPO and ERPO built from unit-tested pieces, one traced step whose PPO clip shows, and a
GRPO-vs-ERPO pair of short runs that ends on the drift plot. The teacher's page: docs/teaching.md.

    labs/exercises.py      the functions a student writes (stubs)
    labs/grade.py          their grading tests:  python -m pytest labs/grade.py [--impl repo]
    labs/notebook.py       one ERPO step traced, two optimizer steps on one rollout (cells: # %%)
    labs/drift_pair.py     python -m labs.drift_pair: grpo and erpo side by side, Query-KL per step
    labs/reweighting.py    python -m labs.reweighting: each estimator's per-prompt weight vs p, and w(q)
"""
