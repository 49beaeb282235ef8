"""The one extension pattern: every extension point is a table, a dict from the name a flag chooses
to a row, in the module of its concept --

    losses.ADVANTAGES    --adv          how a group's rewards become advantages
    losses.SURROGATES    --surrogate    the policy-gradient surrogate
    controllers.CONTROLLERS  (own options)  a per-step rule for a loss coefficient (rl/controllers.py;
                                        --entropy-target): a class, on by its options, made per run
    query_reference.REFERENCES  --qkl-ref   whose prompt log-probs Query-KL compares with
    tasks.TASKS          --task         what a row asks and how a completion is scored

-- and a change from outside the repo is one row, added with one call:

    extension.register(losses.ADVANTAGES, "mine", MyAdvantage(...))

in a module of its own that train.py imports before it reads the options (`--extensions mine.py` or
a dotted module name; config.json records them, and --resume imports them again: `load`). Two more
tables take rows the same way: losses.KL_ESTIMATORS (--kl, --qkl-estimator: a function of log r)
and rl/experience.SHAPING (--shaping: a reward-shaping term that sees the graded rollout and logs
its own metrics).

A row may declare, next to what it does (each attribute optional; absent means none):

    doc       one line for --help
    OPTIONS   options of its own, rows as train.py's OPTIONS (name, default, help[, choices]); they
              become flags, and act only where the row is chosen: given for another row, an error
              (the inertness rule beside the knob). knobs: the losses.Algo fields it reads, where
              the table's rows share Algo's knobs (surrogates, advantages)
    needs     what it needs from the run: "model" (a model of its own loaded for it; the reference
              model), "prompt_ids" (the training prompts' token ids)
    state_dict() / load_state_dict(state)   per-step state: the checkpoint saves it under the
              table's name and --resume restores it (the framework does; the row does not)
    after_step(...)   a per-step hook, called once per RL step after the update (a controller's:
              with the step's metrics; it sets Algo field `knob` to value() for the next step)

losses.py stays torch-only: its rows follow the pattern by these attribute names, they do not
import this file.
"""

import argparse
import dataclasses
import importlib
import json
import importlib.util
import os
import sys

# Tables by the option that chooses their row ("controllers" rows act when their own options switch
# them on), declared by train.py (losses.py, which owns two of them, never imports this file).
TABLES: dict[str, dict] = {}


def declare(option: str, table: dict) -> dict:
    """Make `table` an extension table chosen by --`option` (its module calls this once)."""
    TABLES[option] = table
    return table


def register(table: dict, name: str, row, *, replace: bool = False):
    """Add `row` to `table` under `name` -> the row. A name already there is an error unless
    replace=True; so is a row that lacks what its table reads (`malformed`), or an option name another
    row of any declared table already declares. (The parser asks `check_rows` again once every table
    is declared: a row registered before its table was declared is checked there.)"""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an extension's name is a non-empty string, got {name!r}")
    if name in table and not replace:
        raise ValueError(f"{name!r} is already a row of this table (replace=True to replace it)")
    why = malformed(table_option(table), row)
    if why:
        raise ValueError(f"{_row(table, name)}: {why}")
    mine = _options_of(row)
    for t in TABLES.values():
        for n, r in t.items():
            if not (t is table and n == name):
                for opt in _options_of(r):
                    if opt[0] in {o[0] for o in mine} and opt not in mine:
                        raise ValueError(_both(table, name, t, n, opt[0]))
    table[name] = row
    return row


# What a row of each table must have, beyond the optional attributes of the module docstring: the
# table's option -> (attribute ("" = the row itself), what it is), each called or read at step 1
REQUIRED = {
    "adv": [("fn", "a function of losses.AdvantageInputs -> (n_groups, G) advantages")],
    "surrogate": [("fn", "a function (logp, old_logp, advantages, mask, algo) -> losses.Surrogate"),
                  ("stats", "the names of the statistics fn returns")],
    "kl": [("", "a function of log r")],
    "controllers": [("", "a class made per run as row(options, algo)"), ("is_on", "is_on(options)"),
                    ("value", "value()"), ("after_step", "after_step(metrics)"),
                    ("knob", "the Algo field it sets")],
    "qkl_ref": [("build", "build(ctx) -> the reference"), ("prompt_logp", "prompt_logp(batch)")],
    "task": [("score", "score(completion, row) -> tasks.Scored")],
    "shaping": [("", "a function (graded, run) -> (rewards, metrics)")],
}
NEEDS = {"model", "prompt_ids"}                 # what a row may need from the run (module docstring)
CALLED = {"fn", "", "is_on", "value", "after_step", "build", "prompt_logp", "score"}


def malformed(option: str | None, row) -> str | None:
    """What is wrong with `row` as a row of the table chosen by --`option` (None: nothing, or a table
    not declared yet), in a few words naming the attribute."""
    for attr, what in REQUIRED.get(option, ()):
        value = getattr(row, attr, None) if attr else row
        if value is None or (attr in CALLED and not callable(value)):
            return f"it has no {attr or 'call'} ({what})" if attr else f"it is not callable ({what})"
    if not isinstance(getattr(row, "doc", ""), str):
        return f"its doc is {row.doc!r}, not one line of text"
    unknown = set(getattr(row, "needs", ())) - NEEDS
    if unknown:
        return f"its needs {sorted(unknown)} are not among {sorted(NEEDS)}"
    for opt in getattr(row, "OPTIONS", ()):
        why = _bad_option(opt)
        if why:
            return f"its option {opt!r} {why}"
    return None


def _bad_option(opt) -> str | None:
    if not isinstance(opt, (tuple, list)) or not 3 <= len(opt) <= 7:
        return "is not a row (name, default, help[, choices])"
    name, _default, help_ = opt[:3]
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        return "needs a lowercase name with _ (its flag: --name-with-dashes)"
    if not isinstance(help_, str):
        return "needs a help text (its third field)"
    return None


def check_rows(flags: set, script: str = "the entry script") -> str | None:
    """Every row of every declared table as the parser meets them (one line, or None): each row
    well formed (`malformed`), no option declared by two rows with other meanings, and none named
    like a flag of the entry script's own (`flags`: its options' and the loss knobs' names; such a
    row would silently read that flag: an advantage row's "lr" reads --lr)."""
    seen = {}
    for option, table in TABLES.items():
        for name, row in table.items():
            why = malformed(option, row)
            if why:
                return f"{_row(table, name)}: {why}"
            for opt in _options_of(row):
                if opt[0] in flags:
                    return (f"{_row(table, name)}: its option {opt[0]!r} is {script}'s own "
                            f"--{opt[0].replace('_', '-')} (the row would read that flag); rename it")
                other = seen.setdefault(opt[0], (table, name, opt))
                if other[2] != opt:
                    return _both(*other[:2], table, name, opt[0])
    return None


def table_option(table: dict) -> str | None:
    """The option that chooses `table`'s rows (None: not declared)."""
    return next((option for option, t in TABLES.items() if t is table), None)


def _row(table, name) -> str:
    option = table_option(table)
    return f"extension row {name!r}" + (f" of --{option.replace('_', '-')}" if option else "")


def _both(table, name, other_table, other, option) -> str:
    return (f"{_row(table, name)} and {_row(other_table, other)} both declare the option {option!r}, "
            "each its own (one flag would set both); rename one of them")


def _options_of(row) -> list:
    return [tuple(opt) if isinstance(opt, list) else opt for opt in getattr(row, "OPTIONS", ())]


def unregister(table: dict, name: str):
    """Remove a row (a test's extension, once the test is done)."""
    table.pop(name, None)


def own_options(table: dict | None = None) -> list:
    """The option rows every row of `table` (default: of every table) declares, each once."""
    tables = [table] if table is not None else list(TABLES.values())
    seen, out = set(), []
    for t in tables:
        for row in t.values():
            for opt in getattr(row, "OPTIONS", ()):
                if opt[0] not in seen:
                    seen.add(opt[0])
                    out.append(opt)
    return out


def inert_options(table: dict, chosen, given: set) -> set:
    """The options of `table`'s rows other than the `chosen` one(s) among `given` (set on the
    command line): they cannot act, which is an error."""
    chosen = {chosen} if isinstance(chosen, str) else set(chosen)
    own = {opt[0] for name in chosen if name in table for opt in getattr(table[name], "OPTIONS", ())}
    return {opt[0] for opt in own_options(table)} & set(given) - own


def option_values(row, args) -> dict:
    """{option: value} of the row's own options in the parsed `args` (their defaults where absent)."""
    return {opt[0]: getattr(args, opt[0], opt[1]) for opt in getattr(row, "OPTIONS", ())}


def switched_on(table: dict, args) -> list:
    """The names of the rows of a table of per-step rules (rl/controllers.py) that args switch on."""
    return [name for name, row in table.items() if row.is_on(option_values(row, args))]


def start(table: dict, args, *context) -> dict:
    """{name: row(its options, *context)}: each switched-on rule, made once for this run."""
    return {name: table[name](option_values(table[name], args), *context)
            for name in switched_on(table, args)}


def steer(algo, rules: dict):
    """`algo` (a frozen dataclass) with the field each active rule sets (rule.knob) at its value now."""
    return dataclasses.replace(algo, **{r.knob: r.value() for r in rules.values()}) if rules else algo


def after_step(rules: dict, metrics: dict) -> dict:
    """The step's metrics with the value each rule gave this step (under its knob's name); then each
    rule moves from those metrics (after_step) for the next step."""
    used = {r.knob: r.value() for r in rules.values()}
    for r in rules.values():
        r.after_step(metrics)
    return {**metrics, **used}


def owner(table: dict, option: str) -> str:
    """The name of the row of `table` that declares `option`."""
    return next(name for name, row in table.items() if option in {o[0] for o in getattr(row, "OPTIONS", ())})


def needs(row) -> frozenset:
    return frozenset(getattr(row, "needs", ()))


def state_of(rows: dict) -> dict:
    """{name: row.state_dict()} of the rows that keep state (what a checkpoint saves)."""
    return {name: row.state_dict() for name, row in rows.items() if hasattr(row, "state_dict")}


def load_state(rows: dict, saved: dict | None):
    """Restore what state_of saved (a row absent from `saved` starts fresh)."""
    for name, row in rows.items():
        if saved and name in saved and hasattr(row, "load_state_dict"):
            row.load_state_dict(saved[name])


def load(name: str):
    """Import an extension module (--extensions): a dotted module name on the path, or a .py file
    (imported once per process, under a name of its own). A module that does not import ends the
    command in one line, naming it."""
    try:
        if not name.endswith(".py"):
            importlib.import_module(name)
            return
        path = os.path.abspath(name)
        key = "erpo_extension_" + "".join(c if c.isalnum() else "_" for c in path)
        if key in sys.modules:                                           # (train.main called again)
            return
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    except (ImportError, OSError, SyntaxError, ValueError, AttributeError, TypeError, NameError) as e:
        raise SystemExit(f"error: --extensions {name}: {type(e).__name__}: {e}") from None


def load_named(argv):
    """Import the extensions a command names (--extensions), before its parser is built: their rows
    add choices and options. Where the command names none: its --config file's, or on --resume the
    run's own (config.json in --out, by default runs/<algo>)."""
    pre = argparse.ArgumentParser(add_help=False)
    for flag, kw in (("--extensions", dict(nargs="*")), ("--config", {}), ("--out", {}), ("--algo", {}),
                     ("--resume", dict(nargs="?", const="true"))):
        pre.add_argument(flag, **kw)
    ns, _ = pre.parse_known_args(argv)
    names = ns.extensions
    if names is None and ns.config:
        names = _saved(ns.config)
    if names is None and ns.resume not in (None, "false"):
        names = _saved(os.path.join(ns.out or os.path.join("runs", ns.algo or "erpo"), "config.json"))
    for name in names or []:
        load(name)


def _saved(path) -> list | None:
    """The "extensions" a JSON config names (None: none, or unreadable: the options' checks say so)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved.get("extensions") if isinstance(saved, dict) else None
