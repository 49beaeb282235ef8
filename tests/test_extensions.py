"""The extension points, used as a researcher would: a task, a Query-KL reference (and a
surrogate: tests/test_train.py) registered from outside the repo with the extension pattern's one
call (plumbing/extension.py), with no other file edited, each training a real step of the tiny
model; the live reference against the paper's cache; the Countdown task end to end and a run that
mixes tasks."""

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

from rl import query_reference
import tasks
import train
from plumbing import extension
from tests.rounding import assert_rounding, is_timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def run(out, data, *extra, steps=1):
    argv = ["--model", WARM, "--train-data", data, "--out", str(out), "--steps", str(steps),
            "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4", "--micro-batch", "8",
            "--max-new-tokens", "48", "--eval-every", "0", "--save-every", "0", "--query-cache-dir", "", *extra]
    train.main(argv)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_live_reference_is_the_cache_recomputed(tmp_path, small_data):
    """--qkl-ref live (the released code: the reference model's forward over the step's prompts)
    and the paper's cache are the same initial policy: at step 1 the policy is the reference, so
    Query-KL is ~0, and the whole step (loss, its gradient, the monitors) agrees with the cache's
    to float32 rounding (each within its measured tolerance: tests/rounding.py). Two optimizer
    steps, so the second one's Query-KL is not zero."""
    common = ("--algo", "erpo", "--update-batch", "4", "--dtype", "float32", "--measure-policy-kl", "true")
    cached = run(tmp_path / "cache", small_data, *common, "--qkl-ref", "cache", steps=2)
    live = run(tmp_path / "live", small_data, *common, "--qkl-ref", "live", steps=2)
    for name, m in (("live", live[0]), ("cache", cached[0])):     # ~0: the same weights, other batches
        assert_rounding(f"live_reference.step1_query_kl_{name}", m["query_kl"], 0.0)
    for c, v in zip(cached, live):
        assert v["reward"] == c["reward"]                               # the same tokens sampled
        for key in ("loss", "grad_norm", "loss_query_kl", "query_kl", "policy_kl", "entropy"):
            assert_rounding(f"live_reference.{key}", v[key], c[key])
    assert live[1]["loss_query_kl"] > 0                                 # the policy moved after step 1
    for key in ("prompt_kl", "response_kl", "all_kl"):                  # the released code's monitors
        assert key in live[1] and live[1][key] >= 0


def test_a_reference_registered_from_outside_trains_and_resumes(tmp_path, small_data, outside):
    """A new Query-KL reference is a class and one row of query_reference.REFERENCES, added with the
    pattern's one call (REFERENCE below, imported from a file outside the repo): --qkl-ref picks it, its
    state goes into the checkpoint's one slot and comes back on --resume, and the query_kl monitor
    still measures the drift from the initial policy."""
    EmaReference = own_module(tmp_path, "ema_module", REFERENCE).EmaReference
    try:
        out = tmp_path / "ema"
        ms = run(out, small_data, "--algo", "erpo", "--qkl-ref", "ema-outside", "--save-every", "1", steps=1)
        assert math.isfinite(ms[-1]["loss"])
        assert_rounding("extensions.ema_step1_query_kl", ms[-1]["query_kl"], 0.0)   # still pi_0 at step 1
        state = torch.load(os.path.join(out, "ckpt", "state.pt"), weights_only=False)
        saved = state["extra"]["query_reference"]
        assert len(saved["avg"]) == 8                                   # the step's 8 prompts
        EmaReference.loaded.clear()
        ms = run(out, small_data, "--resume", "--steps", "2")
        assert ms[-1]["step"] == 2 and math.isfinite(ms[-1]["loss"])
        assert [set(s["avg"]) for s in EmaReference.loaded] == [set(saved["avg"])]
    finally:
        extension.unregister(query_reference.REFERENCES, "ema-outside")
    with pytest.raises(SystemExit):                                     # unregistered: an argparse error
        train.main(["--qkl-ref", "ema-outside", "--out", str(tmp_path / "x")])


def test_a_task_registered_from_outside_scores_whole_rows(tmp_path):
    """A new task is a Task and its registration (the pattern's one call): --task picks it, its rows'
    own fields reach the scorer (training and the held-out evaluation), and its accuracy is what
    train_acc reports."""
    seen = []

    def score(completion, row):                     # reward: the completion names the row's color
        seen.append(row["color"])
        ok = row["color"] in completion
        return tasks.Scored(float(ok), "correct" if ok else "wrong")

    def read_row(row, where):
        if not isinstance(row.get("color"), str):
            raise tasks.task.DataError(f"{where}: a color row needs a 'color' string")
        return row
    data = tmp_path / "colors.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "problem": f"Name a color, number {i}.", "answer": "x",
                                        "color": c}) + "\n" for i, c in enumerate(["red", "blue"] * 8)))
    held = tmp_path / "held.jsonl"                  # (held out: not the training problems)
    held.write_text(data.read_text().replace("Name a color, number", "Name a color, held-out number"))
    extension.register(tasks.TASKS, "color", tasks.Task("color", "name a color", score, read_row))
    try:
        ms = run(tmp_path / "run", str(data), "--task", "color", "--algo", "grpo", "--eval-data", str(held),
                 "--eval-every", "1", "--eval-limit", "4")
        assert set(seen) == {"red", "blue"} and len(seen) == 8 * 4 + 2 * 4   # 8 prompts x G; 4 held-out
                                                                             # rows at step 0 and step 1
        assert ms[-1]["train_acc"] == 0 and "eval_acc" in ms[-1]         # the tiny math model names none
        data.write_text(json.dumps({"id": "0", "problem": "Name a color.", "answer": "x"}) + "\n")
        with pytest.raises(SystemExit, match="color"):                  # its row check: one line
            run(tmp_path / "bad", str(data), "--task", "color", "--overwrite")
    finally:
        extension.unregister(tasks.TASKS, "color")


def own_module(tmp_path, name, text):
    """A module of one's own, outside the repo: written to tmp_path and imported from that file."""
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FOLDER_REFERENCE = '''"""A Query-KL reference kept outside the repo: the training prompts' log-probs under
the model in FOLDER (a stronger model, an earlier checkpoint), scored once when the run starts."""
from modeling import models
from rl import query_reference

FOLDER = {folder!r}


class FolderReference(query_reference.TableReference):
    doc = "the prompts' log-probs under the model in FOLDER"
    needs = frozenset({{"prompt_ids"}})      # its Context: the training prompts, tokenizer, device
    scored = []

    @classmethod
    def build(cls, ctx):
        device, prompts = ctx.need("dist").device, ctx.need("prompt_ids")
        model, _ = models.load_policy(FOLDER, device=device)
        logp = query_reference.build(model.eval(), prompts, ctx.need("tokenizer").pad_token_id,
                                     ctx.args.temperature, device)
        cls.scored.append(len(logp))
        return cls(logp, ctx)
'''


def test_a_reference_from_another_model_folder_defined_outside_the_repo(tmp_path, small_data, other_model):
    """A reference of one's own, in a module of one's own (written here to tmp_path), registered with
    the pattern's one call and nothing else: the prompts scored once by another model folder, far
    from the policy at step 1 (Query-KL > 0), while the query_kl monitor stays on pi_0 (~0: the same
    weights in two forwards of other shapes, float32 rounding apart)."""
    mine = own_module(tmp_path, "folder_reference", FOLDER_REFERENCE.format(folder=other_model))
    extension.register(query_reference.REFERENCES, "mine", mine.FolderReference)
    try:
        (m,) = run(tmp_path / "run", small_data, "--algo", "erpo", "--qkl-ref", "mine")
    finally:
        extension.unregister(query_reference.REFERENCES, "mine")
    assert mine.FolderReference.scored == [64] and math.isfinite(m["loss"])   # every training prompt, once
    assert m["loss_query_kl"] > 0.01
    assert_rounding("folder_reference.step1_query_kl", m["query_kl"], 0.0)
    assert "mine" not in query_reference.REFERENCES


SCALED_TASK = '''"""A per-task reward scale, kept outside the repo: a task whose rows are graded by another
task, every reward times a factor (the outcome, so the accuracy, stays the other task's)."""
import dataclasses

import tasks


def scaled(base, factor, name):
    inner = tasks.get(base)

    def rescale(s):
        return tasks.Scored(factor * s.reward, s.outcome)

    def score(completion, row):
        return rescale(inner.score(completion, row))

    def score_batch(completions, rows, timeout):
        got, extra = inner.score_batch(completions, rows, timeout)
        return [rescale(s) for s in got], extra

    return dataclasses.replace(inner, name=name, doc=f"{base}'s rewards x {factor}", score=score,
                               score_batch=score_batch if inner.score_batch else None,
                               datasets={}, train_data=None, heldout=())     # its sets stay the base's
'''


def test_a_task_from_outside_scales_another_tasks_rewards(tmp_path, small_data):
    """A task of one's own (a module written to tmp_path), built from the math task with a factor
    (a constructor argument) and registered with the pattern's one call: the same samples as a math
    run (the first step's sampling does not depend on rewards), graded the same, each reward halved
    in metrics.jsonl."""
    mine = own_module(tmp_path, "scaled_task", SCALED_TASK)
    extension.register(tasks.TASKS, "half-math", mine.scaled("math", 0.5, "half-math"))
    try:
        (half,) = run(tmp_path / "half", small_data, "--task", "half-math", "--algo", "grpo")
    finally:
        extension.unregister(tasks.TASKS, "half-math")
    (full,) = run(tmp_path / "full", small_data, "--task", "math", "--algo", "grpo")
    assert full["reward"] > 0 and half["reward"] == 0.5 * full["reward"]      # (0/1 means: exact)
    assert half["train_acc"] == full["train_acc"] and "half-math" not in tasks.TASKS


def test_countdown_is_graded_by_its_own_scorer():
    """A Countdown row carries a numeric answer the math grader would accept; its task grades the
    expression: boxing only the target scores 0, a correct expression 1."""
    row = tasks.load_rows([{"id": "0", "problem": "Use 3, 5 and 2 to make 16.", "answer": "(3 + 5) * 2",
                            "numbers": [3, 5, 2], "target": 16}], "x.jsonl", "countdown-test", "math")[0]
    rewards, correct, counts = tasks.score_rows(["\\boxed{16}", "\\boxed{(3 + 5) * 2}"], [row, row])
    assert rewards == [0.0, 1.0] and correct == [False, True] and counts["total/countdown"] == 2
    math_only = tasks.score_rows(["\\boxed{16}"], [{**row, "task": "math", "answer": "16"}])[1]
    assert math_only == [True]                                          # what the math grader would say
    test_file = tasks.get("countdown").datasets["countdown-test"]      # its file, by path, is its own too
    assert tasks.owner(test_file).name == "countdown" and tasks.owner("tiny-test").name == "math"
    assert tasks.owner(os.path.join(ROOT, "data", "tinymath", "test.jsonl")) is None


def test_countdown_trains_end_to_end_and_a_mixed_run_reports_each_task(tmp_path, small_data):
    """--task countdown: its own training and held-out sets, graded by its scorer; a training file
    whose rows name their tasks mixes them, with train_acc per task."""
    ms = run(tmp_path / "cd", tasks.get("countdown").train_data, "--task", "countdown", "--eval-every", "1",
             "--eval-limit", "8", "--eval-data", "countdown-test", "--no-signal", "step")  # the math warm
    # start scores 0 on Countdown: no group has a signal, so by default no optimizer step would run
    assert "eval_acc/countdown-test" in ms[-1] and math.isfinite(ms[-1]["loss"])
    mixed = tmp_path / "mixed.jsonl"
    with open(small_data) as f, open(tasks.get("countdown").datasets["countdown-train"]) as g:
        rows = [json.loads(next(f)) for _ in range(8)] + [{**json.loads(next(g)), "task": "countdown"}
                                                          for _ in range(8)]
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ms = run(tmp_path / "mixed", str(mixed), "--rollout-batch", "16", "--update-batch", "8")
    assert {"train_acc/math", "train_acc/countdown"} <= set(ms[-1])


def test_the_released_recipe_is_a_config_that_fits_its_gpus():
    """configs/released_qwen25_7b.json (the released code's recipe: Qwen2.5-7B base, live Query-KL
    reference, code weights, 128 x 8 rollouts, one optimizer step each, 16 GPUs) parses, divides
    over its 16 GPUs, and its memory plan, which counts the live reference's forward, fits an 80 GB
    GPU. (README: the plan beside its fake-tensor measurement, from --dry-run.)"""
    from plumbing import batching, memory_plan

    a, algo = train.parse_args(["--config", os.path.join(ROOT, "configs", "released_qwen25_7b.json")])
    assert (a.qkl_ref, algo.weights, algo.agg, a.update_batch, a.plan_gpus) == \
        ("live", "code", "seq-mean-token-mean", a.rollout_batch, 16)
    batching.check(a, a.plan_gpus)
    assert train.needs_reference_model(a, algo)
    plan = memory_plan.phases(memory_plan.arch_for(a.model), a, a.plan_gpus, True, "cuda")
    assert max(plan.values()) / memory_plan.GIB <= 74.5                 # an 80 GB (74.5 GiB) card


# ----------------------------------------------------------------------------------------------
# An advantage and a per-step coefficient rule, each written as a new module by the test, imported
# and registered with one call (plumbing.extension.register), training the tiny model; no repo module
# is monkeypatched and train.py is not edited.

PASSK_LIKE = '''
"""A pass@k-like advantage with a knob: R_i - the group's pass@k estimate 1 - C(G - c, k) / C(G, k)."""
import math

import losses

SEEN = []


def advantages(x):
    k = x.options["toy_k"]
    SEEN.append(k)
    G = x.rewards.shape[1]
    c = x.rewards.sum(dim=1, keepdim=True).long()
    fail = [math.comb(G - j, k) / math.comb(G, k) for j in range(G + 1)]
    baseline = 1.0 - x.rewards.new_tensor(fail)[c]
    return x.rewards - baseline


ROW = losses.AdvantageRow(advantages, "R - the group's pass@k estimate", OPTIONS=(
    ("toy_k", 2, "--adv toy-passk: k", ">=1"),))
'''

ENTROPY_RULE = '''
"""An adaptive entropy coefficient: +step below the target entropy, -step above, never below 0."""


class Rule:
    doc = "a toy adaptive entropy coefficient (--toy-target > 0)"
    OPTIONS = [("toy_target", 0.0, "target entropy (0 = off)", ">=0"), ("toy_step", 0.02, "change per step", ">0")]
    knob = "entropy_coef"
    loaded = []

    def __init__(self, options, algo):
        self.target, self.step, self.coef = options["toy_target"], options["toy_step"], algo.entropy_coef

    @staticmethod
    def is_on(options):
        return options["toy_target"] > 0

    def value(self):
        return self.coef

    def after_step(self, metrics):
        self.coef = max(0.0, self.coef + (self.step if metrics["entropy"] < self.target else -self.step))

    def state_dict(self):
        return {"coef": self.coef}

    def load_state_dict(self, state):
        Rule.loaded.append(dict(state))
        self.coef = state["coef"]
'''


def test_an_advantage_with_a_knob_written_outside_trains(tmp_path, small_data):
    import losses
    from plumbing import extension

    mine = own_module(tmp_path, "toy_passk", PASSK_LIKE)
    extension.register(losses.ADVANTAGES, "toy-passk", mine.ROW)
    try:
        ms = run(tmp_path / "run", small_data, "--algo", "grpo", "--adv", "toy-passk", "--toy-k", "3",
                 "--no-signal", "step")
        assert ms[-1]["step"] == 1 and math.isfinite(ms[-1]["loss"]) and ms[-1]["grad_norm"] > 0
        assert mine.SEEN and set(mine.SEEN) == {3}                       # its knob reached it
        with pytest.raises(SystemExit):                                  # inert for another --adv
            train.parse_args(["--adv", "grpo", "--toy-k", "3", "--out", str(tmp_path / "x")])
    finally:
        extension.unregister(losses.ADVANTAGES, "toy-passk")
    with pytest.raises(SystemExit):                                      # unregistered: unknown
        train.parse_args(["--adv", "toy-passk", "--out", str(tmp_path / "x")])


def test_a_coefficient_rule_written_outside_steers_and_resumes(tmp_path, small_data):
    from plumbing import extension
    from rl import controllers

    mine = own_module(tmp_path, "toy_entropy", ENTROPY_RULE)
    extension.register(controllers.CONTROLLERS, "toy-entropy", mine.Rule)
    try:
        flags = ("--algo", "grpo", "--toy-target", "100", "--no-signal", "step")
        full = run(tmp_path / "full", small_data, *flags, steps=2)
        assert [m["entropy_coef"] for m in full] == [0.0, 0.02]          # below the target: it rises
        assert full[1]["entropy_bonus"] > 0
        run(tmp_path / "cut", small_data, *flags, "--save-every", "1", steps=1)
        saved = torch.load(os.path.join(tmp_path / "cut", "ckpt", "state.pt"), weights_only=False)["extra"]
        assert saved["controllers"] == {"toy-entropy": {"coef": 0.02}}
        resumed = run(tmp_path / "cut", small_data, "--resume", "--steps", "2")
        assert mine.Rule.loaded == [{"coef": 0.02}]
        assert [m["entropy_coef"] for m in resumed] == [m["entropy_coef"] for m in full]
        assert [m["reward"] for m in resumed] == [m["reward"] for m in full]
        with pytest.raises(SystemExit):                                  # its option, with the rule off
            train.parse_args(["--toy-step", "0.1", "--out", str(tmp_path / "x")])
    finally:
        extension.unregister(controllers.CONTROLLERS, "toy-entropy")


# ----------------------------------------------------------------------------------------------
# --extensions: the changes a researcher makes next, each a module written outside the repo and loaded
# by the option on the command line (config.json records it; --resume imports it again unasked). No repo
# file is edited and nothing is monkeypatched: the module registers its rows with the pattern's call.

@pytest.fixture
def outside():
    """Puts back the tables an extension module adds rows to, and forgets the modules, after a test."""
    import losses
    from data import prompts
    from rl import experience
    tables = (losses.KL_ESTIMATORS, experience.SHAPING, tasks.TASKS, prompts.TEMPLATES, query_reference.REFERENCES)
    before = [dict(t) for t in tables]
    yield
    for t, b in zip(tables, before):
        t.clear(), t.update(b)
    for key in [k for k in sys.modules if k.startswith("erpo_extension_")]:
        del sys.modules[key]


def module_file(folder, name, text) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(text)
    return str(path)


def loaded(name):
    """The extension module loaded from a file `name`.py (plumbing/extension.load)."""
    return next(m for k, m in sys.modules.items() if k.startswith("erpo_extension_") and k.endswith(f"_{name}_py"))


def resumed_exactly(tmp_path, *argv, steps=2) -> list[dict]:
    """The run of `steps` steps, beside the same run stopped after one step less and resumed with a
    plain --resume (no --extensions: config.json names them): every metric equal but the timings (and
    the evaluation a run makes at its last step, which the stopped one made a step early)."""
    def train_to(out, n, *more):
        train.main(["--model", WARM, "--out", str(out), "--steps", str(n), "--rollout-batch", "8",
                    "--update-batch", "4", "--group-size", "4", "--micro-batch", "8", "--eval-every", "0",
                    "--save-every", "1", "--query-cache-dir", "", *more])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]
    whole = train_to(tmp_path / "whole", steps, *argv)
    train_to(tmp_path / "cut", steps - 1, *argv)
    train.main(["--out", str(tmp_path / "cut"), "--resume", "--steps", str(steps)])   # names no extension
    with open(tmp_path / "cut" / "metrics.jsonl") as f:
        resumed = [json.loads(line) for line in f]

    def kept(m):
        return {k: v for k, v in m.items() if not is_timing(k) and not (m["step"] == steps - 1 and
                                                                         k.startswith("eval_"))}
    assert [kept(m) for m in whole] == [kept(m) for m in resumed]
    return whole


KL_ESTIMATOR = '''"""A KL estimator of one's own: half of k2, counting its calls."""
import losses
from plumbing import extension

calls = []


def half_k2(log_r):
    """(log r)^2 / 4: k2 / 2."""
    calls.append(log_r.numel())
    return 0.25 * log_r.square()


extension.register(losses.KL_ESTIMATORS, "half-k2", half_k2, replace=True)
'''


def test_a_kl_estimator_from_outside_trains_and_resumes_exactly(tmp_path, small_data, outside):
    """losses.KL_ESTIMATORS is a table: a new estimator is a function of log r, a choice of --kl and
    --qkl-estimator once its module is loaded."""
    path = module_file(tmp_path / "mine", "half_k2", KL_ESTIMATOR)
    ms = resumed_exactly(tmp_path, "--train-data", small_data, "--max-new-tokens", "48", "--algo", "erpo",
                         "--qkl-estimator", "half-k2", "--extensions", path)
    assert loaded("half_k2").calls and ms[-1]["loss_query_kl"] > 0      # the loss's Query-KL: its estimate
    with open(tmp_path / "whole" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["extensions"] == [path] and cfg["qkl_estimator"] == "half-k2"


SHAPING = '''"""A reward-shaping term of one's own: a length penalty, logging its mean."""
from plumbing import extension
from rl import experience


def brevity(graded, run):
    """-1e-3 per response token."""
    penalty = 1e-3 * graded.ro.response_mask.sum(1).float()
    return graded.rewards - penalty, {"brevity": penalty.mean().item()}


extension.register(experience.SHAPING, "brevity", brevity, replace=True)
'''


def test_a_reward_shaping_term_from_outside_logs_its_metric_and_resumes_exactly(tmp_path, small_data, outside,
                                                                                 capsys):
    """rl/experience.SHAPING: a term sees the graded rollout (the responses' lengths here), returns the
    rewards the advantages use and metrics that reach the step's line (shaping/<name>)."""
    path = module_file(tmp_path / "mine", "brevity", SHAPING)
    ms = resumed_exactly(tmp_path, "--train-data", small_data, "--max-new-tokens", "48", "--algo", "grpo",
                         "--shaping", "brevity", "--extensions", path)
    for m in ms:
        assert m["shaping/brevity"] == pytest.approx(1e-3 * m["response_len"], rel=1e-5)
        assert m["reward"] == pytest.approx(m["train_acc"] - m["shaping/brevity"], abs=1e-6)
    with pytest.raises(SystemExit):                                     # an unknown row: one line
        run(tmp_path / "bad", small_data, "--shaping", "nope")
    assert "--shaping nope: no such row" in capsys.readouterr().err


TASK = '''"""A task of one's own: the tiny math world asked under a template and a length of its own."""
import dataclasses
import os

from data import prompts
import tasks
from plumbing import extension

HERE = os.path.dirname(os.path.abspath(__file__))
extension.register(prompts.TEMPLATES, "question", "Question: {problem}", replace=True)
tasks.register(dataclasses.replace(
    tasks.get("math"), name="math-q", doc="tiny math asked as a question, in 40 tokens",
    datasets={"math-q-train": os.path.join(HERE, "train.jsonl"), "math-q-test": os.path.join(HERE, "test.jsonl")},
    train_data="math-q-train", heldout=("math-q-test",), max_new_tokens=40, template="question"))
'''


def test_a_task_from_outside_brings_its_template_and_lengths_to_training_and_evaluation(tmp_path, outside):
    """A task carries its prompt template and response length: --task picks them up in train.py (its
    sets too) and in evaluate.py, which loads the same module with --extensions."""
    import evaluate
    mine = tmp_path / "mine"
    path = module_file(mine, "math_q", TASK)
    for name, n in (("train", 64), ("test", 8)):
        with open(os.path.join(ROOT, "data", "tinymath", f"{name}.jsonl")) as f:
            (mine / f"{name}.jsonl").write_text("".join(next(f) for _ in range(n)))
    ms = resumed_exactly(tmp_path, "--task", "math-q", "--extensions", path, "--eval-every", "2", "--eval-limit", "4")
    with open(tmp_path / "whole" / "config.json") as f:
        cfg = json.load(f)
    assert (cfg["template"], cfg["max_new_tokens"], cfg["task"]) == ("question", 40, "math-q")
    assert "eval_acc" in ms[-1] and all(m["response_len"] <= 40 for m in ms if m["step"])
    evaluate.main(["--model", WARM, "--task", "math-q", "--benchmarks", "math-q-test", "--extensions", path,
                   "--n", "1", "--limit", "4", "--out", str(tmp_path / "eval"), "--no-progress"])
    with open(tmp_path / "eval" / "config.json") as f:
        settings = json.load(f)
    assert (settings["template"], settings["max_new_tokens"], settings["task"]) == ("question", 40, "math-q")


REFERENCE = '''"""A Query-KL reference of one's own with per-step state: an exponential moving average of each
prompt's log-probs under the rollout policy, started at the reference model's (saved, resumed)."""
import torch

from plumbing import extension
from rl import query_reference


class EmaReference(query_reference.QueryReference):
    doc = "an EMA of the rollout policy's prompt log-probs"
    needs = frozenset({"model"})                        # the reference model's forward
    initial_policy = False                              # query_kl stays on pi_0
    loaded = []                                         # the states --resume gave it

    def __init__(self):
        self.avg = {}

    def prompt_logp(self, batch):
        rows = []
        for g, i in enumerate(batch.prompt_idx):
            start = batch.model_prompt[g * batch.group_size]
            rows += [self.avg.get(i, start).to(start.device)] * batch.group_size
        return torch.stack(rows)

    def after_step(self, batch):
        for g, i in enumerate(batch.prompt_idx):
            now = batch.policy_prompt[g * batch.group_size].detach().cpu()
            self.avg[i] = 0.5 * self.avg.get(i, now) + 0.5 * now

    def state_dict(self):
        return {"avg": dict(self.avg)}

    def load_state_dict(self, state):
        EmaReference.loaded.append(state)
        self.avg = dict(state.get("avg", {}))


extension.register(query_reference.REFERENCES, "ema-outside", EmaReference, replace=True)
'''


def test_a_reference_with_state_from_outside_resumes_exactly(tmp_path, small_data, outside):
    """A Query-KL reference whose state moves every step: the checkpoint keeps it, and a --resume
    that names no extension continues the run as if it had not stopped."""
    path = module_file(tmp_path / "mine", "ema", REFERENCE)
    ms = resumed_exactly(tmp_path, "--train-data", small_data, "--max-new-tokens", "48", "--algo", "erpo",
                         "--qkl-ref", "ema-outside", "--extensions", path, steps=3)
    assert ms[-1]["loss_query_kl"] > 0 and all(math.isfinite(m["loss"]) for m in ms)
