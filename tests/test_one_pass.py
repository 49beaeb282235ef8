"""The sampler's tokens pinned: seeded rows of the tiny warm-start model (data/tinymath/warmstart), G
copies of prompts long and short, decoded with a --kv-budget that holds fewer rows than the call
has, must give the tokens recorded in tests/golden/sampler_tokens.json, and each row decoded alone
(batch 1) the same tokens. Recorded before the sampler became one pass per rank (#32): however the
rows are scheduled, a seeded row's tokens depend only on its seed and the model.

    python -m tests.test_one_pass record   # rewrites tests/golden/sampler_tokens.json
"""

import json
import os
import sys

import pytest
import torch

import models
import rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
GOLDEN = os.path.join(ROOT, "tests", "golden", "sampler_tokens.json")
PROBLEMS = [  # short and long prompts, so slots hold rows of different prompt lengths
    "How many?",
    "Mia has 23 apples. How many apples does Mia have now?",
    "Leo owns 36 buttons. Leo gives 19 buttons to Zoe. The number of buttons that Leo has becomes 4 times "
    "as large. How many buttons does Leo have in the end?",
    "Tom owns 46 coins. How many coins does Tom have now?",
    "Omar owns 24 cookies. Omar gives 8 cookies to Ana. Omar finds 7 more cookies. Omar gives 15 cookies "
    "to Ana. The number of cookies that Omar has becomes 3 times as large. How many cookies does Omar have now?",
    "Zoe has 4 boxes of 12 pens each.",
]
G, NEW, SLOTS = 4, 48, 5
SETTINGS = {"t1": dict(temperature=1.0, top_p=1.0), "t07_p09": dict(temperature=0.7, top_p=0.9)}


@pytest.fixture(scope="module")
def warm():
    return models.load_policy(WARM)


def golden_rows(model, tok):
    """The rows of the golden: each problem's prompt G times (consecutive, as GRPO's groups), one
    seed per row, and the spec that decodes them with room for SLOTS rows in the KV cache."""
    from data.prompts import build_prompt

    prompts = [tok(build_prompt(tok, p, "plain"), add_special_tokens=False).input_ids
               for p in PROBLEMS for _ in range(G)]
    seeds = [rollout.row_seed(32, i) for i in range(len(prompts))]
    spec = rollout.SampleSpec(NEW, rollout.eos_token_ids(model, tok), tok.pad_token_id, "kv", None,
                              kv_budget=SLOTS * (max(map(len, prompts)) + NEW))
    return prompts, seeds, spec


def responses(ro) -> list[list[int]]:
    return [ro.response_ids[i, :n].tolist() for i, n in enumerate(ro.lengths.tolist())]


def sample_golden(model, tok, setting):
    prompts, seeds, spec = golden_rows(model, tok)
    ro = rollout.sample_with(model, prompts, spec, seeds=seeds, **SETTINGS[setting])
    return {"tokens": responses(ro), "finished": ro.finished.tolist()}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_seeded_rows_give_the_recorded_tokens(warm, setting):
    model, tok = warm
    with open(GOLDEN) as f:
        want = json.load(f)[setting]
    got = sample_golden(model, tok, setting)
    assert got == want
    lengths = [len(t) for t in want["tokens"]]
    assert len(set(lengths)) > 3 and min(lengths) <= NEW // 2 and any(not f for f in want["finished"])  # long-tailed
    prompts, seeds, spec = golden_rows(model, tok)
    kw = dict(max_new_tokens=NEW, eos_ids=spec.eos_ids, pad_id=spec.pad_id, **SETTINGS[setting])
    for i in range(len(prompts)):  # batch 1: nothing shared with another row
        alone = rollout.sample(model, [prompts[i]], seeds=[seeds[i]], **kw)
        assert responses(alone)[0] == want["tokens"][i], i


def record():
    torch.set_num_threads(1)
    model, tok = models.load_policy(WARM)
    out = {s: sample_golden(model, tok, s) for s in sorted(SETTINGS)}
    with open(GOLDEN, "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {GOLDEN}:", {s: len(v["tokens"]) for s, v in out.items()}, "rows")


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit("usage: python -m tests.test_one_pass record")
    record()
