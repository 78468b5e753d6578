"""A fake terminal and a fake clock for the progress display's tests."""

import io


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal (no file descriptor: 80 columns)."""

    def isatty(self):
        return True


class FakeClock:
    """Seconds that move only when a test sets `now`."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def screen(stream: io.StringIO) -> list[str]:
    """What a terminal shows of `stream`: each line as its last `\\r` rewrites left it, trailing blanks dropped."""
    shown = []
    for line in stream.getvalue().split("\n"):
        text = ""
        for part in line.split("\r"):
            text = part + text[len(part):]
        shown.append(text.rstrip())
    return shown
