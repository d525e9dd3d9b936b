"""launch() from a real Jupyter kernel: cell-defined functions and classes, cell source in tracebacks."""
import nbformat
from nbclient import NotebookClient

CELLS = [
    """
import torch, torch.distributed as dist
from labutils import launch, WorkerError
torch.ones(256, 256) @ torch.ones(256, 256)   # the kernel has run a matmul: fork would be unsafe now

class Stats:
    def __init__(self, rank, total):
        self.rank, self.total = rank, total

def work(n):
    t = torch.full((n,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return Stats(dist.get_rank(), t)
""",
    """
out = launch(work, 2, 3)
assert all(isinstance(o, Stats) for o in out), [type(o) for o in out]
assert torch.equal(out[1].total, torch.full((3,), 3.0))
print("ok", [o.rank for o in out])
""",
    """
def broken():
    if dist.get_rank() == 0:
        value = {}["missing key in a notebook cell"]
    dist.barrier()

try:
    launch(broken, 2, timeout=60)
except WorkerError as e:
    err = e
assert err.rank == 0, err
assert 'value = {}["missing key in a notebook cell"]' in err.remote_traceback, err.remote_traceback
print("traceback shows the cell line")
""",
]


def test_launch_from_a_notebook_kernel(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.strip()) for c in CELLS])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "ok [0, 1]" in outputs
    assert "traceback shows the cell line" in outputs
