"""Process accounting for the launcher tests: find processes by an environment tag."""
import os
import time
import uuid


def new_tag() -> dict:
    return {"LABUTILS_TEST_TAG": uuid.uuid4().hex}


def tagged_pids(tag: dict) -> list:
    key = f"LABUTILS_TEST_TAG={tag['LABUTILS_TEST_TAG']}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if key in env and state != "Z":
            pids.append(int(entry))
    return pids


def wait_gone(tag: dict, seconds: float = 5.0) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = tagged_pids(tag)
        if not left:
            return []
        time.sleep(0.1)
    return tagged_pids(tag)


def describe(pids: list) -> str:
    """One line per process: pid, state, parent and command line (what a failed "nothing outlived" check shows)."""
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            lines.append(f"pid {pid} state {fields[0]} parent {fields[1]}: {cmd[:200]}")
        except OSError:
            lines.append(f"pid {pid}: gone while being described")
    return "\n".join(lines)
