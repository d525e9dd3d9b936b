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
