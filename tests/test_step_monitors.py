"""The sampler is pi_old computed by other kernels (issue #32, item 3): how far it is, logged every
step (sampler_logp_gap, sampler_kl), and truncated importance sampling (--tis-cap) to correct for it.
On CPU in float32 the two agree to rounding; a known perturbation of the sampler's log-probs must
come out of metrics.jsonl as its hand value."""

import json
import math
import os

import pytest
import torch

import losses
from rl import experience
import train
from tests.rounding import assert_rounding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = os.path.join(ROOT, "data", "tinymath", "warmstart")
SHIFT = 0.05                       # the perturbation: log pi_s = log pi_old - SHIFT on every token


def test_truncated_is_weights_hand_values():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    sampler = torch.tensor([[-0.5, -1.0, -0.1]])
    w = losses.truncated_is_weights(old, sampler, cap=1.5)
    assert torch.allclose(w, torch.tensor([[1.5, 1.0, math.exp(-1.9)]]))    # e^0.5 = 1.65 capped
    assert not w.requires_grad


def test_tis_multiplies_the_per_token_policy_gradient():
    """rl_loss with tis_cap: loss and gradient are those of the per-token surrogate times the weight."""
    torch.manual_seed(0)
    B, T = 4, 5
    logp = (torch.randn(B, T) * 0.1 - 1).requires_grad_()
    old, sampler = logp.detach() + 0.05 * torch.randn(B, T), logp.detach() + 0.3 * torch.randn(B, T)
    mask, adv = (torch.rand(B, T) > 0.2).float(), torch.randn(B)
    algo = losses.make_algo("grpo", tis_cap=1.2, beta=0.0, kl="none")
    kw = dict(old_logp=old, ref_logp=None, resp_mask=mask, advantages=adv, weights=None, prompt_logp=None,
              prompt_ref_logp=None, prompt_mask=None, num_tokens=mask.sum(), num_seqs=B, max_len=T)
    loss, st = losses.rl_loss(algo, logp=logp, sampler_logp=sampler, **kw)
    w = torch.exp(old - sampler).clamp_max(1.2)
    per_token, _ = losses.ppo_loss(logp, old, adv, algo.eps_low, algo.eps_high, algo.dual_clip)
    want = (per_token * w * mask).sum() / mask.sum()
    assert torch.allclose(loss, want)
    g, = torch.autograd.grad(loss, logp)
    g_want, = torch.autograd.grad(want, logp)
    assert torch.allclose(g, g_want)
    assert st["tis_weight"] == pytest.approx(float((w * mask).sum() / mask.sum()))
    assert st["tis_capped_frac"] == pytest.approx(float(((w >= 1.2) * mask).sum() / mask.sum()))
    with pytest.raises(ValueError, match="sampler_logp"):
        losses.rl_loss(algo, logp=logp, **kw)
    with pytest.raises(ValueError, match="tis_cap"):
        losses.make_algo("grpo", tis_cap=-1.0)


def test_sampler_vs_old_hand_values():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    sampler = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])                            # the third token is padding
    s = experience.sampler_vs_old(sampler, old, mask)
    assert s["samp_gap"].sum().item() == pytest.approx(0.5)
    assert s["samp_kl"].sum().item() == pytest.approx(math.exp(0.5) - 1 - 0.5)


def run(out, data, *extra):
    train.main(["--model", WARM, "--train-data", data, "--out", str(out), "--steps", "2", "--rollout-batch", "8",
                "--update-batch", "4", "--group-size", "4", "--max-new-tokens", "24", "--eval-every", "0",
                "--save-every", "0", "--no-signal", "step", *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def shifted_sampler(monkeypatch):
    """The sampler's log-probs as if its kernels were SHIFT nats less confident on every token."""
    real = train.experience.sample_and_score

    def shifted(*a, **k):
        g = real(*a, **k)
        g.ro.logprobs -= SHIFT * g.ro.response_mask
        return g
    monkeypatch.setattr(train.experience, "sample_and_score", shifted)


def test_the_monitors_are_zero_in_float32_and_measure_a_known_gap(tmp_path, small_data, monkeypatch):
    for m in run(tmp_path / "same", small_data):
        assert_rounding("step_monitors.sampler_logp_gap", m["sampler_logp_gap"], 0.0)  # the same pi, two kernels
        assert_rounding("step_monitors.sampler_kl", m["sampler_kl"], 0.0)
    shifted_sampler(monkeypatch)
    k3 = math.exp(SHIFT) - 1 - SHIFT                                          # log r = log pi_old - log pi_s
    for m in run(tmp_path / "shifted", small_data):
        assert_rounding("step_monitors.shifted_logp_gap", m["sampler_logp_gap"], SHIFT)
        assert_rounding("step_monitors.shifted_kl", m["sampler_kl"], k3)
    for cap, weight, capped in ((2.0, math.exp(SHIFT), 0.0), (1.02, 1.02, 1.0)):
        for m in run(tmp_path / f"tis{cap}", small_data, "--tis-cap", str(cap)):
            assert_rounding("step_monitors.tis_weight", m["tis_weight"], weight)
            assert m["tis_capped_frac"] == pytest.approx(capped)


class FakeCuda:
    """torch.cuda as Phases reads it: a peak that the phase's work sets, a driver's free memory."""
    GIB = 2**30

    def __init__(self):
        self.peak, self.reserved, self.free, self.total, self.resets = 0, 0, 0, 80 * self.GIB, 0

    def synchronize(self):
        pass

    def reset_peak_memory_stats(self):
        self.resets += 1
        self.peak = self.reserved = 0

    def max_memory_allocated(self):
        return self.peak

    def max_memory_reserved(self):
        return self.reserved

    def mem_get_info(self):
        return self.free, self.total


def test_gpu_memory_per_phase_in_gib_on_cuda():
    """Each phase's peak (reset at its start), the reserved peak and the driver's used memory at its
    end; a repeated phase keeps its largest; a CPU run logs none."""
    from rl.experience import Phases
    cuda, G = FakeCuda(), FakeCuda.GIB
    t = Phases("cuda", cuda=cuda)
    for phase, peak, reserved, free in (("gen", 30, 40, 20), ("update", 50, 60, 10), ("gen", 20, 45, 25)):
        with t(phase):
            cuda.peak, cuda.reserved, cuda.free = peak * G, reserved * G, free * G
    m = t.metrics()
    assert cuda.resets == 3
    assert {k: v for k, v in m.items() if k.startswith("mem_")} == {
        "mem_alloc_gen": 30.0, "mem_reserved_gen": 45.0, "mem_used_gen": 60.0,
        "mem_alloc_update": 50.0, "mem_reserved_update": 60.0, "mem_used_update": 70.0}
    assert t.metrics() == {}                                                      # afresh
    cpu = Phases("cpu")
    with cpu("gen"):
        pass
    assert list(cpu.metrics()) == ["time_gen"]
