"""--plan-lengths' files: the response and prompt lengths a --dry-run's time model plans from
(plumbing/time_model.py), measured --

    an evaluate.py samples.jsonl    each sample's num_tokens
    a run's metrics.jsonl           its steps' response_len and truncated_frac
    a lengths JSON                  time_model's default's form, or the histogram `prompt_histogram`
                                    writes of the data's prompts under a template and tokenizer

-- each read into Lengths, or refused in one line naming the file and what to give.
"""

import hashlib
import json
import os

import math

import numpy as np



def _bad(path, why):
    return SystemExit(f"error: --plan-lengths {path}: {why}")


def read_lengths(path: str, limit: int) -> dict:
    """--plan-lengths: {"response": Lengths} and/or {"prompt": Lengths} measured in `path`:
    - an evaluate.py samples.jsonl: each sample's num_tokens (unfinished samples: cut at the limit)
    - a run's metrics.jsonl: the mean of its steps' response_len and truncated_frac (the limit they
      were cut at: the max_new_tokens of the config.json beside it, else `limit`), fitted as the default
    - a JSON of prompt_histogram ({"prompt": {"histogram": ...}}) or of the default's form
    A file this cannot read stops with a one-line error."""
    if not os.path.isfile(path):
        raise _bad(path, "no such file")
    with open(path) as f:
        text = f.read()
    try:
        whole = json.loads(text)
        records = [whole]
    except json.JSONDecodeError:
        try:
            records = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
        except json.JSONDecodeError as e:
            raise _bad(path, f"not JSON or JSONL ({e.msg}, line {e.lineno})") from None
    if len(records) == 1 and isinstance(records[0], dict) and {"prompt", "response"} & set(records[0]):
        return _from_spec(path, records[0])
    if not records or not all(isinstance(r, dict) for r in records):
        raise _bad(path, "no records (a samples.jsonl, a metrics.jsonl or a lengths JSON)")
    if all("num_tokens" in r for r in records):
        return {"response": _from_samples(path, records, limit)}
    steps = [r for r in records if "response_len" in r]
    if steps:
        return {"response": _from_metrics(path, steps, limit)}
    raise _bad(path, "its records have neither num_tokens (samples.jsonl) nor response_len (metrics.jsonl)")


def _from_samples(path, records, limit) -> "Lengths":
    n = [int(r["num_tokens"]) if r.get("finished", True) else limit for r in records]
    if min(n) < 0:
        raise _bad(path, "a negative num_tokens")
    pmf = np.bincount(np.minimum(n, limit), minlength=limit + 1).astype(np.float64)
    return Lengths(pmf, f"{len(n)} samples of {path} (unfinished ones cut at the limit)", cut=True)


def _from_metrics(path, steps, limit) -> "Lengths":
    config = os.path.join(os.path.dirname(path), "config.json")
    at = limit
    if os.path.isfile(config):
        with open(config) as f:
            at = int(json.load(f).get("max_new_tokens", limit))
    mean = sum(float(r["response_len"]) for r in steps) / len(steps)
    cut = sum(float(r.get("truncated_frac", 0.0)) for r in steps) / len(steps)
    source = f"{path}: {len(steps)} steps' mean {mean:.0f}, {cut:.1%} cut at {at}"
    if not 0 <= cut <= 1 or not 0 < mean <= at:
        raise _bad(path, f"a mean response_len of {mean:g} with truncated_frac {cut:g} is no run's "
                         f"(at --max-new-tokens {at})")
    try:
        return fitted_responses(mean, cut, at, source).cut_at(limit)
    except ValueError:      # too long for the gamma's shape (a tiny world's run, most rows cut at 24)
        source += ", as two points: too long for the fitted shape"
        return two_points(mean, cut, at, source).cut_at(limit)


def two_points(mean, cut, limit, source) -> "Lengths":
    """The responses as the metrics state them and no more: a fraction `cut` at the limit, the rest
    at the length that gives the mean (a fit of shape 2 cannot reach a mean near the limit)."""
    below = (mean - cut * limit) / (1 - cut) if cut < 1 else limit
    pmf = np.zeros(limit + 1)
    pmf[min(limit, max(1, round(below)))] += 1 - cut
    pmf[limit] += cut
    return Lengths(pmf, source, cut=True)


def _from_spec(path, spec) -> dict:
    out = {}
    try:
        if "histogram" in spec.get("prompt", {}):
            h = {int(k): float(v) for k, v in spec["prompt"]["histogram"].items()}
            why = bad_histogram(h)
            if why:
                raise _bad(path, f"its prompt histogram {why}: give the counts of prompts per length "
                                 "(lengths_file.prompt_histogram writes them)")
            pmf = np.zeros(max(h) + 1)
            pmf[list(h)] = list(h.values())
            source = f"histogram of {spec['prompt'].get('data', '?')} ({path})"
            out["prompt"] = Lengths(pmf, source)
        elif "prompt" in spec:
            p = spec["prompt"]
            out["prompt"] = fitted_prompts(p["mean"], p["longest"], p["longest_of"], f"{path}")
        if "response" in spec:
            r = spec["response"]
            out["response"] = fitted_responses(r["mean"], r["truncated"], r["limit"], f"{path}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _bad(path, f"not a lengths JSON ({type(e).__name__}: {e})") from None
    return out


def bad_histogram(h: dict) -> str | None:
    """Why {length: count} is no histogram (a negative or non-finite count, a length below 1, no
    prompt at all), or None. Normalised without this check, negative counts plan negative
    probabilities and all-zero ones nan."""
    if not h or sum(h.values()) <= 0:
        return "counts no prompt"
    for length, count in sorted(h.items()):
        if length < 1:
            return f"has a length of {length} tokens"
        if not count >= 0 or not np.isfinite(count):
            return f"counts {count:g} prompts of {length} tokens"
    return None


def prompt_histogram(tokenizer_dir: str, data: str, template: str, out: str, encode) -> dict:
    """Write the histogram of the prompt lengths of `data` (a JSONL of {"problem": ...} rows) under
    `template`, tokenized by `tokenizer_dir`'s tokenizer, with the data's and tokenizer's sha256, to
    `out` (what --plan-lengths reads). encode: data.prompts.encode_prompts (plumbing may not import it).
    -> what it wrote."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    with open(data) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    counts = np.bincount([len(ids) for ids in encode(tok, rows, template)])
    files = [os.path.join(tokenizer_dir, n) for n in sorted(os.listdir(tokenizer_dir))
             if n.startswith("tokenizer")]
    spec = {"source": f"lengths_file.prompt_histogram of {data}", "prompt": {
        "data": os.path.basename(data), "data_sha256": _sha256([data]), "template": template,
        "tokenizer": tokenizer_dir, "tokenizer_sha256": _sha256(files), "rows": len(rows),
        "mean": float(np.dot(np.arange(len(counts)), counts) / counts.sum()),
        "histogram": {str(n): int(c) for n, c in enumerate(counts) if c}}}
    with open(out, "w") as f:
        json.dump(spec, f, indent=1)
    return spec


def _sha256(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Length distributions

class Lengths:
    """A distribution of token counts: pmf[x] = P(length = x), x = 0 .. len(pmf) - 1; `source` says
    where it comes from (printed beside the estimate)."""

    def __init__(self, pmf, source: str, cut=False):
        pmf = np.asarray(pmf, dtype=np.float64)
        self.pmf, self.source = pmf / pmf.sum(), source
        self.cut = cut                  # the last length's rows were cut there: under a higher limit
        #                                 they run to it (the pessimistic guess)
        self.cdf = np.minimum(np.cumsum(self.pmf), 1.0)

    def mean(self) -> float:
        return float(np.dot(np.arange(len(self.pmf)), self.pmf))

    def sf(self) -> np.ndarray:
        """P(length > x), x = 0 .. len - 1."""
        return np.maximum(1.0 - self.cdf, 0.0)

    def expected_max(self, k: float) -> float:
        """E[the longest of k independent draws] (k may be fractional: an expected count)."""
        return float(np.sum(1.0 - self.cdf[:-1] ** k)) if k > 0 else 0.0

    def top(self, u: float) -> int:
        """The length exceeded by a fraction u of draws: the smallest x with P(length > x) <= u."""
        return int(np.argmax(self.sf() <= u + 1e-12))

    def at_most(self, limit: int, source=None) -> "Lengths":
        """Conditioned on <= limit (longer prompts are dropped: data.prompts.load_prompt_set)."""
        pmf = self.pmf[:limit + 1]
        return Lengths(pmf if pmf.sum() > 0 else _point(limit), source or self.source)

    def cut_at(self, limit: int) -> "Lengths":
        """Responses under a limit: every length >= limit becomes the limit (a row cut there)."""
        pmf = np.zeros(limit + 1)
        n = min(limit, len(self.pmf) - 1 if self.cut else len(self.pmf))
        pmf[:n] = self.pmf[:n]
        pmf[limit] += self.pmf[n:].sum()
        return Lengths(pmf, self.source, cut=True)

    def truncated(self) -> float:
        return float(self.pmf[-1])


def _point(n: int) -> np.ndarray:
    """The pmf of the length n, always (a vector of n + 1: not np.eye's (n + 1)^2 at absurd sizes)."""
    pmf = np.zeros(n + 1)
    pmf[n] = 1.0
    return pmf


def fixed(n: int, source: str) -> Lengths:
    return Lengths(_point(n), source)


def _gamma2(theta: float, limit: int) -> np.ndarray:
    """pmf over 0 .. limit - 1 of a gamma of shape 2 (a skewed, long-tailed length) below the limit."""
    x = np.arange(limit, dtype=np.float64)
    f = x * np.exp(-x / theta)
    return f / f.sum()


def fitted_responses(mean: float, truncated: float, limit: int, source: str) -> Lengths:
    """The responses of a stated mean and fraction cut at `limit`: that fraction at the limit, the
    rest a gamma of shape 2 below it, its scale set so the mean is `mean`. A limit other than the
    one measured: cut rows run to the new limit (pessimistic), longer ones are cut at it."""
    below = (mean - truncated * limit) / max(1e-9, 1 - truncated)
    x = np.arange(limit, dtype=np.float64)
    if not 1 <= below < 0.66 * limit or truncated >= 1:
        raise ValueError(f"{source}: a mean of {mean:g} tokens with {truncated:.1%} cut at {limit} "
                         "fits no length distribution")
    lo, hi = 1e-3, 1e7
    for _ in range(100):                                       # the scale: bisection on the mean
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if np.dot(x, _gamma2(mid, limit)) < below else (lo, mid)
    pmf = np.append(_gamma2(lo, limit) * (1 - truncated), truncated)
    return Lengths(pmf, source, cut=True)


def _lognormal(mu: float, sigma: float, n: int) -> np.ndarray:
    x = np.arange(1, n, dtype=np.float64)
    return np.concatenate([[0.0], np.exp(-(np.log(x) - mu) ** 2 / (2 * sigma ** 2)) / x])


def fitted_prompts(mean: float, longest: float, of: int, source: str, n=8192) -> Lengths:
    """Prompt lengths from two summary statistics: a log-normal of this mean whose longest of `of`
    draws is `longest` on average."""
    def with_mean(sigma):
        lo, hi = -5.0, 12.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if Lengths(_lognormal(mid, sigma, n), "").mean() < mean else (lo, mid)
        return Lengths(_lognormal(lo, sigma, n), source)
    lo, hi = 0.01, 3.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if with_mean(mid).expected_max(of) < longest else (lo, mid)
    return with_mean(lo)
