"""What a metric comparison may take as exact, and how far float32 rounding may move the rest.

float32 arithmetic rounds differently on another x86-64 CPU with the same torch: ATen picks AVX-512,
AVX2 or scalar kernels by what the CPU has, MKL its own code path. Two such machines agree on a
loss to ~1e-5 relative, and the difference grows step by step; the discrete outcomes (sampled
tokens, rewards, counts) do not move. So a test that compares metrics across runs takes the
`EXACT` keys as exact and gives every other metric an absolute tolerance of its own, measured:
SAFETY x the worst difference seen across the kernel variants of `KERNELS`, all run on one machine
(`python -m tests.test_golden tolerances` writes them to tests/golden/tolerances.json).
"""

import json
import os

TOLERANCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tolerances.json")

# The CPU kernel variants whose rounding the tolerances cover: this machine's own kernels; those an
# AVX2-only CPU (e.g. AMD Zen 3) runs natively; ATen's scalar kernels; MKL's conditional-numerical-
# reproducibility path (float32 matrix products go through MKL). Each is only environment variables.
KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
}
KERNEL_VARIABLES = {"ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR"}
SAFETY = 10

# Integers and ratios of integers (rows, tokens, grader outcomes), the sampled tokens' digest, the
# lr schedule. `reward` and `train_acc` are means of 0/1 scores, exact in float; a shaped reward
# (DAPO's overlong penalty, the format bonus) would be rounding.
EXACT = {"step", "tokens", "reward", "train_acc", "response_len", "response_tokens", "truncated_frac",
         "new_turn_frac", "zero_var_frac", "skipped_steps", "no_signal_steps", "lr", "reward_timeout",
         "reward_error", "reward_no_answer", "resample_rounds", "kept_groups"}


def is_exact(key):
    return key in EXACT or key.startswith("eval_acc")


def is_timing(key):
    """Wall-clock keys (step_time, time_gen, gen_tok_per_s, ...) and a GPU's memory (mem_*, CUDA
    only): never compared."""
    return key == "step_time" or key.startswith(("time_", "mem_")) or key.endswith("_per_s")


def tolerance(worst_by_kernel, scale):
    """SAFETY x the worst difference over the kernel variants. Where every variant agreed bit for
    bit, SAFETY x float32's epsilon (2^-23) x the metric's largest value `scale`: the least another
    CPU could round apart (0 for a metric that is 0 throughout)."""
    worst = max(worst_by_kernel)
    return SAFETY * worst if worst > 0 else SAFETY * abs(scale) * 2.0 ** -23


def kernel_env(variant):
    """os.environ with `variant`'s variables in place of any the caller exported."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARIABLES}
    return {**env, **KERNELS[variant]}


def load_tolerances():
    with open(TOLERANCES) as f:
        return json.load(f)
