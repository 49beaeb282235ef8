"""Per-step rules for a loss coefficient: the table CONTROLLERS (method.md §8.7). losses.py's terms
are functions of one micro-batch; a rule here keeps state across RL steps -- a coefficient it moves
from each step's metrics -- so it lives with the RL loop.

A row is a class, switched on by its own options (is_on; its options are inert otherwise) and made
once per run (row(options, algo)). Each RL step's loss uses value() as the losses.Algo field `knob`,
and after_step(metrics) moves it for the next step; plumbing/extension.py applies every active row
(steer, after_step), and the checkpoint saves its state_dict (--resume restores it). A new rule is
one class and one row: extension.register(controllers.CONTROLLERS, name, TheClass). A row may have
check(options, algo) -> why its options cannot run as given (or None); `refusal` asks every active
row, for the parser to call before anything is claimed, and the row refuses again when it is made.
"""

from plumbing import extension


def adaptive_coef(coef, entropy, target, delta, cap):
    """Skywork-OR1's adaptive entropy control (He et al., "Skywork Open Reasoner 1 Technical Report",
    arXiv:2505.22312, "adaptive entropy control"): the coefficient moves by a fixed delta, up when the
    step's entropy is below the target, down when above, clipped to [0, cap]:
        c_{k+1} = clip(c_k + delta * sign(target - H_k), 0, cap)."""
    step = delta if entropy < target else -delta if entropy > target else 0.0
    return min(max(coef + step, 0.0), cap)


class AdaptiveEntropy:
    """Algo.entropy_coef (--entropy-coef: its start) steered toward a target entropy of the rollout
    policy's response tokens (`entropy` in metrics.jsonl, the same on every rank)."""
    doc = "adaptive entropy coefficient (Skywork-OR1), on with --entropy-target > 0"
    OPTIONS = [("entropy_target", 0.0, "adaptive entropy control (Skywork-OR1, method.md §8.7): the token "
                "entropy the entropy coefficient steers toward, in nats (0 = off)", ">=0"),
               ("entropy_coef_delta", 0.005, "adaptive entropy control: the coefficient's change per RL step",
                ">0"),
               ("entropy_coef_max", 0.05, "adaptive entropy control: the coefficient's upper bound", ">0")]
    knob = "entropy_coef"

    def __init__(self, options, algo):
        why = self.check(options, algo)
        if why:                                   # (never a silent clip: the run trains at what it printed)
            raise SystemExit(f"error: {why}")
        self.target, self.delta = options["entropy_target"], options["entropy_coef_delta"]
        self.cap = options["entropy_coef_max"]
        self.coef = algo.entropy_coef

    @staticmethod
    def check(options, algo) -> str | None:
        """A start above the bound would be clipped to it at once: the run would train at another
        coefficient than --entropy-coef and config.json say (issue #50: 0.1 ran at 0.05)."""
        cap = options["entropy_coef_max"]
        if algo.entropy_coef > cap:
            return (f"--entropy-coef {algo.entropy_coef} is above --entropy-coef-max {cap}, the bound of "
                    f"adaptive entropy control (--entropy-target {options['entropy_target']}), which would "
                    f"clip it: give --entropy-coef-max {algo.entropy_coef} or more, or "
                    f"--entropy-coef <= {cap}")
        return None

    @staticmethod
    def is_on(options) -> bool:
        return options["entropy_target"] > 0

    def value(self) -> float:
        return self.coef

    def after_step(self, metrics):
        self.coef = adaptive_coef(self.coef, metrics["entropy"], self.target, self.delta, self.cap)

    def state_dict(self):
        return {"coef": self.coef}

    def load_state_dict(self, state):
        self.coef = float(state["coef"])


CONTROLLERS: dict[str, type] = {"adaptive-entropy": AdaptiveEntropy}


def refusal(args, algo) -> str | None:
    """Why the rules `args` switch on cannot run with their options (each row's check), or None:
    for train.py's parser, before anything is claimed."""
    for name in extension.switched_on(CONTROLLERS, args):
        check = getattr(CONTROLLERS[name], "check", None)
        why = check(extension.option_values(CONTROLLERS[name], args), algo) if check else None
        if why:
            return why
    return None
