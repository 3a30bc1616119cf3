"""`sluice completion SHELL`: a completion script made from the command's parser, which the
shell completes commands, actions, options and paths with."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from helpers import run_cli

COMMANDS = ["serve", "status", "tail", "topic", "cluster", "bench", "completion"]


def bash_completes(script: str, *words: str) -> list[str]:
    """What the script's completion function offers for the command line `words` (the last
    one the word being completed), run by a real bash as it runs it at a TAB."""
    line = " ".join(words)
    program = (
        f"{script}\n"
        f"COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
        f'COMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}\n'
        '_shtab_sluice sluice "${COMP_WORDS[-1]}" "${COMP_WORDS[-2]}"\n'
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    r = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return [w for w in r.stdout.splitlines() if w]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completes_commands_actions_and_options(tmp_path):
    r = run_cli("completion", "bash")
    assert r.returncode == 0, r.stderr
    assert "complete " in r.stdout and "_shtab_sluice" in r.stdout
    assert bash_completes(r.stdout, "sluice", "ser") == ["serve"]
    assert bash_completes(r.stdout, "sluice", "topic", "l") == ["list"]
    assert bash_completes(r.stdout, "sluice", "serve", "--data") == ["--data-dir"]
    assert bash_completes(r.stdout, "sluice", "completion", "z") == ["zsh"]
    # A directory option offers directories, a file option files too.
    (tmp_path / "nodes").mkdir()
    (tmp_path / "node.toml").write_text("")
    dirs = bash_completes(r.stdout, "sluice", "serve", "--data-dir", f"{tmp_path}/no")
    assert dirs == [f"{tmp_path}/nodes"], dirs
    files = bash_completes(r.stdout, "sluice", "serve", "--config", f"{tmp_path}/no")
    assert sorted(files) == [f"{tmp_path}/node.toml", f"{tmp_path}/nodes"], files
    # The script is the one `complete -p` then knows sluice by.
    r = subprocess.run(
        ["bash", "-c", f"{r.stdout}\ncomplete -p sluice"], capture_output=True, text=True, timeout=30
    )
    assert "-F _shtab_sluice sluice" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_name_every_command(shell):
    r = run_cli("completion", shell)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "sluice" in r.stdout
    for command in COMMANDS:
        assert command in r.stdout, f"{shell}: {command} missing"
    assert "--admin-listen" in r.stdout and "--topic" in r.stdout


def test_an_unknown_shell_is_a_usage_error():
    r = run_cli("completion", "tcsh")
    assert r.returncode == 2 and r.stdout == ""
    assert "sluice completion: error: argument shell: invalid choice: 'tcsh'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
