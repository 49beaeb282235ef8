"""Side-by-side benchmark of the two samplers in rollout.py: our KV-cache loop ("kv") vs HF
`generate` ("hf"), on a randomly initialised Qwen2 model, plus the parity numbers that matter when
the dtype is bf16 (they are exact in fp32 on CPU, see tests/test_rollout.py).

    python bench/bench_sampler.py                       # tiny model, CPU (~0.3M params, vocab 1000)
    python bench/bench_sampler.py --preset qwen0.5b     # Qwen2.5-0.5B shape (vocab 151936), CUDA bf16
    python bench/bench_sampler.py --one-pass            # one pass over refilled slots vs chunks
    python bench/bench_sampler.py --compiled            # + the decode step compiled (--compile-decode)

Prints tokens/s of each sampler and their ratio against the pinned baseline "hf-plain": HF
`generate` with plain sampling (do_sample, temperature, top_k 0, top_p 1) and no per-step logits
kept -- the cheapest HF call that samples the same distribution. "hf" is rollout.py's HF path (it
keeps every step's logits to return log-probs, as a sampler for RL must), "kv" our sampler;
"+seeds" adds per-row seeds (rows independent of batching). With --parity it also prints greedy
kv-vs-hf agreement, whether seeded samples survive re-batching, and max |sampled logprob -
token_logprobs|. EOS is disabled (eos_ids=[]) so every row decodes exactly --new tokens and all
samplers do the same amount of work.

--compiled [BACKEND]: adds "kv+compiled", our sampler with its decode step through torch.compile
(decode.CapturedStep: inductor, on CUDA in CUDA graphs; or BACKEND), and prints its compile time (its
first call's wall time less a warm call's) and after how many sampler calls of this size it pays off.

--one-pass: the rollout schedule instead (sampler/kv_cache.py). --rows seeded rows with long-tailed lengths
(--eos-count tokens of the near-uniform random model end a row: geometric lengths, mean about
vocab / eos_count, capped at --new) decoded with room for --slots rows in the KV cache, two ways,
each through the same decode step: in chunks of --slots rows one after another, each until its
longest row ends (the loop before issue #32), and in one pass whose finished slots are refilled. Prints
the decode steps and wall time of each, their ratios, and whether both gave the same tokens.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sampler import kv_cache
from modeling import logprobs
import rollout as R

PRESETS = {  # Qwen2Config kwargs
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "qwen0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                     num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
}


def build(preset, device, dtype, init=0.02):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(**PRESETS[preset], tie_word_embeddings=True, max_position_embeddings=4096,
                      initializer_range=init)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).eval()


def hf_plain(model, prompts, new, temperature):
    """The pinned baseline: HF generate, plain sampling, nothing kept but the tokens; no EOS."""
    from transformers import GenerationConfig

    ids, mask = kv_cache.left_pad(prompts, 0, next(model.parameters()).device)
    cfg = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                           eos_token_id=None, pad_token_id=0)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def one_pass_vs_chunks(model, args, device):
    """Decode steps and wall time: chunks of --slots rows one after another vs one refilled pass."""
    V, S, N = model.config.vocab_size, args.slots, args.rows
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (N,), generator=g).tolist()
    prompts = [torch.randint(args.eos_count + 2, V, (n,), generator=g).tolist() for n in lens]
    seeds = list(range(5000, 5000 + N))
    kw = dict(max_new_tokens=args.new, eos_ids=list(range(2, 2 + args.eos_count)), pad_id=0,
              temperature=args.temperature, batch_size=S)
    steps, real = [], kv_cache.decode_pass

    def counted(*a, **k):
        d = real(*a, **k)
        steps.append(d.steps)
        return d

    def chunks():  # each chunk's rows alone: a pass without refills is the chunked loop's schedule
        return [R.sample(model, prompts[i:i + S], seeds=seeds[i:i + S], **kw) for i in range(0, N, S)]

    kv_cache.decode_pass = counted
    try:
        timed(chunks, device)  # warm-up
        res = {}
        for name, fn in (("chunked", chunks), ("one pass", lambda: [R.sample(model, prompts, seeds=seeds, **kw)])):
            steps.clear()
            ros, dt = timed(fn, device)
            res[name] = ([t for ro in ros for t in (ro.response_ids[i, :n].tolist()
                                                    for i, n in enumerate(ro.lengths.tolist()))],
                         sum(steps), len(steps), dt)
    finally:
        kv_cache.decode_pass = real
    L = torch.tensor([len(t) for t in res["one pass"][0]]).float()
    print(f"rows={N} slots={S} new={args.new} eos_count={args.eos_count}: response lengths mean {L.mean():.0f}, "
          f"median {L.median():.0f}, max {L.max():.0f}, {int((L == args.new).sum())} at the limit; "
          f"{int(L.sum())} tokens")
    for name, (_, n_steps, n_calls, dt) in res.items():
        print(f"{name:9s} {n_calls:3d} pass(es) {n_steps:6d} decode steps {dt:8.2f} s  "
              f"(tokens / (steps x slots) = {L.sum() / (n_steps * S):.0%})")
    (_, a, _, ta), (_, b, _, tb) = res["chunked"], res["one pass"]
    print(f"one pass / chunked: decode steps {b / a:.2f}x, wall time {tb / ta:.2f}x; "
          f"same tokens: {res['chunked'][0] == res['one pass'][0]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA)")
    ap.add_argument("--init", type=float, default=0.02, help="initializer_range of the random model")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per sampler (best kept)")
    ap.add_argument("--group", type=int, default=1,
                    help="each prompt repeated this many times, as GRPO's G responses (our sampler prefills it once)")
    ap.add_argument("--one-pass", action="store_true", help="only the one pass vs chunks (see the docstring)")
    ap.add_argument("--compiled", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="add our sampler with its decode step compiled (torch.compile's backend: inductor)")
    ap.add_argument("--rows", type=int, default=256, help="--one-pass: rows of the rollout")
    ap.add_argument("--slots", type=int, default=64, help="--one-pass: rows the KV cache holds at once")
    ap.add_argument("--eos-count", type=int, default=16, help="--one-pass: tokens that end a row")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build(args.preset, device, dtype, args.init)
    V = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    print(f"preset={args.preset} params={n_params / 1e6:.1f}M vocab={V} device={device} "
          f"dtype={dtype} threads={torch.get_num_threads()}")
    if args.one_pass:
        return one_pass_vs_chunks(model, args, device)
    g = torch.Generator().manual_seed(0)

    def make_prompts(B):  # ragged lengths so left padding is exercised
        lens = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (-(-B // args.group),), generator=g)
        return [p for n in lens for p in [torch.randint(2, V, (int(n),), generator=g).tolist()] * args.group][:B]

    kw = dict(max_new_tokens=args.new, eos_ids=[], pad_id=0, temperature=args.temperature)
    runs = [("kv", {}), ("kv+seeds", {"seeds": True}), ("hf-plain", {"plain": True}), ("hf", {"sampler": "hf"}),
            ("hf+seeds", {"sampler": "hf", "seeds": True})]
    if args.compiled:
        runs.insert(2, ("kv+compiled", {"seeds": True, "compile_decode": args.compiled}))
    for B in args.batch:
        prompts = make_prompts(B)

        def go(extra, prompts=prompts, B=B):                # this batch size's (bound now)
            if extra.get("plain"):
                return timed(lambda: hf_plain(model, prompts, args.new, args.temperature), device)
            extra = dict(extra, seeds=list(range(B))) if extra.get("seeds") else extra
            return timed(lambda: R.sample(model, prompts, **kw, **extra), device)

        first = {name: go(extra)[1] for name, extra in runs}  # full-size warm-up: kernels, the CUDA
        #                                                       caching allocator, the compiled graphs
        best = {name: float("inf") for name, _ in runs}
        for _ in range(args.reps):  # alternate samplers so drifts hit all of them alike
            for name, extra in runs:
                ro, dt = go(extra)
                best[name] = min(best[name], dt)
        rates = {name: B * args.new / dt for name, dt in best.items()}
        for name, _ in runs:
            print(f"B={B:4d} {name:9s} {rates[name]:10.0f} tok/s  (best {best[name]:.2f} s)")
        print(f"B={B:4d} kv/hf-plain speed ratio: {rates['kv'] / rates['hf-plain']:.2f}x   "
              f"(kv+seeds/hf-plain {rates['kv+seeds'] / rates['hf-plain']:.2f}x; kv/hf {rates['kv'] / rates['hf']:.2f}x)")
        if args.compiled:
            compile_s = first["kv+compiled"] - best["kv+compiled"]
            saved = best["kv+seeds"] - best["kv+compiled"]
            pays = f"after {compile_s / saved:.0f} calls" if saved > 0 else "never"
            print(f"B={B:4d} kv+compiled/kv+seeds speed ratio: "
                  f"{rates['kv+compiled'] / rates['kv+seeds']:.2f}x; "
                  f"compile {compile_s:.1f} s ({args.compiled}), pays off {pays}")

    if args.parity:
        B = args.batch[0]
        prompts = make_prompts(B)
        gk = dict(kw, temperature=0)
        a, b = R.sample(model, prompts, **gk), R.sample(model, prompts, sampler="hf", **gk)
        same = (a.response_ids == b.response_ids).all(1)
        first = [int((a.response_ids[i] != b.response_ids[i]).nonzero()[0]) for i in range(B) if not same[i]]
        print(f"greedy kv==hf: {int(same.sum())}/{B} rows identical; first divergence steps {first[:10]}")
        seeds = list(range(1000, 1000 + B))
        whole = R.sample(model, prompts, seeds=seeds, **kw)
        chunked = R.sample(model, prompts, seeds=seeds, batch_size=max(1, B // 4), **kw)
        rev = R.sample(model, prompts[::-1], seeds=seeds[::-1], **kw)
        s1 = (whole.response_ids == chunked.response_ids).all(1).sum().item()
        s2 = (whole.response_ids == rev.response_ids.flip(0)).all(1).sum().item()
        s3 = (whole.response_ids == whole.response_ids).all(1).sum().item()
        print(f"seeded re-batching: chunked {s1}/{B}, reversed {s2}/{B} rows identical (self {s3})")
        with torch.no_grad():
            sc = logprobs.score_tokens(model, whole.packed(), args.temperature, with_entropy=True)
        diff = (whole.logprobs - sc.response * whole.response_mask).abs()
        print(f"sampled logprob vs token_logprobs: max |diff| {diff.max():.3e}, mean {diff.mean():.3e}; "
              f"mean entropy {sc.entropy[whole.response_mask.bool()].mean():.3f}")


if __name__ == "__main__":
    main()
