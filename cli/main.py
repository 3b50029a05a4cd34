"""The ``agentserve`` command: one click group; each subcommand lives in its own module.

Subcommands are imported only when they run (``agentserve top`` never pays for torch).  To add one,
append a line to :data:`COMMANDS`: ``"name": "agentserve.cli.module:function"``.
"""

from __future__ import annotations

import importlib

import click

from agentserve.cli.interrupts import exit_interrupted

COMMANDS: dict[str, str] = {
    "up": "agentserve.cli.up:up",
    "top": "agentserve.cli.top:top",
    "doctor": "agentserve.cli.doctor:doctor",
    "bench": "agentserve.cli.bench:bench",
    "generate": "agentserve.cli.generate:generate",
    "fleet": "agentserve.cli.fleet:fleet",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands or name not in COMMANDS:
            return super().get_command(ctx, name)
        module, attr = COMMANDS[name].split(":")
        command = getattr(importlib.import_module(module), attr)
        self.add_command(command, name)
        return command

    def invoke(self, ctx: click.Context) -> object:
        """A command a Ctrl-C interrupted ends with one line and exit status 130 (``up`` and ``top`` handle their
        own: for them a Ctrl-C is the way to stop)."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            exit_interrupted(ctx.invoked_subcommand, e)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="agentserve")
def main() -> None:
    """AgentServe: many tool-using agents on one GPU without head-of-line blocking."""
