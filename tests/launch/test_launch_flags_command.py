"""What follows elastic-run's flags becomes each worker's command (elastic.launch.flags.worker_command)."""

import pytest

from elastic.launch.flags import UsageError, worker_command

PYTHON = "/opt/py/bin/python3"
FILES = {"train.py", "dir/train.py"}
ON_PATH = {"python", "bash"}


def decide(command):
    return worker_command(command, PYTHON, FILES.__contains__, lambda name: name if name in ON_PATH else None)


@pytest.mark.parametrize("command, runs", [
    (["python", "train.py", "--lr", "0.1"], ["python", "train.py", "--lr", "0.1"]),   # as written
    (["train.py", "--lr", "0.1"], [PYTHON, "train.py", "--lr", "0.1"]),                # torchrun's habit
    (["dir/train.py"], [PYTHON, "dir/train.py"]),
    (["bash", "run.sh"], ["bash", "run.sh"]),
])
def test_a_script_runs_with_this_python_as_torchrun_runs_it_and_a_command_as_written(command, runs):
    assert decide(command) == runs


@pytest.mark.parametrize("command, says", [
    ([], "no worker command: put it after '--', e.g. elastic-run --np 2 -- python train.py"),
    (["missing.py"], "worker script 'missing.py' not found (elastic-run runs a .py file with this Python, "
                     f"{PYTHON}, as torchrun does)"),
    (["trian"], "worker command 'trian' not found (not an executable, nor on PATH; a script runs as "
                "'elastic-run ... train.py' or '-- python train.py')"),
])
def test_a_command_that_cannot_run_is_one_line_naming_the_fix(command, says):
    with pytest.raises(UsageError) as info:
        decide(command)
    assert str(info.value) == says
