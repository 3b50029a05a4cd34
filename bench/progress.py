"""A progress display across a whole benchmark sweep (rich): one bar for the sweep with the time left,
one for the run in flight, and a line per finished run.

The sweep bar counts measured seconds (warm-up + duration per run); the time left extrapolates the
wall time spent so far, which includes server starts and drains, over what is left.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text
from rich.traceback import Traceback

from agentserve.bench.sweep import RunSlot


def time_left(elapsed_s: float, completed: float, total: float) -> float | None:
    """Seconds left if the rest goes at the pace so far (None before any progress)."""
    if completed <= 0 or elapsed_s <= 0:
        return None
    return max(0.0, elapsed_s * (total - completed) / completed)


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class TimeLeftColumn(ProgressColumn):
    """The sweep's time left, from its own pace so far (see :func:`time_left`)."""

    def render(self, task: Any) -> Text:
        if task.total is None:
            return Text("")
        left = time_left(task.elapsed or 0.0, task.completed, task.total)
        return Text(f"{duration_text(left)} left", style="progress.remaining")


def label(slot: RunSlot, repeats: int) -> str:
    text = f"{slot.agents} agent{'s' if slot.agents != 1 else ''} · {slot.system}"
    return text if repeats == 1 else f"{text} ({slot.repeat + 1}/{repeats})"


class SweepProgress:
    """Receives :func:`agentserve.bench.sweep.execute`'s events and the replayer's ticks."""

    def __init__(self, console: Console, slots: list[RunSlot], run_s: float, repeats: int,
                 expected_errors: tuple[type[BaseException], ...] = ()) -> None:
        """``expected_errors``: failures of the system under test, shown without a traceback."""
        self.console, self.slots, self.run_s, self.repeats = console, slots, run_s, repeats
        self.expected_errors = expected_errors
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                 TimeLeftColumn(), console=console, transient=False)
        self.sweep_task = self.progress.add_task(self._sweep_text(0), total=len(slots) * run_s)
        self.run_task: Any = None
        self.slot: RunSlot | None = None
        self.finished = 0
        self.requests = 0

    def __enter__(self) -> SweepProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def _sweep_text(self, done: int) -> str:
        return f"sweep: {done}/{len(self.slots)} runs"

    def on_event(self, event: str, slot: RunSlot, error: BaseException | None) -> None:
        if event == "start":
            self.slot, self.requests = slot, 0
            self.run_task = self.progress.add_task(f"{label(slot, self.repeats)}: starting", total=self.run_s)
            return
        if self.run_task is not None and event != "skipped":
            self.progress.remove_task(self.run_task)
            self.run_task = None
        self.finished += 1
        self.progress.update(self.sweep_task, completed=self.finished * self.run_s,
                             description=self._sweep_text(self.finished))
        text = label(slot, self.repeats)
        if event == "ran":
            self.console.print(f"{text}: {self.requests} requests")
        elif event == "failed":
            self.console.print(f"{text}: {type(error).__name__}: {error}", style="red", markup=False)
            if error is not None and not isinstance(error, self.expected_errors):  # not the system's fault
                self.console.print(Traceback.from_exception(type(error), error, error.__traceback__))
        else:
            self.console.print(f"{text}: skipped (failed earlier at this agent count)", style="yellow")

    def tick(self, elapsed_s: float, requests: int) -> None:
        """The run in flight has run ``elapsed_s`` seconds and finished ``requests`` requests."""
        self.requests = requests
        if self.run_task is None or self.slot is None:
            return
        done = min(elapsed_s, self.run_s)
        self.progress.update(self.run_task, completed=done,
                             description=f"{label(self.slot, self.repeats)}: {requests} requests")
        self.progress.update(self.sweep_task, completed=self.finished * self.run_s + done)
