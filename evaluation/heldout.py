"""Sampling held-out problems: the held-out accuracy logged during training, and the named,
seeded samples evaluate.py (and the NLL study of analysis.py) grade.

During training: one sample per problem at a fixed temperature, graded by reward.py, logged as
eval_acc/<set> and eval_acc/<set>/L<level> (the paper's Tables 4-5 compare it with the training
accuracy). The full protocol (temperature grid, n samples, pass@k) is evaluate.py.

The two sampling scripts also share their command line here: the flags (add_sampling_args), the
checks of their values (check_sampling_args) and of the models (model_source): both refuse the
same bad input the same way, before writing. (What Ctrl-C and SIGTERM do: plumbing/interrupts.py.)
"""

import math
import os
import re
from collections import Counter

import torch
from safetensors import SafetensorError

from modeling import lora
from modeling import models
import reward
import rollout
import tasks
from data.benchmarks import benchmark_label, expand_benchmarks, load_benchmark
from data.prompts import TEMPLATES, PromptSet, check_positions, encode_prompts
from plumbing import checkpoints, distributed, errors


def add_sampling_args(p, *, benchmarks, out, out_help="output folder",
                      model_help="HF model folder(s) (or hub ids)"):
    """The flags evaluate.py and `analysis.py nll` share (models, problems, how to sample), defined
    once."""
    add = p.add_argument
    add("--model", nargs="+", required=True, help=model_help)
    add("--labels", nargs="+", help="names for the models in tables (default: paths)")
    add("--benchmarks", nargs="+", default=benchmarks,
        help="names (tiny, tiny-test, paper, aime24, math500, ...) or .jsonl paths")
    add("--data-dir", default=None,
        help="local copies of the hub benchmarks (aime2024.jsonl, math500.jsonl, ...); "
             "default $ERPO_DATA_DIR")
    add("--limit", type=int, default=None, help="first N problems of each benchmark")
    add("--top-p", type=float, default=1.0)
    add("--max-new-tokens", type=int, default=None,
        help="default: --task's own, else 3072 for --template paper, 256 for plain (the tiny world)")
    add("--template", choices=TEMPLATES, default=None,
        help="prompt template; must match the one the model was trained with (default: --task's, else plain)")
    add("--batch-size", type=int, default=64, help="sequences decoded at once")
    add("--sampler", choices=["kv", "hf"], default="kv")
    add("--seed", type=int, default=0, help="salt of the per-sample seeds")
    add("--device", default="auto")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add("--grade-timeout", type=float, default=1.0, help="seconds per graded answer")
    add("--task", choices=tasks.TASKS, default="math",
        help="how completions of sets no task owns are scored (a task's own sets, e.g. countdown-test, "
             "are scored by it)")
    add("--extensions", nargs="*", default=[],
        help="modules imported first, as train.py's --extensions (a task of one's own: its sets, template "
             "and lengths)")
    add("--out", default=out, help=out_help)
    add("--no-progress", action="store_true")


def model_keys(args):
    """The name each model is stored under (--labels, else the path as given)."""
    return args.labels or [os.path.normpath(m) for m in args.model]


def looks_like_hub_id(path):
    """org/name with no local meaning: let load_policy try the hub (on machines that have it)."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", path)) and not path.startswith(".") \
        and not os.path.exists(path.split("/")[0])


def check_sampling_args(args):
    """The values of the shared flags, checked before anything is loaded or written: ValueError
    with a one-line message (the script names itself) for the first that means nothing. --template
    and --max-new-tokens not given: --task's own (Task.template, Task.max_new_tokens), where it has them."""
    task = tasks.get(args.task)
    args.template = args.template or task.template or "plain"
    if args.max_new_tokens is None:
        args.max_new_tokens = task.max_new_tokens
    for m in args.model:
        if not os.path.exists(m) and not looks_like_hub_id(m):
            raise ValueError(f"model path not found: {m}")
    if args.labels and len(args.labels) != len(args.model):
        raise ValueError(f"--labels needs one name per --model ({len(args.model)}), got {len(args.labels)}")
    twice = [key for key, count in Counter(model_keys(args)).items() if count > 1]
    if twice and args.labels:
        raise ValueError(f"--labels gives two models the name {twice[0]!r}: each needs its own")
    if twice:
        raise ValueError(f"--model {twice[0]} is given twice (both would be stored under one name); "
                         "drop one, or name them with --labels")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1 (leave it out for every problem), got {args.limit}")
    if not 0 < args.top_p <= 1:                               # (nan fails too)
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not (math.isfinite(args.grade_timeout) and args.grade_timeout > 0):
        raise ValueError(f"--grade-timeout must be a finite number of seconds > 0, got {args.grade_timeout}")
    if args.device != "auto":
        try:
            torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device {args.device!r} is not a device (auto, cpu, cuda, cuda:1)") from None
    why = out_dir_problem(args.out)
    if why:
        raise ValueError(why)


def out_dir_problem(out):
    """Why `out` cannot become the output folder (a file, or a folder that cannot be written or
    made), or None. Nothing is created: a command refused later leaves no folder behind."""
    if os.path.exists(out):
        if not os.path.isdir(out):
            return f"--out {out} is a file, not a folder"
        if not os.access(out, os.W_OK | os.X_OK):
            return f"--out {out} is a folder that cannot be written"
        return None
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):                         # the folder makedirs would create it in
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"--out {out} cannot be made: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {out} cannot be made: {parent} cannot be written"
    return None


def first_line(error) -> str:
    """An exception's message as one line of a script's error (its type's name if it has none)."""
    return (str(error).splitlines() or [type(error).__name__])[0]


def model_source(path) -> checkpoints.ModelSource:
    """What a --model stands for (checkpoints.find_model), the tokenizer of a local one loaded once to
    be sure it can be: before anything is written, or minutes of loading a model that then fails.
    ValueError with one line otherwise (a folder holding no model, a model folder without its
    tokenizer). A hub id is left to the loader: a finished sweep rewrites its tables offline."""
    try:
        src = checkpoints.find_model(path)
    except SystemExit as e:                                   # find_model's one line, as this script's
        raise ValueError(str(e.code).removeprefix("error: ")) from None
    if not os.path.isdir(src.model):
        return src
    try:
        models.load_tokenizer(src.model)
    except (OSError, ValueError) as e:
        why = first_line(e)
        raise ValueError(why if src.model in why else f"--model {path}: {why}") from None   # (named once)
    return src


def load_model(path, device="cpu", dtype=None):
    """(model, tokenizer) of a --model: an HF folder or hub id, a run folder, or any checkpoint
    (checkpoints.find_model); the sharded checkpoint of an FSDP2 run is the run's initial model
    (architecture, tokenizer, generation config: what train.py resumes such a checkpoint on) with
    the checkpoint's weights (a LoRA run's: its adapters merged), in `dtype` (models.load_policy's).
    (The initial weights are read once and overwritten: a few seconds of disk at 7B, against hours
    of sampling.) Files that looked like a model but do not load (a truncated safetensors, a broken
    config.json, a hub id offline): ValueError with one line naming the --model."""
    src = checkpoints.find_model(path)
    try:
        model, tokenizer = models.load_policy(src.model, device=device, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as e:
        raise ValueError(f"cannot load model {path!r}: {first_line(e)}") from None
    if src.dcp:
        checkpoints.load_sharded_weights(model, src.dcp)
    if src.adapters:                                          # a LoRA run's checkpoint: merged
        model = lora.merge_adapters(model, src.adapters)
    return model, tokenizer


def default_max_new_tokens(template) -> int:
    """The paper's 3,072-token budget for its template; the tiny world's answers fit in 256."""
    return 3072 if template == "paper" else 256


def check_fits(model, evalsets: dict[str, PromptSet], max_new_tokens, flag="--max-new-tokens",
               what="held-out set"):
    """Every prompt of every set plus max_new_tokens within the model's positions
    (config.max_position_embeddings), or DataError naming the set, the count, the longest prompt and
    what to lower. Call it before any sampling, on every rank (the same sets: all ranks stop)."""
    limit = getattr(distributed.unwrap(model).config, "max_position_embeddings", None)
    for name, ps in evalsets.items():
        check_positions(f"{what} {name}", ps.ids, max_new_tokens, limit, flag)


@torch.no_grad()
def heldout_accuracy(model, tokenizer, evalsets: dict[str, PromptSet], spec: rollout.SampleSpec,
                     temperature, seed) -> dict:
    """-> {"eval_acc": acc on the first set, "eval_acc/<name>": ...,
           "eval_acc/<name>/L<level>": ...}.
    Every rank must call it (an FSDP2 policy is gathered once for decoding, a collective).
    A prompt that does not fit the model's positions with spec.max_new_tokens: one-line exit."""
    with errors.one_line():
        check_fits(model, evalsets, spec.max_new_tokens)
    out = {}
    with distributed.gathered(model, spec.weights_dtype) as decoder:
        for si, (name, ps) in enumerate(evalsets.items()):
            mine, n_mine = distributed.strided_share(len(ps))
            local = []
            if mine:
                ro = rollout.sample_with(decoder, [ps.ids[i] for i in mine], spec, temperature=temperature,
                                         seeds=[rollout.row_seed(seed, 99, si, i) for i in mine])
                _, scores, _ = tasks.score_rows(rollout.decode_responses(tokenizer, ro),
                                                [ps.rows[i] for i in mine])
                local = [(ps.rows[i].get("level"), s) for i, s in zip(mine, scores)][:n_mine]
            res = distributed.all_gather_list(local)
            out[f"eval_acc/{name}"] = sum(s for _, s in res) / len(res)
            for lv in sorted({lv for lv, _ in res if lv is not None}):
                sel = [s for l_, s in res if l_ == lv]
                out[f"eval_acc/{name}/L{lv}"] = sum(sel) / len(sel)
    if evalsets:
        out["eval_acc"] = out[f"eval_acc/{next(iter(evalsets))}"]
    return out


def heldout_at_temperatures(model, tokenizer, evalsets, spec, temperatures, seed) -> dict:
    """heldout_accuracy at each of `temperatures` (train.py's --eval-temperatures): the first's keys
    as they are (eval_acc, eval_acc/<name>, ...); with more than one, every temperature's also as
    eval_acc@T<t>, eval_acc@T<t>/<name>, ... (t as %g: 0.4, 1, 1.2). Every temperature samples with
    the same per-problem seeds, so the curves differ by the temperature, not by the noise."""
    out = {}
    for i, t in enumerate(temperatures):
        acc = heldout_accuracy(model, tokenizer, evalsets, spec, t, seed)
        if i == 0:
            out.update(acc)
        if len(temperatures) > 1:
            out.update({f"eval_acc@T{t:g}{k[len('eval_acc'):]}": v for k, v in acc.items()})
    return out


def generate_samples(model, tokenizer, problems, temperature, sample_indices, *, benchmark, template,
                     max_new_tokens, top_p=1.0, batch_size=None, seed=0, sampler="kv"):
    """Sample the responses (problem, i) for i in sample_indices[problem id]; no grading. The
    seed of a sample is row_seed(salt, benchmark, problem id, temperature, i): it depends only on
    what the sample is, never on batching, order or which model, so resumed and re-run
    evaluations draw the same samples and every model sees the same noise.

    Returns one dict per sample: id, sample, completion, num_tokens, finished, plus the Rollout
    (rows in the same order) for callers that need token ids (the NLL analysis).
    """
    eos = rollout.eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    rows, prompts, seeds = [], [], []
    for p, ids in zip(problems, encode_prompts(tokenizer, problems, template)):
        for i in sample_indices[p["id"]]:
            rows.append((p["id"], i))
            prompts.append(ids)
            seeds.append(rollout.row_seed(seed, benchmark, str(p["id"]),
                                          f"{round(float(temperature), 6):g}", i))
    ro = rollout.sample(model, prompts, max_new_tokens=max_new_tokens, eos_ids=eos, pad_id=pad,
                        temperature=temperature, top_p=top_p, seeds=seeds, sampler=sampler,
                        batch_size=batch_size)
    out = []
    for (pid, i), r_ids, r_mask, fin in zip(rows, ro.response_ids.tolist(), ro.response_mask.tolist(),
                                            ro.finished.tolist()):
        toks = [t for t, m in zip(r_ids, r_mask) if m]
        out.append({"id": pid, "sample": i, "completion": tokenizer.decode(toks, skip_special_tokens=True),
                    "num_tokens": len(toks), "finished": bool(fin)})
    return out, ro


def load_sets(names, limit=None, data_dir=None, task="math") -> dict:
    """{label: normalized rows} of evaluate.py's and analysis.py's --benchmarks (groups like "tiny"
    expanded), each row read by its task as it is loaded: a task's own set by that task, any other
    by --task (tasks.read_by). A bad name, file or row (named by its line): DataError; two sets of one
    label: ValueError."""
    sets = {}
    for name in expand_benchmarks(names):
        rows = load_benchmark(tasks.source_of(name), limit=limit, data_dir=data_dir,
                              read_row=tasks.read_by(name, task))
        label = benchmark_label(name)
        if label in sets:
            raise ValueError(f"two benchmarks are both called {label!r}; rename one of the files")
        sets[label] = rows
    return sets


def grade(completions, rows, timeout=reward.DEFAULT_TIMEOUT):
    """-> (correct: list[bool], extracted answers: list[str|None]), accuracy only, each completion
    by its row's task (tasks.score_rows)."""
    _, correct, _ = tasks.score_rows(completions, rows, timeout)
    return correct, [reward.extract_boxed(c) for c in completions]
