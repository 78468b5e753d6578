"""What every benchmark command shares: its arguments checked before any heavy work, and its
end on Ctrl-C.

A bad argument (a value out of range, a device that is not there, a CUDA-only command on a host
without a GPU) ends the command as `argparse` ends it: the usage, a message naming the argument,
the expected and the actual value, and exit status 2, never a traceback.

`exits_on_interrupt` wraps a command's `main`: Ctrl-C at any moment of the run ends it with an
`interrupted: ...` line on stderr and exit status 130 (the shell's code for a command stopped by
SIGINT) instead of a `KeyboardInterrupt` traceback. A command that keeps partial results says
where they are with `interrupted` itself. Before `main`, while the command's imports run (torch's
take seconds), `stop_cleanly_while_starting` (which the package installs under `python -m`) does
the same.

The module imports torch only where a device is checked: the package imports it at start-up.
"""

import argparse
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INTERRUPTED_EXIT_STATUS = 130


def at_least(minimum: int | float, kind: type = int) -> Callable[[str], int | float]:
    """An argparse `type`: the argument as `kind` (int or float), refused below `minimum`."""
    expected = f"{'an integer' if kind is int else 'a number'} >= {minimum}"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return convert


def parsed(parser: argparse.ArgumentParser, parse: Callable, *arguments):
    """`parse(*arguments)`; a ValueError from it (whose message names the argument) ends the
    command as a usage error."""
    try:
        return parse(*arguments)
    except ValueError as error:
        parser.error(str(error))


def device(parser: argparse.ArgumentParser, name: str | None) -> "torch.device":
    """The `torch.device` `--device name` asks for (None: CUDA when present, else CPU); a usage
    error when it is not a CPU or CUDA device, names CUDA on a host without it, or a GPU index
    not there."""
    import torch

    from torch_msa.testing import pick_device

    chosen = parsed(parser, pick_device, name)
    if chosen.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: expected cpu, cuda or cuda:N, got {name!r}")
    if chosen.type == "cuda" and chosen.index is not None and chosen.index >= torch.cuda.device_count():
        parser.error(f"argument --device: expected a GPU index below {torch.cuda.device_count()} (the GPUs this "
                     f"host has), got {name!r}")
    return chosen


def cuda_device(parser: argparse.ArgumentParser, name: str | None, why: str,
                capability: tuple[int, int] | None = None) -> "torch.device":
    """`device(parser, name)`, which must be a CUDA device (of compute `capability` when given):
    a usage error otherwise, saying `why` the command needs it."""
    import torch

    chosen = device(parser, name)
    if chosen.type != "cuda":
        parser.error(f"needs a CUDA device ({why}); " + ("found no GPU" if name is None else f"got --device {name}"))
    if capability is not None and torch.cuda.get_device_capability(chosen) != capability:
        found = torch.cuda.get_device_capability(chosen)
        parser.error(f"needs a compute capability {capability[0]}.{capability[1]} GPU ({why}), found "
                     f"{torch.cuda.get_device_name(chosen)} (compute capability {found[0]}.{found[1]})")
    return chosen


def output_directory(parser: argparse.ArgumentParser, path: str, argument: str = "--out") -> str:
    """`path`, created if missing (the directory a command writes its results to); a usage error
    when it cannot be created or written."""
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"argument {argument}: expected a directory, got {path!r}, a file")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        parser.error(f"argument {argument}: expected a directory it can create or write, got {path!r} "
                     f"({error.strerror or error})")
    if not os.access(path, os.W_OK | os.X_OK):
        parser.error(f"argument {argument}: expected a directory it can write, got {path!r} (not writable)")
    return path


def interrupted(detail: str) -> int:
    """Say on stderr that Ctrl-C stopped the command (`detail`: what it leaves) and return the
    exit status of an interrupted command."""
    print(f"interrupted: {detail}", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT_STATUS


def _stop_while_starting(signum, frame):
    raise SystemExit(interrupted("stopped by Ctrl-C while the command started"))


def stop_cleanly_while_starting() -> None:
    """Until a command's `main` runs, make Ctrl-C end the process at once with the `interrupted`
    line and status 130 (a SystemExit, which Python ends without a traceback); `main`, wrapped
    by `exits_on_interrupt`, hands Ctrl-C back to Python's KeyboardInterrupt."""
    signal.signal(signal.SIGINT, _stop_while_starting)


def exits_on_interrupt(main: Callable[..., int]) -> Callable[..., int]:
    """`main`, returning `INTERRUPTED_EXIT_STATUS` after an `interrupted` line where a
    KeyboardInterrupt would have ended it (what `main` already reported stays as it is)."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        if signal.getsignal(signal.SIGINT) is _stop_while_starting:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            return interrupted("stopped by Ctrl-C before the command finished")

    return run


def git_commit() -> str | None:
    """The commit of the checkout torch_msa runs from (with `-dirty` for local changes), or None outside git."""
    import torch_msa

    source = os.path.dirname(os.path.abspath(torch_msa.__file__))
    try:
        commit = subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", source, "status", "--porcelain", "--untracked-files=no", "."],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def torch_msa_origin() -> str:
    """`torch_msa VERSION from FOLDER (COMMIT)`: the tree a run measures. `python -m` puts the working
    directory first on the module path, so this is how two runs meant to time two trees show that
    they did (docs/performance.md, "Comparing two trees")."""
    import torch_msa

    folder = os.path.dirname(os.path.abspath(torch_msa.__file__))
    return f"torch_msa {torch_msa.__version__} from {folder} ({git_commit() or 'not a git checkout'})"
