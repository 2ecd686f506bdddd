"""The command handlers' own output: a line is one write, so ranks sharing a stream cannot split it."""

from __future__ import annotations

from vltrain.cli.model_commands import say


class Writes:
    """An unbuffered stream (torchrun starts its workers with ``python -u``) that records each write."""

    def __init__(self):
        self.writes: list[str] = []
        self.flushed = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushed += 1


def test_a_line_and_its_break_are_one_write_then_flushed():
    stream = Writes()
    say("run: runs/x  steps: 4  skipped: 0", stream)
    assert stream.writes == ["run: runs/x  steps: 4  skipped: 0\n"] and stream.flushed == 1
