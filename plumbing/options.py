"""Command-line options from one table, plus the loss knobs generated from `losses.Algo`.

An entry script writes each option exactly once, as a row (name, default, help[, choices or a
range like ">=1" or "(0,1]"]); the flag is --name-with-dashes, its type comes from the default.
Every field of `losses.Algo` becomes a flag too (--adv, --kl, --weight-clip, ...): unset, it keeps
the chosen algorithm's own value. A JSON --config file sets defaults (same keys); flags given on
the command line override it, and its loss knobs apply only to the algorithm it names
(`resolve_knobs`). Every float, wherever it comes from, must be finite (`finite_float`).
"""

import argparse
import json
import math
import os
import re
from typing import NamedTuple
from dataclasses import MISSING, dataclass, field, fields, replace

import torch

import losses
from plumbing import errors, extension
from plumbing.distributed import print0


def parse_bool(s):
    if str(s).lower() in ("1", "true", "yes", "on"):
        return True
    if str(s).lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def finite_float(text):
    """The argparse type of every float option (table rows, loss knobs, pairs, config values):
    a float that is not nan or +-inf. A nan passes every range check (nan >= 0 and nan < 0 are
    both False), so `--alpha nan` would switch the Query-KL term off without a word; and no
    option here means infinity (a coefficient, a learning rate, a temperature: none has a "no
    limit" value), so inf is refused without advice on what to give instead."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(x) or math.isinf(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return x


def _value_type(kind):
    """The argparse type of a flag whose table default is of type `kind`."""
    return finite_float if kind is float else kind


def _is_float_pair(default):
    """A (lo, hi) default such as losses.Algo.weight_clip: a flag of two numbers."""
    pair = isinstance(default, (list, tuple)) and len(default) == 2
    return pair and all(isinstance(x, float) for x in default)


# The rules an option's row may state (train.OPTIONS' columns after the parser's)
FIXED, MAY_CHANGE, HOW_IT_RUNS = "fixed", "may change", "how it runs"   # on --resume
NEW = object()                         # before=: no value before it existed (today's default then too)


class Option(NamedTuple):
    """One row of an entry script's options table: the parser's columns, then the row's rules."""
    name: str
    default: object
    help: str
    choices: object = None              # a list of values, or a range such as ">=1", "(0,1]"
    acts: tuple | None = None           # (acts(args), what it cannot act under, why): else refused
    resume: str = FIXED                 # FIXED: the run's, unchanged on --resume; MAY_CHANGE; HOW_IT_RUNS
    before: object = NEW                # its value for a run made before it existed (or f(old config))


def opt(name, default, help, choices=None, **rules) -> Option:
    """A row of the options table (Option); its rules by keyword."""
    return Option(name, default, help, choices, **rules)


def _add(parser, name, default, help, choices=None, show_default=True):
    """One flag. Every flag's argparse default is None, so "given on the command line" is
    `value is not None`; the table default is applied after the config file."""
    flag = "--" + name.replace("_", "-")
    shown = f"default: {default}" if show_default else ""
    if isinstance(default, bool):          # --fsdp, --fsdp true, --fsdp false
        kwargs, note = dict(nargs="?", const=True, type=parse_bool), "true/false"
    elif _is_float_pair(default):
        kwargs, note = dict(nargs=2, type=finite_float, metavar=("LO", "HI")), ""
    elif isinstance(default, list) and default and not isinstance(default[0], str):
        item = type(default[0])            # numbers (--eval-temperatures): one or more, each checked
        kind = _in_range(item, choices) if isinstance(choices, str) else _value_type(item)
        kwargs, note = dict(nargs="+", type=kind), "; ".join(filter(None, [shown, choices]))
    elif isinstance(default, list):        # names or paths: --eval-data
        kwargs, note = dict(nargs="*"), ""
    elif isinstance(choices, str):         # a range such as ">=2", ">0", "(0,1]"
        kwargs = dict(type=_in_range(type(default), choices))
        note = "; ".join(filter(None, [shown, choices]))
    else:
        kind = str if default is None else _value_type(type(default))
        kwargs, note = dict(type=kind, choices=choices), shown
    text = f"{help} ({note})" if note else help
    # argparse %-formats help text: a literal "40% of ..." would raise in --help
    parser.add_argument(flag, help=text.replace("%", "%%"), **kwargs)


def _in_range(kind, spec):
    """An argparse type: parse as `kind`, then check `spec` (">=v", ">v", or an interval "(a,b]"),
    so an out-of-range value is an argparse error naming the flag."""
    m = re.fullmatch(r"([\[(])\s*([^,]+),\s*([^\])]+)([\])])", spec)

    def check(text):
        try:
            x = _value_type(kind)(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if m:
            lo, hi = float(m.group(2)), float(m.group(3))
            ok = (x >= lo if m.group(1) == "[" else x > lo) and (x <= hi if m.group(4) == "]" else x < hi)
        elif spec.startswith(">="):
            ok = x >= float(spec[2:])
        else:
            ok = x > float(spec[1:])
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {spec}, got {text}")
        return x
    return check


def algo_knobs():
    """(name, default, help, choices) of every losses.Algo field that is a loss hyperparameter."""
    out = []
    for f in fields(losses.Algo):
        if "help" not in f.metadata:
            continue
        choices = f.metadata.get("choices")
        if f.name == "kl":
            choices = (*choices, "none")
        default = f.default if f.default is not MISSING else None
        out.append((f.name, default, f.metadata["help"] + " [default: the algorithm's own]", choices, False))
    return out


def build_parser(table, description):
    p = errors.OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config",
                   help="JSON file of defaults (keys as the flags, with _), e.g. configs/paper_qwen7b.json")
    for row in table:
        _add(p, *row[:4])
    g = p.add_argument_group("loss knobs (fields of losses.Algo; unset = the algorithm's own value)")
    for row in algo_knobs():
        _add(g, *row)
    return p


def _config_item(action, item):
    """One config value (or one element of a list value), parsed by the flag's own type as the
    same text on the command line would be."""
    if action.type is None:        # names or paths (--eval-data): JSON strings, not numbers
        if not isinstance(item, str):
            raise argparse.ArgumentTypeError(f"expected a string, got {item!r}")
        return item
    try:
        return action.type(str(item))
    except ValueError:             # int("nan"): Python's own message names no option
        raise argparse.ArgumentTypeError(f"expected {action.type.__name__}, got {item!r}") from None


def _check_config_value(parser, path, key, value, default):
    """A config-file value goes through the same type, range and choice checks as its flag. null
    is a value only where the table default is None too (a loss knob: the algorithm's own; --out,
    --export): "steps": null would otherwise reach the training loop as None."""
    action = next(a for a in parser._actions if a.dest == key)
    if value is None:
        if default is not None:
            parser.error(f"{path}: {key}: null is not a value "
                         f"(leave the key out for the default, {default!r})")
        return None
    many = action.nargs not in (None, "?")       # a list option (nargs "*") or a LO HI pair
    if many != isinstance(value, list):
        shape = "a JSON list" if many else "a single value, not a list"
        parser.error(f"{path}: {key}: expected {shape}, got {value!r}")
    try:
        value = [_config_item(action, v) for v in value] if many else _config_item(action, value)
    except argparse.ArgumentTypeError as e:
        parser.error(f"{path}: {key}: {e}")
    if many and isinstance(action.nargs, int) and len(value) != action.nargs:
        parser.error(f"{path}: {key}: expected {action.nargs} values, got {len(value)}")
    if action.nargs == "+" and not value:
        parser.error(f"{path}: {key}: expected at least one value, got []")
    if not many and action.choices is not None and value not in action.choices:
        parser.error(f"{path}: {key}: invalid value {value!r} (choose from {action.choices})")
    return value


def _read_config(path, defaults, parser):
    """The --config file's values, checked; `defaults`: option name -> its table default."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        parser.error(f"cannot read --config {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        parser.error(f"{path}:{e.lineno}: not valid JSON: {e.msg} (check commas and quotes)")
    if not isinstance(cfg, dict):
        parser.error(f"{path}: expected a JSON object of option: value")
    unknown = sorted(set(cfg) - set(defaults))
    if unknown:
        parser.error(f"{path}: unknown keys {unknown}")
    return {k: _check_config_value(parser, path, k, v, defaults[k]) for k, v in cfg.items()}


@dataclass
class Parsed:
    args: argparse.Namespace      # every table option and every Algo knob (None = algorithm's own)
    cli: set                      # names given on the command line
    config_keys: set              # names set by the --config file
    parser: argparse.ArgumentParser
    config: dict = field(default_factory=dict)  # the --config file's values (its "algo" among them)
    defaults: dict = field(default_factory=dict)  # the table's defaults
    config_path: str | None = None

    def error(self, msg):
        self.parser.error(msg)    # argparse-style: usage line, message, exit status 2


def parse(argv, table, description) -> Parsed:
    """Table default < config file < command line."""
    parser = build_parser(table, description)
    why = extension.check_rows(own_flags(table), parser.prog)           # the rows --extensions added
    if why:
        parser.error(why)
    ns = parser.parse_args(argv)
    defaults = {name: default for name, default, *_ in table}
    cfg = {**defaults, **{name: None for name, *_ in algo_knobs()}}
    from_file = _read_config(ns.config, cfg, parser) if ns.config else {}
    cfg.update(from_file)
    cli = {k for k, v in vars(ns).items() if v is not None and k != "config"}
    cfg.update({k: getattr(ns, k) for k in cli})
    for name in cli | set(from_file):
        why = empty_value(name, cfg[name], defaults.get(name))
        if why:
            where = f"--{name.replace('_', '-')}" if name in cli else f"--config {ns.config}: {name}"
            parser.error(f"{where} {why}")
    return Parsed(argparse.Namespace(**cfg), cli, set(from_file), parser, from_file, defaults, ns.config)


# What an empty value would do without a word, by option (the rest: "give one, or leave it out")
EMPTY = {"out": "would train into runs/<algo>", "eval_data": "would evaluate nothing (for no held-out "
         "evaluation give --eval-every 0)"}


def empty_value(name, value, default) -> str | None:
    """Why an empty value is refused: "" for an option whose default is None (a path: --out,
    --export, --plan-lengths; "" names no file, and `args.out or ...` would read it as unset), or no
    value for a list whose default has some (--eval-data: no set at all). None: it is not empty, or
    empty means something there (--extensions, --shaping: none; --query-cache-dir '': never share)."""
    path = default is None and value == ""
    nothing = isinstance(default, list) and default and value == []
    if not (path or nothing):
        return None
    said = EMPTY.get(name, "names nothing")
    shown = "''" if path else "without a value"
    return f"{shown}: {said}; give one, or leave it out for its default"


def own_flags(table) -> set:
    """The names of the table's own options and the loss knobs: the rows of the extension tables
    (which the table also holds, as the same objects) are not among them."""
    tables = extension.TABLES.values()
    rows = {id(opt) for t in tables for r in t.values() for opt in getattr(r, "OPTIONS", ())}
    return {row[0] for row in table if id(row) not in rows} | {name for name, *_ in algo_knobs()} | {"config"}


def fill(parsed: Parsed, values: dict, skip=()):
    """Options that neither the command line nor --config gives take `values` instead of the table
    default (a task's own sets; on --resume, the run's config.json), except those in `skip`."""
    for name, value in values.items():
        if hasattr(parsed.args, name) and name not in parsed.cli | parsed.config_keys | set(skip):
            setattr(parsed.args, name, value)


def make_algo(parsed: Parsed):
    """losses.make_algo(args.algo, knobs...) under two rules (`resolve_knobs`): a knob given on the
    command line that cannot act on the chosen algorithm is an error, and a --config file's knobs
    apply only to the algorithm it names. Knobs of a config for another algorithm that cannot act
    either way are dropped (args records the row's own)."""
    args, knobs = parsed.args, {k for k, *_ in algo_knobs()}
    if args.algo not in losses.ALGOS:  # e.g. sft: no loss knob can act on it
        if parsed.cli & knobs:
            parsed.error(f"{_flags(parsed.cli & knobs)} cannot act on --algo {args.algo}")
        return None
    src = knob_sources(parsed)
    try:
        algo, dropped = resolve_knobs(src)
    except ForeignKnobs as e:
        parsed.error(foreign_knobs_message(src, e.knobs))
    except InertKnobs as e:
        keys = ', '.join(sorted(e.knobs))
        where = f"--config {parsed.config_path}: {keys}" if e.in_file else _flags(e.knobs)
        parsed.error(f"{where} cannot act on --algo {args.algo} as configured ({algo_summary(e.algo)}); "
                     "e.g. a Policy-KL estimator needs --beta > 0, a Query-KL estimator --alpha > 0, the "
                     f"PPO clip --surrogate ppo{'; or remove the keys' if e.in_file else ''}")
    except ValueError as e:
        parsed.error(str(e))
    for k in dropped:
        setattr(args, k, None)
    if "max_resample_rounds" in parsed.cli and not algo.dynamic_sampling:  # options that act via a knob
        parsed.error("--max-resample-rounds cannot act without dynamic sampling "
                     "(--algo dapo, or --dynamic-sampling)")
    if hasattr(args, "qkl_ref"):
        check_acts(parsed, "qkl_ref", algo.alpha > 0, "alpha=0, no Query-KL term takes a reference (the "
                   "query_kl monitor measures the drift from the initial policy either way)",
                   acts_in_the_file=_file_alpha(parsed) > 0)
    return algo



def _file_alpha(parsed: Parsed) -> float:
    """The Query-KL coefficient the --config file's own settings give: its alpha, else its
    algorithm's (0 without one)."""
    alpha = parsed.config.get("alpha")
    if alpha is None:
        row = losses.ALGOS.get(parsed.config.get("algo"))
        alpha = row.alpha if row else 0.0
    return alpha

# ----------------------------------------------------------------------------------------------
# Which loss knobs apply: the command line's, the algorithm's row, and a --config file's


class ForeignKnobs(ValueError):
    """Knobs a --config file sets for another algorithm that would change this one's loss."""

    def __init__(self, knobs):
        super().__init__(_flags(knobs))
        self.knobs = set(knobs)


class InertKnobs(ValueError):
    """Knobs given on the command line (in_file: set by the --config file for its own algorithm)
    that cannot act on the algorithm as resolved."""

    def __init__(self, knobs, algo, in_file=False):
        super().__init__(_flags(knobs))
        self.knobs, self.algo, self.in_file = set(knobs), algo, in_file


@dataclass(frozen=True)
class KnobSources:
    """Where each loss knob's value comes from."""
    algo: str                         # the algorithm run (a row of losses.ALGOS)
    given: dict                       # knob -> value: command line, --config, or a resumed run's config.json
    cli: frozenset                    # knobs given on the command line
    config: frozenset                 # knobs set by the --config file
    config_algo: str | None = None    # the --config file's "algo" (None: it names none)
    config_path: str | None = None


def knob_sources(parsed: Parsed) -> KnobSources:
    knobs = {k for k, *_ in algo_knobs()}
    given = {k: getattr(parsed.args, k) for k in knobs if getattr(parsed.args, k) is not None}
    return KnobSources(parsed.args.algo, given, frozenset(parsed.cli & knobs),
                       frozenset(parsed.config_keys & knobs), parsed.config.get("algo"), parsed.config_path)


def is_rows_own(algo: str, knob: str, value) -> bool:
    """Is `value` (as a flag or config would give it: "none", 0, a list) the row's own value?"""
    try:
        value = getattr(losses.make_algo(algo, **{knob: value}), knob)   # its normal form ("none" -> None)
    except ValueError:
        pass
    return value == getattr(losses.ALGOS[algo], knob)


def resolve_knobs(src: KnobSources) -> tuple[losses.Algo, set]:
    """The run's losses.Algo, and the config knobs dropped because they cannot act. The rules:
    - a --config file's knobs apply only to the algorithm it names ("algo"). Run with another one
      (a command-line --algo that differs, or a config that names none), each config knob not
      also on the command line whose value is not the row's own is refused (ForeignKnobs), unless
      it acts neither on the row nor with the config's values (then it is dropped);
    - a knob on the command line that cannot act on the algorithm as resolved is refused
      (InertKnobs), unless its value is the row's own (it changes nothing: `--alpha 0` on grpo); so is
      one the --config file sets for its own algorithm (one rule wherever a value comes from).
    ValueError: values losses.make_algo refuses."""
    own = src.config_algo == src.algo
    foreign = set() if own else {k for k in src.config - src.cli
                                 if k in src.given and not is_rows_own(src.algo, k, src.given[k])}
    algo = losses.make_algo(src.algo, **{k: v for k, v in src.given.items() if k not in foreign})
    if foreign:
        try:
            with_config = losses.make_algo(src.algo, **src.given)
            idle = losses.unused_fields(algo) & losses.unused_fields(with_config)
        except ValueError:
            idle = set()
        if foreign - idle:
            raise ForeignKnobs(foreign - idle)
    inert = {k for k in src.cli & losses.unused_fields(algo) if not is_rows_own(src.algo, k, src.given[k])}
    if inert:
        raise InertKnobs(inert, algo)
    idle = {k for k in (src.config - src.cli - foreign) & losses.unused_fields(algo)
            if not is_rows_own(src.algo, k, src.given[k])}
    if idle:
        raise InertKnobs(idle, algo, in_file=True)
    return algo, foreign


def knob_text(knob: str, value) -> str:
    """A knob's value as its flag takes it: `--kl none`, `--dual-clip 0`, `--weight-clip 0 2`."""
    if value is None:
        choices = next(f.metadata.get("choices") for f in fields(losses.Algo) if f.name == knob)
        return "none" if choices else "0"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(knob_text(knob, v) for v in value)
    return repr(value).removesuffix(".0") if isinstance(value, float) else str(value)


def _command_line(src: KnobSources, values: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {knob_text(k, v)}" for k, v in sorted(values.items()))


def _accepted(src: KnobSources, **changes) -> Exception | None:
    try:
        resolve_knobs(replace(src, **changes))
        return None
    except ValueError as e:
        return e


def suggested_fixes(src: KnobSources, knobs: set) -> dict:
    """{"keep": {knob: value}, "drop": {knob: value}, "add_algo": bool}: command-line knobs that
    keep the config's values / give the row's, each checked by `resolve_knobs` itself (a fix that
    would be refused is not offered). Keeping a knob that cannot act with the others kept is
    refused as inert; one of such a pair (`--kl none --beta 0`) is enough, so those are left out
    one at a time."""
    row, fixes = losses.ALGOS[src.algo], {}
    keep = set(knobs)
    while keep:
        e = _accepted(src, cli=src.cli | keep)
        if e is None:
            fixes["keep"] = {k: src.given[k] for k in keep}
            break
        if not isinstance(e, InertKnobs) or not e.knobs & keep:
            break
        keep.discard(min(e.knobs & keep))
    drop = set(knobs)
    for _ in range(len(algo_knobs())):
        e = _accepted(src, given={**src.given, **{k: getattr(row, k) for k in drop}}, cli=src.cli | drop)
        if e is None:
            fixes["drop"] = {k: getattr(row, k) for k in drop}
            break
        if not isinstance(e, ForeignKnobs):
            break
        drop |= e.knobs
    fixes["add_algo"] = src.config_algo is None and _accepted(src, config_algo=src.algo) is None
    return fixes


def foreign_knobs_message(src: KnobSources, knobs: set) -> str:
    """One line: the knobs, their config values and the row's, and the fixes that are accepted."""
    row = losses.ALGOS[src.algo]
    named = f"it names {src.config_algo}" if src.config_algo else "it names no algorithm"
    each = ", ".join(f"{k} {knob_text(k, src.given[k])} ({src.algo}: {knob_text(k, getattr(row, k))})"
                     for k in sorted(knobs))
    fixes = suggested_fixes(src, knobs)
    how = []
    if "keep" in fixes:
        how.append(f"to keep them give them on the command line ({_command_line(src, fixes['keep'])})")
    if "drop" in fixes:
        how.append(f"to drop them give {src.algo}'s ({_command_line(src, fixes['drop'])})")
    if fixes["add_algo"]:
        how.append(f'or add "algo": "{src.algo}" to {src.config_path}')
    return (f"--config {src.config_path} sets loss knobs of another algorithm ({named}, this run is "
            f"--algo {src.algo}): {each}; they apply only to the config's own algorithm: " + "; ".join(how))


def check_acts(parsed: Parsed, name: str, acts: bool, why: str, where: str | None = None,
               acts_in_the_file: bool = False):
    """An option given on the command line or in the --config file with a value other than its
    default that cannot act is an error, as an inert loss knob is (the default itself changes
    nothing): one rule wherever the value comes from. `where`: what it cannot act under (default: the
    algorithm as configured). acts_in_the_file: the key acts under the file's own settings, and what
    the command line changed (e.g. --algo grpo over a config of ERPO's) leaves it idle: the file is
    not wrong, so that is said in one line, not refused (a shipped config stays usable as a base)."""
    value = getattr(parsed.args, name)
    if acts or value == parsed.defaults.get(name):
        return
    where = where or f"on --algo {parsed.args.algo} as configured"
    if name in parsed.cli:
        parsed.error(f"--{name.replace('_', '-')} {value} cannot act {where}: {why}")
    if name in parsed.config_keys and acts_in_the_file:
        print0(f"note: --config {parsed.config_path}: {name} {value} does not act {where}, as the command "
              f"line sets it: {why}")
    elif name in parsed.config_keys:                    # (a key the file sets, the flag not given)
        parsed.error(f"--config {parsed.config_path}: {name} {value} cannot act {where}: {why}; give "
                     f"--{name.replace('_', '-')} {parsed.defaults.get(name)} or remove the key")


def check_inert_options(parsed: Parsed, rules: dict):
    """check_acts of every option of `rules`: {option: (acts(args) -> bool, where, why)}."""
    for name, (acts, where, why) in rules.items():
        check_acts(parsed, name, acts(parsed.args), why, where)


def check_extension_options(parsed, algo, controllers: dict):
    """An extension row's own options act only where the row is chosen (--adv's) or switched on (a
    rule's of `controllers`), and the chosen advantage row accepts its options (on a group of
    --group-size)."""
    args = parsed.args
    references = extension.TABLES.get("qkl_ref", {})                    # (rl/query_reference.py's)
    ref = getattr(args, "qkl_ref", None)
    chosen = ((losses.ADVANTAGES, [algo.adv] if algo else [], None),
              (losses.SURROGATES, [algo.surrogate] if algo else [], None),
              (references, [ref] if algo and ref else [], f"another Query-KL reference than --qkl-ref {ref}"),
              (controllers, extension.switched_on(controllers, args) if algo else [], None))
    for table, rows, whose in chosen:
        for name in extension.inert_options(table, rows, parsed.cli | parsed.config_keys):
            row = extension.owner(table, name)
            doc = getattr(table[row], "doc", "")
            of = whose or f"{row!r}{f' ({doc})' if doc else ''}, which this run does not use"
            check_acts(parsed, name, False, f"it is an option of {of}")
    if algo is not None and getattr(losses.ADVANTAGES[algo.adv], "rewards", "any") == "binary" and \
            getattr(args, "reward", "acc") != "acc":
        parsed.error(f"--adv {algo.adv} needs 0/1 rewards: --reward acc, not {args.reward}")
    if algo is not None:
        own = extension.option_values(losses.ADVANTAGES[algo.adv], args)
        try:
            losses.group_advantages(torch.zeros(args.group_size), args.group_size, algo.adv, algo.adv_eps,
                                    options=own)
        except ValueError as e:
            parsed.error(f"--adv {algo.adv}: {e}")
        if never_a_signal(algo, args.group_size, own):                  # (pass@k at k = G: no variance)
            given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in own.items())
            change = f"change {_flags(own)} or --group-size" if own else "choose another --adv"
            parsed.error(f"--adv {algo.adv}{' ' + given if given else ''} at --group-size {args.group_size}: "
                         "every group's advantages are 0 whatever its rewards, so no step would have a "
                         f"signal and nothing would train: {change}")


def never_a_signal(algo, group_size, own) -> bool:
    """Whether the advantage row gives 0 to every group of 0/1 rewards, k successes for each k in
    1..G-1 (pass@k with k = G: a group with a success passes, one without fails; no variance).
    Every such run would end in the no-signal message, which blames equal rewards."""
    for k in range(1, group_size):
        rewards = torch.tensor([1.0] * k + [0.0] * (group_size - k))
        try:
            adv = losses.group_advantages(rewards, group_size, algo.adv, algo.adv_eps, options=own)
        except ValueError:                                               # (a row of other rewards)
            return False
        if adv.abs().max() > 0:
            return False
    return True


def absolute_paths(parsed: Parsed, names):
    """Options `names` whose values name existing files or folders (relative to here) become
    absolute paths, so that config.json says which file a run used wherever a command is run from
    (and --resume from another folder reads the same files). Other values (set names, hub ids)
    stay as they are."""
    def absolute(value):
        is_path = isinstance(value, str) and value and os.path.exists(value)
        return os.path.abspath(value) if is_path else value
    for name in names:
        value = getattr(parsed.args, name, None)
        value = [absolute(v) for v in value] if isinstance(value, list) else absolute(value)
        setattr(parsed.args, name, value)


def _flags(names):
    return ", ".join("--" + k.replace("_", "-") for k in sorted(names))


def algo_summary(algo):
    return ", ".join(f"{f.name}={getattr(algo, f.name)}" for f in fields(algo) if f.name != "doc")
