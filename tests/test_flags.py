"""The library's errors name Python API parameters; the CLI turns them into its flags in one place
(``clipbias/cli/_flags.py``)."""

from __future__ import annotations

import pytest

from clipbias.cli import build_parser, main
from clipbias.cli._flags import command_flags, speak_cli
from clipbias.config import AlgoConfig
from clipbias.errors import ConfigError
from clipbias.privacy import gaussian


def test_api_names_become_the_commands_flags():
    flags = command_flags(build_parser(), "train")
    said = speak_cli("`epsilon` must be > 0; `AlgoConfig.clip`, `TrainConfig.resume`, `accountant='rdp'`, "
                     "`overwrite=True`, `AlgoConfig.extra['k']`, `noise_seed`, `not_a_flag`", flags, {"k": "--perturb-k"})
    assert said == ("--epsilon must be > 0; --clip, --resume, --accountant rdp, --overwrite, --perturb-k, "
                    "--reproducible-noise, `not_a_flag`")


def test_a_python_user_is_told_the_parameter_and_a_cli_user_the_flag(capsys):
    with pytest.raises(ConfigError, match="`AlgoConfig.clip` must be > 0"):
        AlgoConfig(clip=0.0)
    with pytest.raises(ConfigError, match="`sample_rate` must lie in"):
        gaussian.epsilon(1.0, 2.0, 10, 1e-5)
    assert main(["account", "--noise-multiplier", "1", "--sample-rate", "2", "--steps", "10", "--delta", "1e-5"]) == 2
    err = capsys.readouterr().err
    assert "--sample-rate must lie in (0, 1], got 2.0" in err and "`" not in err
