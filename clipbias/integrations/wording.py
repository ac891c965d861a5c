"""The Opacus interface's words in clipbias's errors: the engine's parameter names that reach an Opacus user,
as that interface spells them (``criterion``, ``max_grad_norm``, ``target_epsilon``), put in every
``ClipbiasError`` its entry points and its private step raise (``speaking_opacus``, ``speaks_opacus``,
``OpacusEngine``). The CLI's ``clipbias/cli/_flags.py`` does the same for its flags."""

from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from typing import Callable

from ..engine import DPEngine
from ..errors import ClipbiasError

OPACUS_WORDS = ((re.compile(r"(?<![\w.])loss_fn(?!\w)"), "criterion"), (re.compile(r"`AlgoConfig\.clip`"),
                "`max_grad_norm`"), (re.compile(r"`epsilon`"), "`target_epsilon`"))
"""The engine's parameter names that reach an Opacus user, as the Opacus interface spells them (the CLI's
``clipbias/cli/_flags.py`` does the same for its flags): ``loss_fn`` is ``criterion``, the clip
``max_grad_norm``, ``epsilon`` ``target_epsilon``."""


def speak_opacus(message: str) -> str:
    """``message`` with the engine's parameter names replaced by the Opacus interface's (``OPACUS_WORDS``)."""
    for pattern, word in OPACUS_WORDS:
        message = pattern.sub(word, message)
    return message


@contextmanager
def speaking_opacus():
    """A ``ClipbiasError`` raised inside, re-raised (same type, same traceback) with ``speak_opacus``'s message."""
    try:
        yield
    except ClipbiasError as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (speak_opacus(e.args[0]), *e.args[1:])
        raise


def speaks_opacus(fn: Callable) -> Callable:
    """``fn`` (an entry point of the Opacus interface) under ``speaking_opacus``."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with speaking_opacus():
            return fn(*args, **kwargs)
    return wrapped


class OpacusEngine(DPEngine):
    """The ``DPEngine`` of a ``PrivacyEngine``: its step (taken by ``optimizer.step()`` or by the model's
    forward) raises errors that name the Opacus interface's arguments (``speaking_opacus``)."""

    def step(self, *args, **kwargs):
        with speaking_opacus():
            return super().step(*args, **kwargs)
