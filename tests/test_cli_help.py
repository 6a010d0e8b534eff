"""`bertfast <command> --help` answers at once: the commands that import torch, transformers and the
kernels (seconds) print their help from parsers that import none of them, the same help their own
parsing gives. (Start-up time itself is measured, not asserted: see docs/testing.md.)"""
import subprocess
import sys

import pytest

from bertfast import cli


@pytest.mark.parametrize("command", sorted(cli.LIGHT_HELP))
def test_help_imports_no_torch(command):
    code = ("import sys\nfrom bertfast.cli import main\nrc = main([%r, '--help'])\n"
            "heavy = [m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules]\n"
            "print('RC', rc, 'HEAVY', heavy)" % command)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"usage: bertfast {command}" in out.stdout
    assert "RC 0 HEAVY []" in out.stdout


@pytest.mark.parametrize("command", sorted(cli.LIGHT_HELP))
def test_light_help_is_the_commands_own(command, capsys):
    assert cli.main([command, "--help"]) == 0
    light = capsys.readouterr().out
    module = __import__(cli.COMMANDS[command][0], fromlist=["main"])
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out == light


def test_info_refuses_unknown_options(capsys):
    from bertfast import info
    with pytest.raises(SystemExit):
        info.main(["--nope"])
    assert "unrecognized arguments: --nope" in capsys.readouterr().err
