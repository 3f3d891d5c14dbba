"""The token and TLS flags are one definition (rendezvous/common/client_flags.py) that both command
lines talking to the rendezvous use: elastic-run and elastic-rendezvous status."""
from __future__ import annotations

import argparse

import pytest

from elastic.launch.flags import parser as launch_parser
from elastic.runtime import worker_config
from rendezvous.cli import parser as rendezvous_parser
from rendezvous.common import client_flags


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def _status_parser() -> argparse.ArgumentParser:
    sub = next(a for a in rendezvous_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["status"]


@pytest.mark.parametrize("flag", [client_flags.TOKEN_FILE, *client_flags.TLS], ids=lambda f: f.flag)
def test_elastic_run_and_status_take_the_same_flag_as_defined_once(flag):
    ours, theirs = _option(launch_parser(), flag.flag), _option(_status_parser(), flag.flag)
    assert ours.metavar == theirs.metavar == flag.metavar
    assert theirs.help == flag.help
    # elastic-run says, besides, which variable its workers get it as.
    assert ours.help.startswith(flag.help) and flag.variable in ours.help


def test_a_worker_reads_the_variables_the_tls_flags_stand_for():
    assert worker_config.TLS_VARIABLES == client_flags.TLS_VARIABLES
