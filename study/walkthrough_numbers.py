"""The walkthrough's numbers: each computed number kept apart from the text of docs/walkthrough.md
(`Doc.num`), printed at 4 significant figures (`fmt`), read back out of a committed copy at the
places the regenerated document has them (`read_numbers`) and compared within its tolerance
(`compare`); and the float32 floors of those tolerances.
"""

import re

# How far float32 rounding alone can move a number of a kind on another CPU, whatever the kernel
# variants measured (tests/rounding.py): the floor of its tolerance. A log-prob is z - logsumexp(z)
# of logits up to ~30, so it is resolved to ~2e-6 (float32's spacing at 30), however close to 0 it
# is; k3 = e^d - 1 - d is resolved to float32's spacing at 1 (1.2e-7); a sum over a sequence adds
# up to ~60 tokens' roundings.
LOGP = 1e-5                            # a token's log-prob, or a difference of two
K3 = 1e-6                              # a token's k3, or a mean of them (a Query-KL)
SEQ = 2e-4                             # a sum of log-probs over a sequence (l(q), s(q), log pi(o|q))
WEIGHT = 1e-4                          # s-bar / s(q), w(q) and A * w (s(q) to ~1e-5 relative)
ROUNDING = 1e-5                        # a relative difference that is rounding only (should be 0)


class Doc:
    """Markdown whose computed numbers are kept apart from its text: `num` records a value (and the
    floor of its tolerance, `atol`) and returns a marker; `text()` prints the markers (`fmt`),
    `skeleton()` replaces them with NUMBER."""
    NUMBER = "\x00#\x00"

    def __init__(self):
        self.lines, self.values, self.atols = [], [], []

    def num(self, x, atol=0.0) -> str:
        self.values.append(float(x))
        self.atols.append(float(atol))
        return f"\x00{len(self.values) - 1}\x00"

    def __call__(self, *lines):
        self.lines.extend(lines)

    def _join(self, fill):
        return re.sub("\x00(\\d+)\x00", lambda m: fill(int(m.group(1))), "\n".join(self.lines) + "\n")

    def in_order(self) -> tuple[list, list]:
        """(values, atols) in the order the numbers appear in the text (an f-string may call num
        for a later number first), each number once."""
        order = [int(i) for i in re.findall("\x00(\\d+)\x00", "\n".join(self.lines))]
        if sorted(order) != list(range(len(self.values))):
            raise ValueError("a number recorded by Doc.num is missing from the text, or used twice")
        return [self.values[i] for i in order], [self.atols[i] for i in order]

    def text(self):
        return self._join(lambda i: fmt(self.values[i]))

    def skeleton(self):
        return self._join(lambda i: self.NUMBER)


def fmt(x) -> str:
    """4 significant figures, trailing zeros kept (they say how precise a number is): 0.5 -> 0.5000,
    1.25e-5 -> 1.250e-5; no "-0"."""
    s = f"{x:#.4g}".replace("e+0", "e+").replace("e-0", "e-").replace(".e", "e")
    s = s[:-1] if s.endswith(".") else s
    return s[1:] if s.startswith("-") and float(s) == 0 else s


NUMBER_RE = r"-?\d+(?:\.\d*)?(?:e[+-]\d+)?"


def read_numbers(skeleton, text) -> list[str] | None:
    """The numbers of `text` at the places `skeleton` marks, or None where the rest differs."""
    pattern = f"({NUMBER_RE})".join(re.escape(part) for part in skeleton.split(Doc.NUMBER))
    m = re.fullmatch(pattern, text, re.DOTALL)
    return None if m is None else list(m.groups())


def last_digit(s) -> float:
    """One unit of the last printed digit of a number string ("1.250e-5" -> 1e-8)."""
    mant, _, exp = s.partition("e")
    decimals = len(mant.split(".")[1]) if "." in mant else 0
    return 10.0 ** (int(exp or 0) - decimals)


def compare(skeleton, committed, fresh, tolerances) -> list[str]:
    """Where a committed copy of the document differs from a fresh one (same skeleton): its text, or
    a number by more than its tolerance plus half a unit of the last digit each printed."""
    ours, theirs = read_numbers(skeleton, committed), read_numbers(skeleton, fresh)
    if ours is None or theirs is None:
        return ["the text differs (numbers aside): regenerate it with python -m study.walkthrough"]
    if len(tolerances) != len(ours):
        return [f"{len(tolerances)} tolerances for {len(ours)} numbers: re-measure them "
                "(python -m study.walkthrough --tolerances)"]
    parts, bad = skeleton.split(Doc.NUMBER), []
    for i, (a, b, tol) in enumerate(zip(ours, theirs, tolerances)):
        if abs(float(a) - float(b)) > tol + (last_digit(a) + last_digit(b)) / 2:
            line = "".join(parts[:i + 1]).count("\n") + 1
            bad.append(f"line {line}, number {i}: committed {a}, now {b} (tolerance {tol:.3g})")
    return bad
