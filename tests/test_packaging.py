"""setup.cfg's dependency ranges, constraints.txt (the newest tested set) and constraints-min.txt (the lowest
supported set) tell one story: every requirement of the package and of its extras has a lower bound, is pinned at
exactly that bound in constraints-min.txt and inside its range in constraints.txt; no upper bound shuts out a tested
version or the releases the package promises to install beside (torch 2.8-2.15, transformers 5.2-5.25; kvpress
needs transformers < 5.3); CI runs the suite on both sets.
Read with ``packaging`` and ``configparser``, not with project code."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# releases a user may already have that installing the plugin must keep (the promise in setup.cfg's comment)
MUST_ADMIT = {
    "torch": ["2.8.0", "2.9.1", "2.12.0", "2.13.0", "2.14.1", "2.15.0"],
    "transformers": ["5.2.0", "5.3.0", "5.4.0", "5.10.1", "5.24.0", "5.25.0"],
}


def _requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for _, value in cfg["options.extras_require"].items():
        lines += value.splitlines()
    return [Requirement(line.strip()) for line in lines if line.strip() and not line.strip().startswith("#")]


def _pins(filename: str) -> dict[str, Version]:
    pins = {}
    for line in (ROOT / filename).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{filename}: {line!r} is not NAME==VERSION"
            assert canonicalize_name(name) not in pins, f"{filename} pins {name} twice"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _lower_bound(req: Requirement) -> Version:
    lowers = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert len(lowers) == 1, f"setup.cfg: {req} needs one lower bound (>=, the oldest version tested)"
    return lowers[0]


def test_every_requirement_is_pinned_within_its_bounds():
    pins = _pins("constraints.txt")
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} (setup.cfg) has no tested pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside setup.cfg's {req}")


def test_lowest_constraints_pin_every_requirement_at_its_lower_bound():
    lowest = _pins("constraints-min.txt")
    floors: dict[str, Version] = {}
    for req in _requirements():
        name = canonicalize_name(req.name)
        floor = _lower_bound(req)
        assert floors.setdefault(name, floor) == floor, f"setup.cfg gives {name} two lower bounds"
        assert name in lowest, f"{req} (setup.cfg) is not pinned at its lower bound in constraints-min.txt"
        assert lowest[name] == floor, f"constraints-min.txt pins {name}=={lowest[name]}, setup.cfg's floor is {floor}"
    assert set(lowest) == set(floors), (
        f"constraints-min.txt pins packages setup.cfg does not require: {sorted(set(lowest) - set(floors))}")


def test_no_upper_bound_shuts_out_a_tested_or_promised_release():
    newest = _pins("constraints.txt")
    seen = set()
    for req in _requirements():
        name = canonicalize_name(req.name)
        for version in MUST_ADMIT.get(name, []):
            assert req.specifier.contains(version), f"setup.cfg: {req} refuses {name} {version}"
        assert req.specifier.contains(newest[name]), f"setup.cfg: {req} refuses the tested {name} {newest[name]}"
        seen.add(name)
    assert set(MUST_ADMIT) <= seen


@pytest.mark.parametrize("name", ["torch", "transformers", "accelerate", "peft", "datasets", "evaluate"])
def test_the_main_libraries_have_a_range_not_a_pin(name):
    (req,) = [r for r in _requirements() if canonicalize_name(r.name) == name]
    assert _lower_bound(req) < _pins("constraints.txt")[name], (
        f"setup.cfg: {req} admits only the tested {name}; a user's own {name} would be replaced")


def test_setup_and_ci_install_with_the_constraints():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    installs = [line for line in script.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    # --press: kvpress pins transformers<5.3, so its venv takes constraints.txt less the pins that range shuts out
    press = '-c "$press_constraints"'
    assert installs and all("-c constraints.txt" in line or press in line for line in installs), installs
    assert "constraints.txt > \"$press_constraints\"" in script or press not in script
    lowest = (ROOT / "scripts" / "check_lowest.sh").read_text()
    assert "constraints-min.txt" in lowest and "pytest" in lowest
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh" in ci and "bash scripts/check_lowest.sh" in ci
