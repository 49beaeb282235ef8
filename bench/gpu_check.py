"""The GPU check of the paper-scale path: one ERPO step of a model with Qwen2.5-Math-7B's widths
on ONE GPU, random weights, no download. Prints the measured memory next to memory_plan.py's
terms, the update's tokens/s and MFU, and decoding tokens/s of our sampler next to HF `generate`.

    python bench/gpu_check.py                                  # CUDA, ~5 minutes on an H100/H200
    python bench/gpu_check.py --preset tiny --device cpu       # the same code in seconds (a test runs it)

The model: Qwen2.5-Math-7B's config (configs/models/) with as many decoder layers as the plan fits
in 75% of the GPU with float32 weights, gradients and Adam state (--layers to choose; printed).
The step is the paper config's on a smaller batch: --rows responses of --new-tokens tokens (eos
off, so every row is that long) after prompts of --prompt-len tokens, fp32 master weights with
bf16 autocast (train.py's --dtype auto on CUDA), activation checkpointing, micro-batches of
--micro-tokens tokens, Query-KL against a cache of the prompts' log-probs, paper query weights,
random 0/1 rewards, one AdamW step. No reference model (ERPO needs none).
"""

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import batching  # noqa: E402
import distributed  # noqa: E402
import losses  # noqa: E402
import memory_plan  # noqa: E402
import optimizer  # noqa: E402
import rollout  # noqa: E402

GIB = 2 ** 30
PRESETS = {  # (model config, prompt len, new tokens, rows, micro tokens)
    "7b": ("Qwen2.5-Math-7B", 256, 2048, 64, 16384),
    "tiny": (dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096), 16, 32, 8, 256),
}
PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312, "L40S": 362, "B200": 2250}  # dense bf16


def model_config(preset, layers):
    from transformers import Qwen2Config

    c = PRESETS[preset][0]
    if isinstance(c, str):
        with open(os.path.join(memory_plan.HERE, "configs", "models", c + ".json")) as f:
            c = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    return Qwen2Config(**{**c, "num_hidden_layers": layers or c["num_hidden_layers"]})


def plan_args(a):
    return SimpleNamespace(max_prompt_len=a.prompt_len, max_new_tokens=a.new_tokens, micro_batch=a.rows,
                           micro_tokens=a.micro_tokens, fsdp=False, grad_ckpt=True, rollout_batch=a.rows,
                           group_size=1, gen_batch=a.rows, kv_budget=0)


def layers_that_fit(a, total_bytes) -> int:
    """The most decoder layers whose planned peak (1 GPU) stays under 75% of the GPU."""
    cfg = model_config(a.preset, 0).to_dict()
    best = 1
    for n in range(1, cfg["num_hidden_layers"] + 1):
        arch = memory_plan.Arch.from_config({**cfg, "num_hidden_layers": n})
        ts = memory_plan.terms(arch, plan_args(a), 1, False, a.rows)
        if max(sum(t.bytes for t in ts if t.phase in ("both", ph)) for ph in ("rollout", "update")) < 0.75 * total_bytes:
            best = n
    return best


class Mem:
    """Allocated bytes now and the peak since the last reset (CUDA); zeros on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def now(self):
        return torch.cuda.memory_allocated() if self.cuda else 0

    def reset(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self):
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def decode_rates(model, prompts, new, temperature, mem):
    """tokens/s of our sampler and of plain HF generate on the same prompts (eos off)."""
    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    out = {}
    for name in ("ours", "hf generate"):
        mem.sync()
        t0 = time.perf_counter()
        if name == "ours":
            rollout.sample(model, prompts, max_new_tokens=new, eos_ids=[], pad_id=0, temperature=temperature,
                           seeds=list(range(len(prompts))))
        else:
            ids, mask = rollout.left_pad(prompts, 0, dev)
            model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
                max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=temperature, top_k=0,
                top_p=1.0, eos_token_id=None, pad_token_id=0))
        mem.sync()
        out[name] = len(prompts) * new / (time.perf_counter() - t0)
    return out


def erpo_update(model, ro, qref_logp, a, opt, amp, mem):
    """One optimizer step of the ERPO loss over the rollout, micro-batched by tokens."""
    algo = losses.ALGOS["erpo"]
    packed = ro.packed()
    B = packed.input_ids.shape[0]
    rewards = torch.randint(0, 2, (B,), generator=torch.Generator().manual_seed(0)).float().to(packed.input_ids.device)
    adv = losses.group_advantages(rewards, a.group, algo.adv, algo.adv_eps)
    nll = -(qref_logp * packed.prompt_tok_mask).sum(1)
    w = losses.query_weights(nll, mean_nll=nll.mean().item(), clip=algo.weight_clip)
    resp_mask = ro.response_mask.float()
    num_tokens = resp_mask.sum().item()
    plan = batching.microbatch_plan(packed.attention_mask.sum(1).tolist(), a.rows, a.micro_tokens)
    mem.reset()
    for mb in plan:
        r = torch.tensor(mb, device=packed.input_ids.device)
        pk, pc, rc = packed.trimmed(r)
        with amp():
            s = rollout.score_tokens(model, pk, a.temperature)
            loss, _ = losses.rl_loss(algo, logp=s.response, old_logp=s.response.detach(), ref_logp=None,
                                     resp_mask=resp_mask[r][:, rc], advantages=adv[r], weights=w[r],
                                     prompt_logp=s.prompt, prompt_ref_logp=qref_logp[r][:, pc],
                                     prompt_mask=packed.prompt_tok_mask[r][:, pc].float(),
                                     num_tokens=num_tokens, num_seqs=B, max_len=a.new_tokens)
        loss.backward()
    mem.sync()
    peak_loop = mem.peak()                     # weights + gradients + one micro-batch's activations
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    mem.reset()
    optimizer.clip_grad(model, 1.0)
    opt.step()                                 # Adam state appears here (and its temporaries)
    mem.sync()
    return int(packed.attention_mask.sum()), grads, len(plan), peak_loop, mem.peak()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="7b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: as many as fit)")
    ap.add_argument("--rows", type=int, default=None, help="responses in the step")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--micro-tokens", type=int, default=None)
    ap.add_argument("--decode-new", type=int, default=256, help="new tokens of the ours-vs-HF decode comparison")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the GPU (default: by name)")
    a = ap.parse_args(argv)
    _, P, N, R, MT = PRESETS[a.preset]
    a.prompt_len, a.new_tokens, a.rows, a.micro_tokens = a.prompt_len or P, a.new_tokens or N, a.rows or R, a.micro_tokens or MT
    a.group = 8 if a.rows % 8 == 0 else a.rows
    dev = torch.device(a.device)
    mem, cuda = Mem(dev), dev.type == "cuda"
    total = torch.cuda.get_device_properties(dev).total_memory if cuda else 64 * GIB
    a.layers = a.layers or (layers_that_fit(a, total) if a.preset == "7b" else 0)
    cfg = model_config(a.preset, a.layers)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"device {name}; model: {a.preset} widths, {cfg.num_hidden_layers} of its layers "
          f"({'as many as the plan fits in 75% of ' + f'{total / GIB:.0f} GiB' if a.preset == '7b' else 'preset'}), random weights")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    params_bytes = mem.now()
    print(f"built {n_params / 1e9:.2f}B parameters in {time.perf_counter() - t0:.0f} s")
    amp = distributed.precision("auto", dev)[1]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.rows // a.group)]
    prompts = [p for p in prompts for _ in range(a.group)]

    # Rollout: the full step's responses, then the decode-speed comparison on the same model.
    mem.reset()
    base = mem.now()
    t0 = time.perf_counter()
    with amp():
        ro = rollout.sample(model.eval(), prompts, max_new_tokens=a.new_tokens, eos_ids=[], pad_id=0,
                            temperature=a.temperature, seeds=list(range(len(prompts))))
    mem.sync()
    t_gen, kv_peak = time.perf_counter() - t0, mem.peak() - base
    with amp():
        rates = decode_rates(model, prompts[:a.rows], a.decode_new, a.temperature, mem)
        with torch.no_grad():  # the Query-KL cache: the prompts' log-probs under the initial weights
            ids, mask = rollout.left_pad(prompts, 0, dev)      # (all prompts are --prompt-len long)
            qref = rollout.token_logprobs(model, ids, mask, a.temperature)[0].float()  # (rows, P-1)

    # Update: grad-ckpt, token micro-batches, one AdamW step.
    model = distributed.wrap_model(model.train(), dev, grad_ckpt=True)
    opt = optimizer.adamw(model, 1e-6, 0.01)
    t0 = time.perf_counter()
    tokens, grad_bytes, n_mb, loop_peak, opt_peak = erpo_update(model, ro, qref, a, opt, amp, mem)
    t_upd, upd_peak = time.perf_counter() - t0, max(loop_peak, opt_peak)
    adam_bytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim())

    arch = memory_plan.Arch.from_config(cfg.to_dict())
    plan = {t.name: t.bytes for t in memory_plan.terms(arch, plan_args(a), 1, False, a.rows)}
    measured = {"parameters": params_bytes, "gradients": grad_bytes, "Adam state": adam_bytes,
                "KV cache chunk": kv_peak,
                "activations + logits": loop_peak - params_bytes - grad_bytes if cuda else 0}
    plan["activations + logits"] = plan.pop("activations") + plan.pop("logits")
    unit, u = (GIB, "GiB") if plan["parameters"] > GIB / 4 else (2 ** 20, "MiB")
    print(f"{'memory term':22s} {'plan ' + u:>9s} {'measured ' + u:>13s}")
    for k in ("parameters", "gradients", "Adam state", "KV cache chunk", "activations + logits"):
        m = f"{measured[k] / unit:13.2f}" if cuda or k in ("gradients", "Adam state") else f"{'-':>13s}"
        print(f"{k:22s} {plan[k] / unit:9.2f} {m}")
    print(f"{'update peak':22s} {'':9s} {upd_peak / unit:13.2f}   (micro-batch loop {loop_peak / unit:.2f}, "
          f"optimizer step {opt_peak / unit:.2f})" if cuda else "update peak: (CPU: not measured)")
    flops = 6 * n_params * tokens  # model FLOPs; activation checkpointing recomputes a forward on top
    peak = a.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    print(f"rollout: {a.rows} x {a.new_tokens} tokens in {t_gen:.1f} s = {a.rows * a.new_tokens / t_gen:.0f} tok/s")
    print(f"decode tok/s at {a.rows} rows x {a.decode_new} new: ours {rates['ours']:.0f}, HF generate "
          f"{rates['hf generate']:.0f}, ratio {rates['ours'] / rates['hf generate']:.2f}x")
    print(f"update: {tokens} tokens in {n_mb} micro-batches, {t_upd:.1f} s = {tokens / t_upd:.0f} tok/s; "
          f"MFU {flops / t_upd / (peak * 1e12) * 100:.1f}% of {peak} TFLOP/s" if peak else
          f"update: {tokens} tokens in {n_mb} micro-batches, {t_upd:.1f} s = {tokens / t_upd:.0f} tok/s; MFU: unknown peak")
    print(f"check: ok layers={cfg.num_hidden_layers} params_b={n_params / 1e9:.2f} update_peak_gib={upd_peak / GIB:.1f}")


if __name__ == "__main__":
    main()
