"""What a metric comparison may take as exact, and how far float32 rounding may move the rest.

float32 arithmetic rounds differently on another x86-64 CPU with the same torch: ATen picks AVX-512,
AVX2 or scalar kernels by what the CPU has, MKL its own code path. Two such machines agree on a
loss to ~1e-5 relative, and the difference grows step by step; the discrete outcomes (sampled
tokens, rewards, counts) do not move. So a test that compares metrics across runs takes the
`EXACT` keys as exact and gives every other metric an absolute tolerance of its own, measured:
SAFETY x the worst difference seen across the kernel variants of `KERNELS`, all run on one machine
(`python -m tests.test_golden tolerances` writes them to tests/golden/tolerances.json).

The same holds for a test that compares two code paths (a fused kernel and the plain formula, the
live reference and the cache, ...) or a run and a committed number: it calls `assert_rounding` with
a name, and its tolerance is measured the same way (the tests of `CROSS_PATH_TESTS`, run under each
variant with `RECORD` set, write each comparison's difference instead of asserting).
"""

import json
import math
import os

TOLERANCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tolerances.json")

# The CPU kernel variants whose rounding the tolerances cover: this machine's own kernels; those an
# AVX2-only CPU (e.g. AMD Zen 3) runs natively; those of an AVX-512 CPU without BF16/AMX (Intel Ice
# Lake); ATen's scalar kernels; MKL's conditional-numerical-reproducibility path. Each is only
# environment variables. float32 matrix products go through MKL, bf16 ones through oneDNN (checked
# with MKL_VERBOSE=1 / ONEDNN_VERBOSE=1 on a Sapphire Rapids): MKL's AVX512 code path is that of
# Skylake-X/Ice Lake (its float32 SGEMM rounds as AVX512_E4's, the AMX one, bit for bit); oneDNN
# capped at AVX512_CORE_VNNI runs Ice Lake's bf16 gemm:jit instead of brg_matmul:amx (other bits);
# capped at AVX2 it has no bf16 matmul and torch falls back to ATen's own, as an AVX2-only CPU does.
# (No float32 test reaches oneDNN: on the Sapphire Rapids, avx512-no-amx rounded every measured
# number as native did, so the tolerances an Ice Lake needs come from the other variants' spread.)
KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512-no-amx": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                      "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    # ATen's scalar kernels beside oneDNN's AMX path is no real CPU (bf16 matmuls then fail:
    # "pack_vnni2 is only supported when avx512 is supported"): oneDNN capped as on a CPU without AVX-512
    "aten-default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
}
KERNEL_VARIABLES = {"ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"}


def runnable_kernels() -> dict:
    """The variants of KERNELS this CPU can execute: forcing AVX-512 kernels on a CPU without AVX-512
    (an AMD Zen 3) kills the process (SIGILL), so a measurement there leaves that variant to a CPU that
    has it (the tolerances never shrink: what that CPU needed is kept)."""
    try:
        with open("/proc/cpuinfo") as f:
            avx512 = "avx512f" in f.read()
    except OSError:
        avx512 = True
    return {k: v for k, v in KERNELS.items() if avx512 or v.get("ATEN_CPU_CAPABILITY") != "avx512"}
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


# ----------------------------------------------------------------------------------------------
# Cross-path comparisons: two code paths, or a run and a committed number, that agree to rounding.

# Set (to a JSONL file) by `python -m tests.test_golden tolerances`: each `assert_rounding` appends
# its difference there instead of asserting, so one pytest run per kernel variant measures them all.
RECORD = "ROUNDING_RECORD"

# The tests whose `assert_rounding` calls the measurement runs, under every variant of KERNELS.
CROSS_PATH_TESTS = [
    "tests/test_analysis.py::test_query_response_nll_matches_separate_forwards",
    "tests/test_extensions.py::test_live_reference_is_the_cache_recomputed",
    "tests/test_extensions.py::test_a_reference_registered_from_outside_trains_and_resumes",
    "tests/test_extensions.py::test_a_reference_from_another_model_folder_defined_outside_the_repo",
    "tests/test_forward.py::test_fused_logprobs_match_float64_and_beat_bf16_logits",
    "tests/test_forward.py::test_fused_gradients_match_autograd_of_the_plain_formula",
    "tests/test_forward.py::test_entropy_gradient_from_logits_and_through_shared_prompts",
    "tests/test_lora.py::test_only_the_adapters_train_and_the_base_is_the_reference",
    "tests/test_lora.py::test_a_lora_run_folder_evaluates_and_its_damaged_export_is_rebuilt",
    "tests/test_losses.py::test_group_advantages_loop_equivalence",
    "tests/test_losses.py::test_proposition1_query_kl_gradient_ignores_responses",
    "tests/test_no_signal.py::test_countdown_from_the_math_warm_start_takes_no_step_and_does_not_drift",
    "tests/test_no_signal.py::test_no_signal_is_judged_on_the_rewards_for_every_algorithm",
    "tests/test_one_pass.py::test_refilled_and_compacted_slots_match_hf_generate",
    "tests/test_packing.py::test_packed_scores_and_gradients_are_the_padded_forwards",
    "tests/test_packing.py::test_one_packed_sequence_is_the_padded_forward",
    "tests/test_packing.py::test_flash_attn_gets_the_row_boundaries",
    "tests/test_references.py::test_released_zeros_is_k3_against_zeros",
    "tests/test_references.py::test_a_reference_read_from_another_model_folder",
    "tests/test_reliability.py::test_a_kill_anywhere_then_resume_gives_the_uninterrupted_metrics",
    "tests/test_reliability.py::test_sigint_stops_at_the_step_boundary_with_a_checkpoint_and_resume_reproduces",
    "tests/test_reliability.py::test_a_corrupt_checkpoint_falls_back_to_the_one_before",
    "tests/test_rollout.py::test_greedy_kv_matches_hf_and_unpadded",
    "tests/test_rollout.py::test_sampled_logprobs_match_recomputed",
    "tests/test_rollout.py::test_token_logprobs_values_entropy_and_grad",
    "tests/test_rollout.py::test_repeated_prompts_are_prefilled_once_and_sample_alike",
    "tests/test_rollout.py::test_top_p_restricts_to_nucleus",
    "tests/test_rollout.py::test_eos_masking_finished_and_truncation",
    "tests/test_rollout.py::test_lean_decode_step_matches_the_hf_forward",
    "tests/test_rollout.py::test_a_group_scores_its_prompt_once_with_the_same_values_and_gradients",
    "tests/test_rollout.py::test_trimmed_rows_score_like_the_full_width",
    "tests/test_scale.py::test_activation_checkpointing_gives_the_same_gradients",
    "tests/test_scale.py::test_sharded_loading_gives_the_single_process_logits",
    "tests/test_step_monitors.py::test_the_monitors_are_zero_in_float32_and_measure_a_known_gap",
    "tests/test_train.py::test_erpo_end_to_end_writes_metrics_and_learns",
    "tests/test_train.py::test_the_skipped_old_policy_forward_changes_nothing",
    "tests/test_train.py::test_bf16_mixed_on_cpu_trains",
    "tests/test_train.py::test_resume_continues_from_the_saved_step",
    "tests/test_train.py::test_two_processes_equal_one_over_the_same_global_batch",
    "tests/test_walkthrough.py::test_the_traced_step_is_the_metrics_line_train_py_writes",
]


def difference(got, want):
    """(max |got - want|, max |want|) over a number's, a list's or a tensor's elements, in float64;
    inf where a NaN appears or the shapes differ."""
    if any(hasattr(x, "detach") or isinstance(x, (list, tuple)) for x in (got, want)):
        import torch

        got, want = torch.as_tensor(got).detach().double(), torch.as_tensor(want).detach().double()
        if got.shape != want.shape:
            return math.inf, math.inf
        if got.numel() == 0:
            return 0.0, 0.0
        diff = (got - want).abs().max().item()
        return (math.inf if math.isnan(diff) else diff), want.abs().max().item()
    diff = abs(float(got) - float(want))
    return (math.inf if math.isnan(diff) else diff), abs(float(want))


def assert_rounding(name, got, want):
    """`got` (one code path's number or tensor) equals `want` (the other's) to within the measured
    tolerance of comparison `name` (tolerances.json's "paths"); with RECORD set, write the difference
    there instead (the measurement, which names the test it came from)."""
    diff, scale = difference(got, want)
    record = os.environ.get(RECORD)
    if record:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].split("[")[0]   # the function's id
        with open(record, "a") as f:
            f.write(json.dumps({"name": name, "diff": diff, "scale": scale, "test": test}) + "\n")
        return
    paths = load_tolerances().get("paths", {})
    assert name in paths, f"{name}: no tolerance measured; run python -m tests.test_golden tolerances"
    atol = paths[name]["atol"]
    assert diff <= atol, f"{name}: |difference| {diff:.3g} > tolerance {atol:.3g} (tests/golden/tolerances.json)"
