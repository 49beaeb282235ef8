"""LoRA (--lora-rank, modeling/lora.py): only the adapters train, the frozen base is GRPO's reference model,
a resumed run continues exactly, and the merged export is a plain folder evaluate.py loads."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import evaluate
from modeling import lora
from modeling import models
import train
from tests.rounding import assert_rounding, is_timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")


def run(out, data, *extra, steps=3):
    train.main(["--algo", "grpo", "--lora-rank", "4", "--model", WARM, "--train-data", data, "--out", str(out),
                "--steps", str(steps), "--rollout-batch", "8", "--update-batch", "4", "--group-size", "4",
                "--max-new-tokens", "24", "--eval-every", "0", "--save-every", "2", "--lr", "3e-3",
                "--no-signal", "step", "--query-cache-dir", "", *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_only_the_adapters_train_and_the_base_is_the_reference():
    model, _ = models.load_policy(WARM)
    wrapped = lora.wrap(model, 4, 16.0)
    n_train, n_all = lora.trainable(wrapped)
    names = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # 7 adapted linear layers per decoder layer (q, k, v, o, gate, up, down), each r x (in + out)
    cfg = model.config
    h, kv, inter = cfg.hidden_size, cfg.num_key_value_heads * (h_d := cfg.hidden_size // cfg.num_attention_heads), \
        cfg.intermediate_size
    per_layer = 4 * ((h + h) + (h + kv) * 2 + (h + h) + 2 * (h + inter) + (inter + h))
    assert n_train == cfg.num_hidden_layers * per_layer and n_all > n_train and h_d > 0
    x = torch.tensor([[5, 6, 7, 8, 9]])
    torch.nn.init.normal_(wrapped.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight)
    base = models.load_policy(WARM)[0]
    assert torch.equal(lora.Base(wrapped)(input_ids=x).logits, base(input_ids=x).logits)  # adapters off
    merged = lora.merged(wrapped)
    assert_rounding("lora.merged_vs_wrapped_logits", merged(input_ids=x).logits, wrapped(input_ids=x).logits)
    assert not torch.allclose(merged(input_ids=x).logits, base(input_ids=x).logits, atol=1e-3)


def test_three_steps_train_adapters_resume_exactly_and_export_a_merged_model(tmp_path, small_data):
    # an entropy bonus moves the adapters: no reward has a signal at 24 tokens, and at the base the
    # Policy-KL's gradient is exactly 0 (policy and reference score in the same kernels)
    bonus = ("--entropy-coef", "0.01")
    whole = run(tmp_path / "whole", small_data, *bonus)
    run(tmp_path / "cut", small_data, *bonus, steps=2)
    resumed = run(tmp_path / "cut", small_data, "--resume")
    strip = [{k: v for k, v in m.items() if not is_timing(k)} for m in whole]
    assert strip == [{k: v for k, v in m.items() if not is_timing(k)} for m in resumed]
    assert whole[0]["policy_kl"] == 0 and whole[-1]["policy_kl"] > 0        # the reference is the base
    ckpt = tmp_path / "whole" / "ckpt"
    adapters = load_file(str(ckpt / lora.ADAPTER_FILE))
    assert adapters and all("lora_" in k for k in adapters) and not (ckpt / "model.safetensors").exists()
    # the final save's merged model: the base's frozen weights + (alpha / r) B A, a plain HF folder
    hf = load_file(str(tmp_path / "whole" / "hf" / "model.safetensors"))
    warm = load_file(os.path.join(WARM, "model.safetensors"))
    assert set(hf) == set(warm)
    moved = [k for k in warm if not torch.equal(hf[k], warm[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved)         # only adapted layers differ
    evaluate.main(["--model", str(tmp_path / "whole" / "hf"), "--benchmarks", "tiny-test", "--limit", "2", "--n",
                   "1", "--max-new-tokens", "8", "--temperatures", "1.0", "--no-progress",
                   "--out", str(tmp_path / "eval")])
    assert (tmp_path / "eval" / "summary.json").exists()


def test_lora_with_fsdp_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--lora-rank", "4", "--fsdp", "--out", str(tmp_path / "x")])


def test_targets_with_spaces_adapt_every_named_module():
    """--lora-targets "q_proj, v_proj": both (issue #40: the space made peft look for " v_proj")."""
    assert lora.target_modules("q_proj, v_proj") == ["q_proj", "v_proj"]
    assert lora.target_modules(" all-linear ") == "all-linear"
    wrapped = lora.wrap(models.load_policy(WARM)[0], 4, 16.0, targets="q_proj, v_proj")
    adapted = {n.split(".lora_A.")[0].split(".")[-1] for n, _ in wrapped.named_parameters() if ".lora_A." in n}
    assert adapted == {"q_proj", "v_proj"}


def test_a_lora_run_folder_evaluates_and_its_damaged_export_is_rebuilt(tmp_path, small_data, capsys):
    """Issue #40: the summary names <out>/hf (ckpt/ holds adapters only); evaluate.py and analysis.py
    load the run folder or its ckpt/ as the initial model with the adapters merged (the weights of
    hf/); a finished run's hf/ cut short by a full disk is rebuilt by --resume, saying so."""
    from evaluation import heldout
    from plumbing import checkpoints

    out = tmp_path / "run"
    run(out, small_data, steps=2)
    assert f"python evaluate.py --model {out}/hf " in capsys.readouterr().out
    src = checkpoints.find_model(str(out))
    assert src.adapters == str(out / "ckpt") and src.model == WARM
    hf = {k: v.clone() for k, v in load_file(str(out / "hf" / "model.safetensors")).items()}  # (not mapped)
    for path in (out, out / "ckpt"):
        merged = heldout.load_model(str(path))[0].state_dict()
        for k, v in hf.items():                                          # merged here vs in the run
            assert_rounding("lora.run_folder_merged_vs_hf", merged[k], v)
    assert checkpoints.export_damage(str(out / "hf")) is None
    weights = out / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])                    # a full disk cut it short
    assert checkpoints.export_damage(str(out / "hf")) == f"model.safetensors: 1000 bytes, {hf_size(hf)} written"
    train.main(["--out", str(out), "--resume"])
    assert f"--resume: {out}/hf is not complete (model.safetensors: 1000 bytes" in capsys.readouterr().out
    assert checkpoints.export_damage(str(out / "hf")) is None
    rebuilt = load_file(str(weights))
    assert all(torch.equal(rebuilt[k], v) for k, v in hf.items())


def hf_size(tensors):
    from safetensors.torch import save
    return len(save(tensors, metadata={"format": "pt"}))


def test_a_target_that_matches_no_module_is_one_line_before_out_is_claimed(tmp_path, small_data):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run(out, small_data, "--lora-targets", "q_proj,nonexistent_proj", steps=1)
    assert str(e.value.code).startswith("error: --lora-targets nonexistent_proj: no module of the model is named "
                                        "so; its linear layers are down_proj, gate_proj, k_proj")
    assert not out.exists()
