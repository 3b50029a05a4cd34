"""The ``agentserve`` command: one click group; each subcommand lives in its own module."""

from __future__ import annotations

import click

from agentserve.cli.bench import bench
from agentserve.cli.doctor import doctor
from agentserve.cli.top import top
from agentserve.cli.up import up


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="agentserve")
def main() -> None:
    """AgentServe: many tool-using agents on one GPU without head-of-line blocking."""


main.add_command(up)
main.add_command(top)
main.add_command(doctor)
main.add_command(bench)
