"""The Query-KL references of issue #33: the released code as published (k3 against zeros), and
anchors that move with the policy (ema, refresh), which keep their state across --resume."""

import json
import math
import os
import shutil

import pytest
import torch

from rl import query_reference
import train
from tests.rounding import assert_rounding, is_timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def run(out, data, *extra, steps=1):
    train.main(["--model", WARM, "--train-data", data, "--out", str(out), "--steps", str(steps),
                "--rollout-batch", "4", "--update-batch", "4", "--group-size", "4", "--max-new-tokens", "16",
                "--eval-every", "0", "--save-every", "2", "--no-signal", "step", "--query-cache-dir", "", *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_released_zeros_is_k3_against_zeros(tmp_path, small_data, monkeypatch):
    """One RL step, one optimizer step (its forward is pi_old's): loss_query_kl is the mean over
    prompts of the mean over prompt tokens of min(e^NLL_t - NLL_t - 1, 10), NLL_t = -log p(x_t | x_<t)
    under the warm start, from a forward of its own."""
    seen = []
    real = query_reference.ReleasedZerosReference.prompt_logp
    monkeypatch.setattr(query_reference.ReleasedZerosReference, "prompt_logp",
                        lambda self, b: seen.append(b.prompt_idx) or real(self, b))
    (m,) = run(tmp_path, small_data, "--qkl-ref", "released-zeros")
    model, tok = train.models.load_policy(WARM)
    data = train.tasks.prompt_set(small_data, tok, "plain", "math", training=True)
    logp = query_reference.build(model, [data.ids[i] for i in seen[0]], tok.pad_token_id, 1.0, torch.device("cpu"))
    per_prompt = [torch.clamp(torch.exp(-lp) + lp - 1, max=10.0).mean().item() for lp in logp]
    assert_rounding("references.released_zeros_loss_query_kl", m["loss_query_kl"], sum(per_prompt) / len(per_prompt))
    assert m["loss_query_kl"] > 0.5                                 # O(1) at step 0; the monitor: pi_0's
    assert_rounding("references.released_zeros_query_kl", m["query_kl"], 0.0)


def test_ema_moves_each_sampled_prompt_toward_the_policy():
    class Ctx:
        class args:
            qkl_ref_decay = 0.75
    ref = query_reference.EmaReference([torch.zeros(3), torch.zeros(2)], Ctx)
    policy = torch.tensor([[9.0, -1.0, -2.0, -3.0]] * 2 + [[9.0, 9.0, -4.0, -4.0]] * 2)  # right-aligned
    batch = query_reference.PromptBatch([0, 1], 2, 4, policy, torch.ones(4, 4), None, 0)
    ref.after_step(batch)
    assert torch.allclose(ref.logp[0], 0.25 * torch.tensor([-1.0, -2.0, -3.0]))
    assert torch.allclose(ref.logp[1], 0.25 * torch.tensor([-4.0, -4.0]))
    assert ref.prompt_logp(batch)[2].tolist() == [0.0, 0.0, -1.0, -1.0]


@pytest.mark.parametrize("name, extra", [("ema", ("--qkl-ref-decay", "0.5")), ("refresh", ("--qkl-ref-every", "1"))])
def test_a_moving_reference_resumed_at_step_2_matches_the_uninterrupted_run(name, extra, tmp_path, small_data):
    args = ("--algo", "erpo", "--qkl-ref", name, *extra, "--rollout-batch", "8")
    whole = run(tmp_path / "whole", small_data, *args, steps=4)
    run(tmp_path / "cut", small_data, *args, steps=2)
    resumed = run(tmp_path / "cut", small_data, *args, "--resume", steps=4)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed):
        assert {k: v for k, v in a.items() if not is_timing(k)} == {k: v for k, v in b.items() if not is_timing(k)}
    assert whole[-1]["loss_query_kl"] != pytest.approx(whole[-1]["query_kl"], rel=1e-3)   # the anchor moved
    assert all(math.isfinite(m["loss"]) for m in whole)
    assert all(("time_qkl_ref" in m) == (name == "refresh") for m in whole)     # its own forward, timed


def test_a_reference_read_from_another_model_folder(tmp_path, small_data, other_model):
    """--qkl-ref model --qkl-ref-model PATH: the training prompts scored once by the model in PATH.
    Given the run's own starting model, it is the paper's cache bit for bit (the same weights,
    loaded and scored as the cache is: the same forwards), so step 1 is the cache run's, exactly;
    only the query_kl monitor comes from another forward (the reference model's over [prompt |
    response] rows: the same weights, other shapes, so float32 rounding apart, and the monitor is ~0
    at step 1 either way). Given another model, Query-KL is far from 0 at step 1, while the monitor
    still measures the drift from the initial policy; its checkpoint keeps the weights' fingerprint,
    which --resume checks (another model in the folder since: refused)."""
    args = ("--algo", "erpo", "--rollout-batch", "8")
    cached = run(tmp_path / "cache", small_data, *args)
    own = run(tmp_path / "own", small_data, *args, "--qkl-ref", "model", "--qkl-ref-model", WARM)
    for key, value in cached[0].items():
        if not is_timing(key) and key != "query_kl":
            assert own[0][key] == value, key
    assert own[0]["loss_query_kl"] == cached[0]["loss_query_kl"]
    for name, m in (("cache", cached[0]), ("own", own[0])):  # pi_0 against itself: 0 up to rounding
        assert_rounding(f"model_reference.step1_query_kl_{name}", m["query_kl"], 0.0)
    phi = str(tmp_path / "phi")
    shutil.copytree(other_model, phi)
    out = tmp_path / "other"
    other = run(out, small_data, *args, "--qkl-ref", "model", "--qkl-ref-model", phi, steps=2)
    assert other[0]["loss_query_kl"] > 0.01 and all(math.isfinite(m["loss"]) for m in other)
    assert_rounding("model_reference.step1_query_kl_other", other[0]["query_kl"], 0.0)
    saved = torch.load(os.path.join(out, "ckpt", "state.pt"), weights_only=False)
    assert saved["extra"]["query_reference"]["model"] == phi
    assert run(out, small_data, *args, "--resume", steps=3)[-1]["step"] == 3   # scored again: same weights
    shutil.copy(os.path.join(WARM, "model.safetensors"), phi)             # the folder now holds others
    with pytest.raises(SystemExit, match=f"--qkl-ref-model {phi} no longer holds the weights"):
        run(out, small_data, *args, "--resume", steps=4)


def test_qkl_ref_model_says_what_is_wrong_in_one_line(tmp_path, small_data, capsys):
    """--qkl-ref model without --qkl-ref-model, with a folder that is not there or whose tokenizer
    is another (the Zipf world's), and --qkl-ref-model given for another reference: one line each."""
    cases = [((), "--qkl-ref model needs --qkl-ref-model PATH"),
             (("--qkl-ref-model", str(tmp_path / "nowhere")), f"--qkl-ref-model {tmp_path / 'nowhere'}: "
              "model folder"),
             (("--qkl-ref-model", os.path.join(ROOT, "data", "zipf", "warmstart")), "tokenizer is not the "
              "policy's")]
    for i, (extra, said) in enumerate(cases):
        with pytest.raises(SystemExit) as e:
            run(tmp_path / str(i), small_data, "--qkl-ref", "model", *extra)
        assert said in str(e.value.code) and "\n" not in str(e.value.code)
    with pytest.raises(SystemExit):
        train.parse_args(["--qkl-ref", "cache", "--qkl-ref-model", WARM])
    assert "it is an option of another Query-KL reference" in capsys.readouterr().err
