"""Generate the Countdown sets (tasks/countdown.py) from one seed.

    python -m data.countdown.prepare            # writes data/countdown/{test,train,sft}.jsonl

A problem gives 3 (sometimes 4) numbers in 1..20 and a target in 1..100 that they reach with
+ - * / and parentheses, each number used exactly once:

    Use the numbers 3, 5 and 2, each exactly once, with + - * / and parentheses to make 16.
    <think>
    3 + 5 = 8
    8 * 2 = 16
    </think>
    The answer is \\boxed{(3 + 5) * 2}.

It is made the way a player solves one: combine two of the numbers into one, again and again,
until one is left; that last value is the target and the moves are the worked solution, one per
line, in the tiny math world's format (so its warm start already knows the layout). Every move
stays a positive integer no larger than 100 (a - b only when a > b, a / b only when b divides a):
the tiny model knows small-number arithmetic only. The scorer is more lenient than the generator
(any rational intermediates); the reference answer is one solution among several.

Splits, all disjoint by problem (the numbers as a multiset and the target: the same numbers in
another order are the same problem); the test set is drawn first:
    test.jsonl   200  (160 with 3 numbers, 40 with 4)   held-out set
    train.jsonl 1000  (800 / 200)                       RL training set
    sft.jsonl   1500  (1200 / 300)                      warm-start corpus (problem + solution)
"level" is the number of moves (numbers - 1), so held-out accuracy is also logged per level.
Every row has every field (~300 bytes), so the three files stay under 1 MB together; a warm
start on 3,000 rows reached the same accuracy as on these 1,500 in 500 steps (18.9% / 18.2%).

The tiny math model scores 0% here; a warm start of ~6 minutes on 2 CPU cores takes it to ~21%
(T = 1.0, 4 samples per test problem; 26% with 3 numbers, 1% with 4):

    python train.py --algo sft --model data/tinymath/warmstart --sft-data data/countdown/sft.jsonl \
        --sft-steps 500 --sft-warmup 20 --eval-every 0 --out runs/countdown-sft --export <folder>
"""

import argparse
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
NUMBER_RANGE = (1, 20)       # the given numbers
CAP = 100                    # largest value of any move, the target included
# split name -> [(rows, how many numbers)]. Order matters: the test set first.
SPLITS = {
    "test": [(160, 3), (40, 4)],
    "train": [(800, 3), (200, 4)],
    "sft": [(1200, 3), (300, 4)],
}
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


def _moves(a: int, b: int) -> list[tuple[str, int]]:
    """The moves a op b that keep a positive integer <= CAP."""
    out = [("+", a + b), ("-", a - b), ("*", a * b)]
    out = [(op, r) for op, r in out if 0 < r <= CAP]
    return out + ([("/", a // b)] if a % b == 0 else [])


def _text(item: tuple, op: str, right: bool) -> str:
    """An operand's text inside `op`, in parentheses only where precedence needs them."""
    _, text, prec = item
    need = prec < _PREC[op] or right and prec == _PREC[op] and op in "-/"
    return f"({text})" if need else text


def _combine(rng: random.Random, numbers: list[int]):
    """Combine random pairs until one value is left -> (value, expression, move lines), or None
    when some pair has no move (the caller draws again)."""
    pool = [(n, str(n), _ATOM) for n in numbers]    # (value, expression text, its precedence)
    lines = []
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)      # ordered: a - b and a / b need the order
        a, b = pool[i], pool[j]
        moves = _moves(a[0], b[0])
        if not moves:
            return None
        op, r = rng.choice(moves)
        if op in "+*" and b[2] != _ATOM and a[2] == _ATOM:
            a, b = b, a       # carry the running result first ("8 * 2", not "2 * 8"): one habit to learn
        lines.append(f"{a[0]} {op} {b[0]} = {r}")
        pool = [p for k, p in enumerate(pool) if k not in (i, j)]
        pool.append((r, f"{_text(a, op, False)} {op} {_text(b, op, True)}", _PREC[op]))
    return pool[0][0], pool[0][1], lines


def problem_text(numbers: list[int], target: int) -> str:
    listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    return (f"Use the numbers {listed}, each exactly once, with + - * / and parentheses "
            f"to make {target}.")


def make_problem(rng: random.Random, n_numbers: int) -> dict:
    """One problem with `n_numbers` numbers: problem, answer (a reference expression), numbers,
    target, solution (the moves, then the boxed expression) and level (the number of moves)."""
    lo, hi = NUMBER_RANGE
    while True:
        numbers = [rng.randint(lo, hi) for _ in range(n_numbers)]
        made = _combine(rng, numbers)
        if made is not None:
            break
    target, expr, lines = made
    solution = "<think>\n" + "\n".join(lines) + "\n</think>\nThe answer is \\boxed{" + expr + "}."
    return {"problem": problem_text(numbers, target), "answer": expr, "numbers": numbers,
            "target": target, "solution": solution, "level": n_numbers - 1}


def problem_key(row: dict) -> tuple:
    """What makes two problems the same: the numbers as a multiset, and the target."""
    return tuple(sorted(row["numbers"])), row["target"]


def generate_splits(seed: int) -> dict[str, list[dict]]:
    """Every split as a list of rows, deterministically from `seed`; no problem in two splits."""
    rng = random.Random(seed)
    seen, out = set(), {}
    for name, parts in SPLITS.items():
        rows = []
        for size, n_numbers in parts:
            made = 0
            while made < size:
                row = make_problem(rng, n_numbers)
                if problem_key(row) in seen:
                    continue
                seen.add(problem_key(row))
                rows.append({"id": f"countdown-{name}-{len(rows)}", **row})
                made += 1
        out[name] = rows
    return out


def to_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=HERE, help="folder for the JSONL splits (default: here)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, rows in generate_splits(args.seed).items():
        path = os.path.join(args.out, f"{name}.jsonl")
        with open(path, "w") as f:
            f.write(to_jsonl(rows))
        print(f"{name:5s} {len(rows):5d} problems -> {path}")


if __name__ == "__main__":
    main()
