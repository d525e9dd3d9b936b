"""The pins: requirements.txt, environment.yml and the 3.11 lock must agree, and everything is pinned exactly."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;]+)(?:\s*;\s*(.+))?$")


def requirement_pins(python="3.11") -> dict:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = PIN.match(line)
        assert m, f"requirements.txt: {line!r} is not pinned exactly with =="
        name, version, marker = m.groups()
        if marker:
            op, wanted = re.match(r'python_version\s*([<>=!]+)\s*"([\d.]+)"', marker).groups()
            have = tuple(map(int, python.split(".")))
            want = tuple(map(int, wanted.split(".")))
            if not {">=": have >= want, "<": have < want, "==": have == want}[op]:
                continue
        pins[name.lower()] = version
    return pins


def environment_pins() -> dict:
    pins = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"^\s*-\s+([A-Za-z0-9_.\-]+)==(\S+)\s*$", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_environment_yml_matches_requirements():
    assert environment_pins() == requirement_pins("3.11")


def test_environment_yml_uses_the_recorded_python():
    assert re.search(r"^\s*-\s+python=3\.11\s*$", (ROOT / "environment.yml").read_text(), re.M)


def test_lock_agrees_with_requirements():
    lock = {}
    for line in (ROOT / "constraints-py311.txt").read_text().splitlines():
        if "==" in line:
            name, version = line.strip().split("==")
            lock[name.lower().replace("_", "-")] = version
    for name, version in requirement_pins("3.11").items():
        assert lock.get(name.replace("_", "-")) == version, f"{name}: requirements {version}, lock {lock.get(name)}"


def test_torch_and_deepspeed_pins():
    pins = requirement_pins("3.11")
    assert pins["torch"] == "2.13.0" and pins["deepspeed"] == "0.19.8"
    assert requirement_pins("3.10")["numpy"] != pins["numpy"]  # 3.10 gets its own numpy
