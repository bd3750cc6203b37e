"""setup.cfg's dependency bounds and constraints.txt tell one story: every requirement of the package and of its
extras is pinned in constraints.txt (what scripts/setup.sh and CI install), each upper bound is exactly the tested
pin, and each pin lies inside its bounds. Read with ``packaging`` and ``configparser``, not with project code."""

from __future__ import annotations

import configparser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BOUNDED = {"torch", "transformers", "accelerate", "peft", "lm-eval", "trl", "sentence-transformers"}


def _requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for _, value in cfg["options.extras_require"].items():
        lines += value.splitlines()
    return [Requirement(line.strip()) for line in lines if line.strip() and not line.strip().startswith("#")]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_every_requirement_is_pinned_within_its_bounds():
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} (setup.cfg) has no tested pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside setup.cfg's {req}")


def test_the_named_packages_have_a_tested_upper_bound_equal_to_the_pin():
    pins = _pins()
    seen = set()
    for req in _requirements():
        name = canonicalize_name(req.name)
        uppers = [Version(s.version) for s in req.specifier if s.operator == "<="]
        if name in BOUNDED:
            assert uppers, f"setup.cfg: {req} needs an upper bound (the newest version tested)"
            lowers = [Version(s.version) for s in req.specifier if s.operator == ">="]
            assert lowers, f"setup.cfg: {req} needs a lower bound (the oldest version tested)"
        for upper in uppers:
            assert upper == pins[name], f"setup.cfg: {req}'s upper bound is not the tested pin {pins[name]}"
        seen.add(name)
    assert BOUNDED <= seen, f"setup.cfg does not require {sorted(BOUNDED - seen)}"


def test_setup_script_installs_with_the_constraints():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    installs = [line for line in script.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs and all("-c constraints.txt" in line for line in installs), installs
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh" in ci
