"""launch_kernel: every Triton launch takes its warps and stages from ops/launch.py, and steps
the stages down where the device's shared memory cannot hold them."""
import re
from pathlib import Path

import pytest
from triton.runtime.errors import OutOfResources

import cp_linattn
from cp_linattn.ops import launch as launch_module
from cp_linattn.ops.launch import LAUNCH, launch_kernel


class FakeKernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **kw)` fails like Triton's launch
    when `num_stages` exceeds what fits (`fits`), and records the calls."""

    def __init__(self, fits: int):
        self.fits, self.calls = fits, []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append((grid, args, kw))
            if kw["num_stages"] > self.fits:
                raise OutOfResources(100_000 * kw["num_stages"], 232_448, "shared memory")
        return run


@pytest.fixture(autouse=True)
def fresh_table(monkeypatch):
    monkeypatch.setattr(launch_module, "_FITTED_STAGES", {})
    monkeypatch.setitem(LAUNCH, "fake_launch", dict(BK=64, num_warps=4, num_stages=3))


def test_entry_settings_when_they_fit():
    kernel = FakeKernel(fits=3)
    launch_kernel(kernel, (2, 1), "fake_launch", "x", 7, K=256, FLAG=True)
    assert kernel.calls == [((2, 1), ("x", 7), dict(K=256, FLAG=True, num_warps=4, num_stages=3))]
    assert launch_module._FITTED_STAGES == {}


def test_stages_step_down_and_are_remembered_per_configuration():
    kernel = FakeKernel(fits=1)
    launch_kernel(kernel, (1,), "fake_launch", K=256)
    assert [kw["num_stages"] for _, _, kw in kernel.calls] == [3, 2, 1]
    kernel.calls.clear()
    launch_kernel(kernel, (1,), "fake_launch", K=256)  # remembered: no failed attempt
    assert [kw["num_stages"] for _, _, kw in kernel.calls] == [1]
    kernel.calls.clear()
    launch_kernel(FakeKernel(fits=3), (1,), "fake_launch", K=64)  # another configuration keeps 3
    assert LAUNCH["fake_launch"]["num_stages"] == 3  # the table itself is not changed


def test_one_stage_too_many_names_the_launcher():
    with pytest.raises(OutOfResources, match=r"fake_launch.*lower its BK/BV caps"):
        launch_kernel(FakeKernel(fits=0), (1,), "fake_launch", K=512)


def test_every_kernel_launch_goes_through_launch_kernel():
    """A direct `name[grid](...)` launch would bypass both the table and the fallback."""
    package = Path(cp_linattn.__file__).parent
    direct = [f"{p.relative_to(package)}: {m.group(0)}" for p in package.rglob("*.py") if p.name != "launch.py"
              for m in re.finditer(r"\b\w*kernel\w*\[[^\]]*\]\(", p.read_text())]
    assert not direct, direct
