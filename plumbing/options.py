"""Command-line options from one table, plus the loss knobs generated from `losses.Algo`.

An entry script writes each option exactly once, as a row (name, default, help[, choices or a
range like ">=1" or "(0,1]"]); the flag is --name-with-dashes, its type comes from the default.
Every field of `losses.Algo` becomes a flag too (--adv, --kl, --weight-clip, ...): unset, it keeps
the chosen algorithm's own value. A JSON --config file sets defaults (same keys); flags given on
the command line override it. Every float, wherever it comes from, must be finite (`finite_float`).
"""

import argparse
import json
import math
import re
from dataclasses import MISSING, dataclass, fields

import losses


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
    option means infinity: "no limit" is a large finite value."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if math.isinf(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r} "
                                         "(for no limit, give a large one such as 1e9)")
    return x


def _value_type(kind):
    """The argparse type of a flag whose table default is of type `kind`."""
    return finite_float if kind is float else kind


def _is_float_pair(default):
    """A (lo, hi) default such as losses.Algo.weight_clip: a flag of two numbers."""
    pair = isinstance(default, (list, tuple)) and len(default) == 2
    return pair and all(isinstance(x, float) for x in default)


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
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config",
                   help="JSON file of defaults (keys as the flags, with _), e.g. configs/paper_qwen7b.json")
    for row in table:
        _add(p, *row)
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

    def error(self, msg):
        self.parser.error(msg)    # argparse-style: usage line, message, exit status 2


def parse(argv, table, description) -> Parsed:
    """Table default < config file < command line."""
    parser = build_parser(table, description)
    ns = parser.parse_args(argv)
    cfg = {name: default for name, default, *_ in table}
    cfg.update({name: None for name, *_ in algo_knobs()})
    from_file = _read_config(ns.config, cfg, parser) if ns.config else {}
    cfg.update(from_file)
    cli = {k for k, v in vars(ns).items() if v is not None and k != "config"}
    cfg.update({k: getattr(ns, k) for k in cli})
    return Parsed(argparse.Namespace(**cfg), cli, set(from_file), parser)


def fill(parsed: Parsed, values: dict, skip=()):
    """Options that neither the command line nor --config gives take `values` instead of the table
    default (a task's own sets; on --resume, the run's config.json), except those in `skip`."""
    for name, value in values.items():
        if hasattr(parsed.args, name) and name not in parsed.cli | parsed.config_keys | set(skip):
            setattr(parsed.args, name, value)


def make_algo(parsed: Parsed):
    """losses.make_algo(args.algo, knobs...), where a knob given on the command line that cannot act
    on the chosen algorithm is an error (a config file may set defaults for unused parts)."""
    args, knobs = parsed.args, {k for k, *_ in algo_knobs()}
    if args.algo not in losses.ALGOS:  # e.g. sft: no loss knob can act on it
        if parsed.cli & knobs:
            parsed.error(f"{_flags(parsed.cli & knobs)} cannot act on --algo {args.algo}")
        return None
    try:
        algo = losses.make_algo(args.algo, **{k: getattr(args, k) for k in knobs})
    except ValueError as e:
        parsed.error(str(e))
    if "max_resample_rounds" in parsed.cli and not algo.dynamic_sampling:  # an option that acts via a knob
        parsed.error("--max-resample-rounds cannot act without dynamic sampling "
                     "(--algo dapo, or --dynamic-sampling)")
    inert = sorted(parsed.cli & losses.unused_fields(algo))
    if inert:
        parsed.error(f"{_flags(inert)} cannot act on --algo {args.algo} as configured "
                     f"({algo_summary(algo)}); "
                     "e.g. a Policy-KL estimator needs --beta > 0, a Query-KL estimator --alpha > 0")
    return algo


def _flags(names):
    return ", ".join("--" + k.replace("_", "-") for k in sorted(names))


def algo_summary(algo):
    return ", ".join(f"{f.name}={getattr(algo, f.name)}" for f in fields(algo) if f.name != "doc")
