"""The batch geometry of an RL step: how many prompts per step, per rank, per optimizer step, and
how they split across ranks (which prompts a step takes: rl/experience.my_prompts). Checked and
printed at start-up (batch sizes are the most common confusion in the big frameworks).

    rollout batch (prompts / RL step) = k optimizer steps x update batch (prompts / optimizer step)
    each update batch is split evenly across the W ranks; each rank micro-batches its share
"""


from plumbing.errors import DataError


def check(a, world):
    """Sizes that must divide: an argparse-style one-line error otherwise."""
    if a.rollout_batch % a.update_batch:
        raise SystemExit(f"error: --rollout-batch {a.rollout_batch} must be a multiple of "
                         f"--update-batch {a.update_batch}")
    if a.update_batch % world:
        raise SystemExit(f"error: --update-batch {a.update_batch} must be divisible by "
                         f"the world size {world}")


def check_data(n, a):
    """At least one batch of usable examples (a DataError naming the file otherwise)."""
    sft = a.algo == "sft"
    need = a.sft_batch if sft else a.rollout_batch
    if n < need:
        raise DataError(f"{a.sft_data if sft else a.train_data}: {n} usable examples, fewer than one batch "
                        f"({'--sft-batch' if sft else '--rollout-batch'} {need}; lower it or add data)")


def describe(a, world, n_train) -> str:
    G, W = a.group_size, world
    return "\n".join([
        f"derived sizes (world size {W}):",
        f"  prompts / RL step          {a.rollout_batch} ({a.rollout_batch // W} per rank)",
        f"  responses / RL step        {a.rollout_batch * G} ({a.rollout_batch // W * G} per rank, G = {G})",
        f"  optimizer steps / RL step  {a.rollout_batch // a.update_batch} x {a.ppo_epochs} PPO epoch(s), "
        f"each on {a.update_batch} prompts = {a.update_batch * G} responses",
        f"  micro-batches / opt step   {-(-(a.update_batch // W * G) // a.micro_batch)} per rank"
        f" of <= {a.micro_batch} sequences",
        f"  RL steps                   {a.steps} ({a.steps * a.rollout_batch / n_train:.2f} epochs"
        f" of {n_train} prompts)",
    ])


def deal(tokens: list[int], world: int) -> list[list[int]]:
    """Whole groups dealt to `world` ranks by their cost (`tokens`, one entry per group), each rank
    the same number of them: longest first, each to the least-loaded rank that still has room (ties:
    the lower rank). -> each rank's group indices, in their original order. Every rank computes
    the same deal. The most and least loaded ranks end within the longest group's tokens of each
    other (tests/test_scale.py checks it on random costs): FSDP2's collectives in scoring and the
    update wait for the slowest rank, so a rank dealt the long responses would keep the rest idle."""
    if len(tokens) % world:
        raise ValueError(f"{len(tokens)} groups do not deal evenly to {world} ranks")
    per, load, mine = len(tokens) // world, [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        r = min((r for r in range(world) if len(mine[r]) < per), key=lambda r: load[r])
        load[r] += tokens[i]
        mine[r].append(i)
    return [sorted(m) for m in mine]


def prompt_group(a) -> int:
    """G where the training forwards run each group's prompt once (--share-prompts; see
    logprobs.shared_prompt_scores), else 1: FSDP2 would gather every layer for both of its forwards,
    and activation checkpointing recomputes layers without a KV cache."""
    return a.group_size if a.share_prompts and not (a.fsdp or a.grad_ckpt) else 1


def padded_width(lengths, rows) -> int:
    """Columns of a micro-batch of `rows`: its longest row, or where lengths are (prompt, response)
    pairs, its longest prompt plus its longest response (the [left-padded prompt | right-padded
    response] layout pads each side to its own longest)."""
    if isinstance(lengths[rows[0]], int):
        return max(lengths[i] for i in rows)
    return max(lengths[i][0] for i in rows) + max(lengths[i][1] for i in rows)


def forward_tokens(lengths, rows, packed=False) -> int:
    """Tokens one forward over `rows` runs: rows x padded_width, or packed (--pack: the rows' real
    tokens in one sequence, logprobs.packed_row_scores) their sum."""
    if packed:
        return sum(x if isinstance(x, int) else sum(x) for x in (lengths[i] for i in rows))
    return len(rows) * padded_width(lengths, rows)


def microbatch_plan(lengths: list, size: int, max_tokens: int = 0, count: int = 0,
                    group: int = 1, packed: bool = False) -> list[list[int]]:
    """Rows (indices into `lengths`: each row's tokens, or its (prompt, response) tokens) grouped
    into micro-batches, longest first, so each micro-batch pads only to its own longest rows: at
    most `size` rows and, if max_tokens, at most max_tokens tokens (`forward_tokens`: padded, or
    real when packed) each; a row longer than that goes alone. With count > the number of groups,
    the largest are halved until there are `count` (under FSDP2 every rank must run as many
    forwards: pass the most any rank needs). group > 1: the units are runs of `group` consecutive
    rows (a prompt's G responses), kept whole and in order (the shared-prompt forward: never packed)."""
    if group > 1 and packed:
        raise ValueError("packed forwards run full rows (group 1); shared prompts run padded")
    if group > 1:
        units = [range(i, i + group) for i in range(0, len(lengths), group)]
        longest = [_longest([lengths[i] for i in u]) for u in units]
        plan = microbatch_plan(longest, max(1, size // group), max_tokens // group, count)
        return [[g * group + j for g in mb for j in range(group)] for mb in plan]
    total = [x if isinstance(x, int) else sum(x) for x in lengths]
    order = sorted(range(len(lengths)), key=lambda i: -total[i])  # stable: ties keep row order
    plan, cur = [], []
    for i in order:
        too_wide = max_tokens and forward_tokens(lengths, cur + [i], packed) > max_tokens
        if cur and (len(cur) == size or too_wide):
            plan.append(cur)
            cur = []
        cur.append(i)
    plan += [cur] if cur else []
    while len(plan) < count:
        j = max(range(len(plan)), key=lambda k: len(plan[k]))
        if len(plan[j]) < 2:
            raise ValueError(f"cannot split {len(lengths)} rows into {count} micro-batches")
        plan[j:j + 1] = [plan[j][:len(plan[j]) // 2], plan[j][len(plan[j]) // 2:]]
    return plan


def _longest(lengths):
    """A group's widths: its longest row, or its longest prompt and longest response."""
    if isinstance(lengths[0], int):
        return max(lengths)
    return (max(p for p, _ in lengths), max(r for _, r in lengths))
