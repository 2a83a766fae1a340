"""tools/gpu_check.py on this CPU-only machine: the CPU checks run and pass, every CUDA check says
SKIP, and the exit code says no GPU was there (3); a selection of CPU checks alone exits 0."""

import pytest
import torch

from kvtier.tools import gpu_check

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run the script itself")


def test_cpu_only_machine_runs_the_cpu_checks_and_skips_every_cuda_check(capsys):
    assert gpu_check.main(["--skip-vllm"]) == gpu_check.EXIT_NO_GPU == 3
    out, err = capsys.readouterr()
    lines = out.splitlines()
    verdicts = {line.split(":")[0] for line in lines[:-1]}
    assert verdicts == {f"PASS {n}" for n in gpu_check.CPU_CHECKS} | {
        f"SKIP {n}" for n in gpu_check.CUDA_CHECKS if n not in gpu_check.SERVING_CHECKS}
    assert any(line.startswith("PASS staged_path: 8 chunks x 32 layers gathered bitwise in 8 host copies") for line in lines)
    assert lines[-1] == '{"passed": 2, "failed": 0, "skipped": 12, "device": "none"}'
    assert err.startswith("gpu_check: no CUDA device here: the CPU checks ran, every CUDA check was skipped")


def test_only_cpu_checks_pass_with_exit_0_and_unknown_names_are_refused(capsys):
    assert gpu_check.main(["--only", "headroom,staged_path"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS ") == 2 and "SKIP" not in out
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--only", "nope"])
    assert exit_info.value.code == 2
    assert "unknown check(s) nope; known: staged_path, headroom, bandwidth" in capsys.readouterr().err
