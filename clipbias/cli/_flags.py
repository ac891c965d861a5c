"""The one place where the library's parameter names become the CLI's flags.

Library messages name what to change as the Python API spells it, in backquotes: a parameter
(`` `epsilon` ``), a field (`` `AlgoConfig.clip` ``, `` `TrainConfig.resume` ``), a method setting
(`` `AlgoConfig.extra['k']` ``) or a suggested value (`` `accountant='rdp'` ``, `` `overwrite=True` ``).
``speak_cli`` rewrites each one the running command has a flag for (its parser's ``dest``; a method
setting's own flag) into that flag: ``--epsilon``, ``--clip``, ``--resume``, ``--k``,
``--accountant rdp``, ``--overwrite``. Names the command has no flag for stay as they are.
"""

from __future__ import annotations

import argparse
import re

# an API name: identifier(.identifier)*, optionally ['key'], optionally =value
ALIASES = {"anti_norm": "anti_canary", "algorithm": "algo", "noise_seed": "reproducible_noise",
           "num_workers": "workers", "TuneConfig.validation": "validation_fraction"}
"""API names whose flag's dest is spelled otherwise (a qualified name where the field alone is ambiguous)."""
_NAME = re.compile(r"`([A-Za-z_][\w.]*)(?:\[['\"]([\w-]+)['\"]\])?(?:=(['\"]?)([^`'\"]*)\3)?`")


def command_flags(parser: argparse.ArgumentParser, command: str | None) -> dict[str, tuple[str, bool]]:
    """dest -> (its long flag, whether it is a switch) for ``command``'s parser (the top parser's own
    when ``command`` is None or unknown)."""
    sub = parser
    for action in parser._actions:  # argparse keeps the subcommands' parsers here
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub = action.choices[command]
    out: dict[str, tuple[str, bool]] = {}
    for action in sub._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in out:
            out[action.dest] = (longs[0], action.nargs in (0, "?"))
    return out


def setting_flags() -> dict[str, str]:
    """Method setting key (or its flag's dest) -> its flag (``AlgoConfig.extra['key']`` -> ``--flag``)."""
    from ._choices import current
    settings = current()["settings"]
    return {**{s["dest"]: s["flag"].split("/")[0] for s in settings},
            **{s["key"]: s["flag"].split("/")[0] for s in settings}}


def speak_cli(message: str, flags: dict[str, tuple[str, bool]], settings: dict[str, str] | None = None) -> str:
    """``message`` with every backquoted API name the command has a flag for replaced by the flag."""
    def flag_for(m: re.Match) -> str:
        name, key, value = m.group(1), m.group(2), m.group(4)
        if key is not None:
            if name.rpartition(".")[2] != "extra" or key not in (settings or {}):
                return m.group(0)
            flag, switch = settings[key], False
        else:
            if name in ALIASES:
                name = ALIASES[name]
            owner, dot, field = name.rpartition(".")
            name = field if dot and owner[:1].isupper() else name  # AlgoConfig.clip, TrainConfig.resume: the field
            name = ALIASES.get(name, name)
            if name not in flags:
                return m.group(0)
            flag, switch = flags[name]
        if value is None or (switch and value == "True"):
            return flag
        return f"{flag} {value}"
    return _NAME.sub(flag_for, message)


_active: tuple[dict, dict] = ({}, {})


def use(parser: argparse.ArgumentParser, command: str | None) -> None:
    """The flags of the command now running: ``speak`` (errors, warnings) translates with them, and with
    ``train``'s for a name the command has no flag of its own for (``export``'s "train with `out`")."""
    global _active
    _active = ({**command_flags(parser, "train"), **command_flags(parser, command)}, {})


def speak(message: str) -> str:
    """``speak_cli`` with the running command's flags (``use``) and the method settings' flags."""
    flags, settings = _active
    if "`" not in message:
        return message
    return speak_cli(message, flags, settings or setting_flags())
