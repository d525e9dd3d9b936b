"""Shared test settings."""
import os

import pytest

RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _restore_rendezvous_env():
    """A test that starts DeepSpeed or torch.distributed in this process must not leak its rendezvous
    variables (a port it still holds) into later tests or into the nbval kernels started from this process."""
    saved = {k: os.environ.get(k) for k in RENDEZVOUS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
