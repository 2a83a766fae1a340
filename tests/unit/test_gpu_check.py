"""tools/gpu_check.py on this CPU-only machine: it runs nothing and says so (exit 3)."""

import pytest
import torch

from kvtier.tools import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run the script itself")
def test_cpu_only_machine_gets_one_clear_line_and_exit_3(capsys):
    assert gpu_check.main([]) == gpu_check.EXIT_NO_GPU == 3
    err = capsys.readouterr().err
    assert err.startswith("gpu_check: no CUDA device here (torch 2.13.0") and "nothing was run" in err
