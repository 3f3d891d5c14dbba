"""The token and TLS flags of every command that talks to the rendezvous service, defined once.

`elastic-run` and `elastic-rendezvous status` both add them with `add_client_flags`: the same
names, metavars and help, and the environment variable each flag stands for, which is what a
worker started by `elastic-run` reads (elastic/runtime/worker_config.py). What a command does with
the values stays its own: `elastic-run` falls back to the variables and hands the files on to its
workers; `status` uses the flags alone.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ClientFlag:
    flag: str          # e.g. "--tls-ca"
    metavar: str
    variable: str      # the environment variable a worker reads for it
    help: str          # what it is, in one clause


TOKEN_FILE = ClientFlag("--token-file", "F", "ELASTIC_TOKEN_FILE",
                        "file holding the token the rendezvous servers accept, if they want one")
TLS_CA = ClientFlag("--tls-ca", "PEM", "ELASTIC_TLS_CA",
                    "connect to the rendezvous servers with TLS, trusting this CA certificate")
TLS_CERT = ClientFlag("--tls-cert", "PEM", "ELASTIC_TLS_CERT",
                      "client certificate, for servers started with --tls-client-ca")
TLS_KEY = ClientFlag("--tls-key", "PEM", "ELASTIC_TLS_KEY", "private key for --tls-cert")

TLS = (TLS_CA, TLS_CERT, TLS_KEY)
TLS_FLAGS = tuple(f.flag for f in TLS)
TLS_VARIABLES = tuple(f.variable for f in TLS)
TOKEN_VARIABLE = "ELASTIC_TOKEN"   # the token itself: read by workers and elastic-run, never a flag


def add_client_flags(parser: argparse.ArgumentParser, *, for_workers: bool = False) -> None:
    """Add --token-file and --tls-ca/--tls-cert/--tls-key to `parser`. `for_workers`: the command
    passes them on to the workers it starts, and takes an absent --tls-* flag from its variable
    (elastic-run); the help says so."""
    for f in (TOKEN_FILE, *TLS):
        text = f.help
        if for_workers:
            text += f"; passed to workers as {f.variable}"
            if f in TLS:
                text += f" (default: ${f.variable})"
        parser.add_argument(f.flag, metavar=f.metavar, help=text)
