"""The optimizer: AdamW; gradient clipping and the step as the step at scale (rl/scale_step.py) and
the SFT warm start take them (train.rl_step calls torch's directly); what a resumed run changes.

The RL run's LR schedule is train.py's (lr_factor): a linear warm-up, then constant or decaying.
Constant after warm-up by default, on purpose: every prefix of a run is itself a run, so a resumed
or shortened run is the same run, and the SFT warm start's length can be picked from one curve.
`--lr-schedule linear|cosine` decays it instead (the released ERPO recipe: linear to 0), over
--lr-decay-steps RL steps, by default (0) the run's --steps.

The default horizon follows --steps on --resume too: a run of 4 steps resumed to 8 decays over 8
from the resumed step on. Extending a run means training it longer, and the other reading -- keep
the old horizon -- trains every added step at lr 0 (AdamW then changes nothing), which no one asks
for. The price: the lr goes back up at the resumed step (from the short schedule's end to the long
one's value there), so the run is not the same as one started with --steps 8; the resume line says
that the horizon changed. A horizon the user gives (--lr-decay-steps) is kept; one that ends before
--steps with --lr-floor 0 is refused (check_horizon).
"""

import torch


def adamw(model, lr, weight_decay, betas=(0.9, 0.999), foreach=None):
    """AdamW over the trainable parameters (all of them, or a LoRA run's adapters). foreach None:
    torch's choice (the multi-tensor kernels on CUDA, whose temporaries are as large as the optimizer
    state; a loop over parameters on CPU). memory_measure passes True to measure on a CPU what a GPU
    allocates."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, foreach=foreach)


def warmup_then_constant(opt, warmup_steps):
    """SFT's schedule (and the memory measurement's): the LR multiplier (s + 1) / warmup for the
    first `warmup_steps` optimizer steps, then 1. The RL run's, which may also decay, is
    train.lr_factor."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps
                                             else 1.0)


def clip_grad(model, max_norm) -> torch.Tensor:
    """Clip to max_norm (<= 0: no clipping) and return the pre-clip global grad norm, a 0-d tensor
    (read it on the host once, with the step's other scalars: distributed.read_scalars)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor under FSDP2


def step(opt, sched):
    """Apply the accumulated gradient, advance the schedule, zero the gradients -- and drop
    autocast's cached bf16 copies of the weights. Within one autocast region torch casts each float32
    parameter once and reuses that copy until the outermost region exits; the in-place update does
    not invalidate it, so without this every forward after the first step of a region (the training
    loop runs in one) would still see the weights of before the step.

    The step under autocast (rl/scale_step.py: bf16 is a fast path) also clears it before each
    micro-batch's forward, for memory: autograd runs a backward node later the earlier its forward was
    made, so a cast reused from an earlier forward (the rollout's, an earlier micro-batch's) runs its
    backward last, and every layer's bf16 weight gradient waits for it to the end of the backward
    (2.6 GiB at 1.5B). A cast made in the micro-batch's own forward runs its backward right after its
    layer's and frees that gradient. Re-casting costs one read of the weights per micro-batch."""
    opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
    torch.clear_autocast_cache()


def set_hyperparameters(opt, sched, lr, weight_decay):
    """A resumed run's --lr and --weight-decay, over the ones its optimizer and scheduler state
    brought back (load_state_dict restores both, and LambdaLR's base_lrs is the old lr): the
    schedule's position is kept, its base becomes `lr`."""
    sched.base_lrs = [lr] * len(opt.param_groups)
    for group, lmbda in zip(opt.param_groups, sched.lr_lambdas):
        group["initial_lr"], group["weight_decay"] = lr, weight_decay
        group["lr"] = lr * lmbda(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in opt.param_groups]


def check_horizon(parsed):
    """A decaying schedule's horizon is --lr-decay-steps, or (0) --steps itself: a run extended on
    --resume then decays over its new length (optimizer.py says why). A horizon given that ends
    before --steps with --lr-floor 0 leaves the steps after it at lr 0, where AdamW changes nothing
    (its weight decay is scaled by the lr too): refused, rather than steps that do not train."""
    a = parsed.args
    if a.lr_schedule != "constant" and 0 < a.lr_decay_steps < a.steps and a.lr_floor == 0:
        whose = "" if "lr_decay_steps" in parsed.cli | parsed.config_keys else " (the run's, config.json)"
        parsed.error(f"--lr-decay-steps {a.lr_decay_steps}{whose} < --steps {a.steps} with --lr-floor 0: the "
                     f"{a.lr_schedule} LR schedule reaches 0 at step {a.lr_decay_steps}, so steps "
                     f"{a.lr_decay_steps + 1}-{a.steps} would not train; give --lr-decay-steps {a.steps} "
                     "(or 0: --steps), or --lr-floor > 0")
