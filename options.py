"""Command-line options from one table, plus the loss knobs generated from `losses.Algo`.

An entry script writes each option exactly once, as a row (name, default, help[, choices or a
range like ">=1" or "(0,1]"]); the flag is --name-with-dashes, its type comes from the default. Every field of `losses.Algo` becomes a
flag too (--adv, --kl, --weight-clip, ...): unset, it keeps the chosen algorithm's own value. A
JSON --config file sets defaults (same keys); flags given on the command line override it.
"""

import argparse
import json
import re
from dataclasses import MISSING, dataclass, fields

import losses


def parse_bool(s):
    if str(s).lower() in ("1", "true", "yes", "on"):
        return True
    if str(s).lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _add(parser, name, default, help, choices=None, show_default=True):
    """One flag. Every flag's argparse default is None, so "given on the command line" is
    `value is not None`; the table default is applied after the config file."""
    flag = "--" + name.replace("_", "-")
    shown = f"default: {default}" if show_default else ""
    if isinstance(default, bool):          # --fsdp, --fsdp true, --fsdp false
        kwargs, note = dict(nargs="?", const=True, type=parse_bool), "true/false"
    elif isinstance(default, (list, tuple)) and len(default) == 2 and all(isinstance(x, float) for x in default):
        kwargs, note = dict(nargs=2, type=float, metavar=("LO", "HI")), ""
    elif isinstance(default, list):
        kwargs, note = dict(nargs="*"), ""
    elif isinstance(choices, str):         # a range such as ">=2", ">0", "(0,1]"
        kwargs = dict(type=_in_range(type(default), choices))
        note = "; ".join(filter(None, [shown, choices]))
    else:
        kwargs, note = dict(type=str if default is None else type(default), choices=choices), shown
    text = f"{help} ({note})" if note else help
    # argparse %-formats help text: a literal "40% of ..." would raise in --help
    parser.add_argument(flag, help=text.replace("%", "%%"), **kwargs)


def _in_range(kind, spec):
    """An argparse type: parse as `kind`, then check `spec` (">=v", ">v", or an interval "(a,b]"),
    so an out-of-range value is an argparse error naming the flag."""
    m = re.fullmatch(r"([\[(])\s*([^,]+),\s*([^\])]+)([\])])", spec)

    def check(text):
        try:
            x = kind(text)
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
    p.add_argument("--config", help="JSON file of defaults (keys as the flags, with _), e.g. configs/paper_qwen7b.json")
    for row in table:
        _add(p, *row)
    g = p.add_argument_group("loss knobs (fields of losses.Algo; unset = the algorithm's own value)")
    for row in algo_knobs():
        _add(g, *row)
    return p


def _check_config_value(parser, path, key, value):
    """A config-file value goes through the same type, range and choice checks as its flag."""
    action = next(a for a in parser._actions if a.dest == key)
    try:
        if value is None or action.type is None:
            ok = action.choices is None or value in action.choices
        elif isinstance(value, list) and action.nargs not in (None, "?"):
            value = [action.type(str(v)) for v in value]
            ok = action.nargs in ("*", "+") or len(value) == action.nargs
        else:
            value = action.type(str(value))
            ok = action.choices is None or value in action.choices
    except (argparse.ArgumentTypeError, ValueError) as e:
        parser.error(f"{path}: {key}: {e}")
    if not ok:
        parser.error(f"{path}: {key}: invalid value {value!r} (choose from {action.choices or action.nargs})")
    return value


def _read_config(path, known, parser):
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        parser.error(f"cannot read --config {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        parser.error(f"{path}:{e.lineno}: not valid JSON: {e.msg} (check commas and quotes)")
    if not isinstance(cfg, dict):
        parser.error(f"{path}: expected a JSON object of option: value")
    unknown = sorted(set(cfg) - known)
    if unknown:
        parser.error(f"{path}: unknown keys {unknown}")
    return {k: _check_config_value(parser, path, k, v) for k, v in cfg.items()}


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
    from_file = _read_config(ns.config, set(cfg), parser) if ns.config else {}
    cfg.update(from_file)
    cli = {k for k, v in vars(ns).items() if v is not None and k != "config"}
    cfg.update({k: getattr(ns, k) for k in cli})
    return Parsed(argparse.Namespace(**cfg), cli, set(from_file), parser)


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
        parsed.error("--max-resample-rounds cannot act without dynamic sampling (--algo dapo, or --dynamic-sampling)")
    inert = sorted(parsed.cli & losses.unused_fields(algo))
    if inert:
        parsed.error(f"{_flags(inert)} cannot act on --algo {args.algo} as configured ({algo_summary(algo)}); "
                     "e.g. a Policy-KL estimator needs --beta > 0, a Query-KL estimator --alpha > 0")
    return algo


def _flags(names):
    return ", ".join("--" + k.replace("_", "-") for k in sorted(names))


def algo_summary(algo):
    return ", ".join(f"{f.name}={getattr(algo, f.name)}" for f in fields(algo) if f.name != "doc")
