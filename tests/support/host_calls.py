"""Counting a call's host work on CPU: the ATen and custom-op calls dispatched under `CountOps`,
and the launches of Triton kernels replaced by `KernelLaunches`' stand-ins (each costs a host-side
launch in an eager step)."""

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Counts the ATen / custom op calls dispatched under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))

    def count(self, func):
        return self.calls.count(func)


class _StandIn:
    def __init__(self, name: str, launched: list):
        self.name, self.launched = name, launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(self.name)


class KernelLaunches:
    """`replace(module, *names)` swaps those Triton kernels of `module` (through `monkeypatch`)
    for stand-ins that launch nothing and record their names, in launch order, in `names`."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.names: list[str] = []

    def replace(self, module, *names: str) -> None:
        for name in names:
            self.monkeypatch.setattr(module, name, _StandIn(name, self.names))
