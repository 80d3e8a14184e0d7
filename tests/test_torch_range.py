"""nanoforge declares a range of torch versions, never one: `pip install nanoforge` beside a user's newer torch
must keep it. The range must admit the torch this suite runs on and the one `make setup` installs."""
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def torch_requirements() -> list[Requirement]:
    """Every requirement on torch: the dependencies' and every extra's."""
    lists = [PROJECT["dependencies"], *PROJECT.get("optional-dependencies", {}).values()]
    return [r for r in (Requirement(line) for deps in lists for line in deps) if r.name == "torch"]


def test_torch_is_a_range_with_a_floor_and_no_pin():
    reqs = torch_requirements()
    assert len(reqs) == 1 and reqs[0] in map(Requirement, PROJECT["dependencies"]), reqs  # once, in dependencies
    specs = list(reqs[0].specifier)
    assert not [s for s in specs if s.operator in ("==", "===", "~=")], f"torch is pinned: {reqs[0]}"
    assert [s for s in specs if s.operator == ">="], f"torch has no lower bound: {reqs[0]}"


def test_the_range_admits_the_installed_torch_and_the_makefiles():
    spec = torch_requirements()[0].specifier
    installed = Version(version("torch")).public  # 2.13.0+cpu is 2.13.0 built for the CPU
    assert spec.contains(installed, prereleases=True), f"torch {installed} is outside {spec}"
    pinned = re.search(r"^TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pinned and spec.contains(pinned[1]), f"the Makefile's TORCH is outside {spec}"
