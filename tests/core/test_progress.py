"""The progress display of the command-line tools (`torch_msa._progress`), on a fake clock and fake streams."""

import io

import pytest

from tests.support.terminal import FakeClock, FakeTerminal, screen
from torch_msa._progress import Progress, format_duration


def test_format_duration():
    assert [format_duration(s) for s in (0, 9.9, 61, 3599, 3600, 7322)] == ["0:00", "0:09", "1:01", "59:59", "1:00:00",
                                                                          "2:02:02"]


def test_terminal_line_counts_steps_and_estimates_the_time_left_from_the_rate():
    clock, stream = FakeClock(), FakeTerminal()
    progress = Progress("[1/2] T=8192", 4, stream=stream, clock=clock)
    assert screen(stream)[-1] == "[1/2] T=8192: 0/4 done, 0:00 elapsed, ? left"
    progress.start("torch_msa fwd")
    clock.now += 10
    progress.advance()
    progress.start("torch_msa bwd")
    assert screen(stream)[-1] == "[1/2] T=8192: 1/4 done, torch_msa bwd, 0:10 elapsed, about 0:30 left"
    clock.now += 20
    progress.advance()
    assert screen(stream)[-1] == "[1/2] T=8192: 2/4 done, 0:30 elapsed, about 0:30 left"
    progress.log("torch_msa bwd  20.000 ms")
    progress.advance(2)
    progress.close()
    assert screen(stream) == ["torch_msa bwd  20.000 ms", "[1/2] T=8192: 4/4 done, 0:30 elapsed", ""]


def test_an_expected_duration_replaces_the_rate_for_its_step():
    clock, stream = FakeClock(), FakeTerminal()
    progress = Progress("running the ops", 3, stream=stream, clock=clock, rate_estimate=False, leave=False)
    progress.start("select_blocks")
    assert progress.left_s() is None and screen(stream)[-1].endswith("? left")
    clock.now += 2
    progress.advance()
    progress.start("forward")
    assert progress.left_s() is None  # no rate estimate: forward and backward are unknown
    clock.now += 8
    progress.advance()
    progress.start("backward", expected_s=20.0)
    assert screen(stream)[-1] == "running the ops: 2/3 done, backward, 0:10 elapsed, about 0:20 left"
    clock.now += 5
    assert progress.left_s() == 15.0
    clock.now += 30
    assert progress.left_s() == 0.0  # late, not negative
    progress.advance()
    progress.close()
    assert screen(stream) == [""]  # leave=False clears the line


def test_a_line_written_on_a_terminal_goes_above_the_display():
    stream, other = FakeTerminal(), io.StringIO()
    progress = Progress("warm-up", 2, stream=stream, clock=FakeClock())
    progress.write("  select_blocks: 3.0 ms", file=other)
    progress.write("a traceback")
    assert other.getvalue() == "  select_blocks: 3.0 ms\n"
    assert screen(stream) == ["a traceback", "warm-up: 0/2 done, 0:00 elapsed, ? left"]


def test_the_line_fits_the_terminal():
    stream = FakeTerminal()  # no file descriptor: 80 columns
    progress = Progress("x" * 200, 1, stream=stream, clock=FakeClock())
    assert max(len(line) for line in screen(stream)) == 79
    progress.close()


def test_quiet_when_the_stream_is_not_a_terminal():
    clock, stream = FakeClock(), io.StringIO()
    with Progress("[2/2] T=32768", 3, stream=stream, clock=clock) as progress:
        for step in ("fwd", "bwd", "select+fwd+bwd"):
            progress.start(step)
            progress.log(f"{step} row")  # detail: dropped
            clock.now += 25
            progress.advance()
        assert stream.getvalue() == ""
    assert stream.getvalue() == "[2/2] T=32768: 3/3 in 1:15\n"  # one plain line per stage


def test_a_stopped_stage_says_so_and_errors_are_always_written():
    clock, stream = FakeClock(), io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        with Progress("T=128", 5, stream=stream, clock=clock) as progress:
            progress.advance()
            progress.write("Traceback: boom")
            clock.now += 3
            raise KeyboardInterrupt
    assert stream.getvalue() == "Traceback: boom\nT=128: stopped at 1/5 after 0:03\n"


def test_no_summary_means_nothing_on_a_non_terminal():
    stream = io.StringIO()
    with Progress("running the ops", 3, stream=stream, summary=False) as progress:
        progress.advance(3)
    assert stream.getvalue() == ""


@pytest.mark.parametrize("total", [-1, 1.5, True, "3"])
def test_bad_totals_are_refused(total):
    with pytest.raises(ValueError, match=f"total: expected an int >= 0 steps, got {total!r}"):
        Progress("x", total, stream=io.StringIO())
