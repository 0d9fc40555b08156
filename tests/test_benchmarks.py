"""The benchmarks run end to end on tiny settings, so they do not rot between the sessions that
measure with them. Only that they finish and print their tables is checked: never a timing."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_TIMEOUT_S = 100  # ~10 s each on 2 cores; below pytest's 120 s limit, so a hang fails with the output


def _run(script: str, *args: str, timeout_s: float = _TIMEOUT_S) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return proc.stdout


def test_allreduce_benchmark_prints_ratios_and_run_overhead():
    out = _run("allreduce.py", "--quick", "--sizes", "0.25", "--repeats", "1")
    for replicas in (1, 2, 4):
        assert re.search(rf"run, {replicas} replicas?\s+[0-9.]+\s+[0-9]+", out), out
    # (a busy machine can make a net time negative: only the row's presence is checked)
    rows = re.findall(r"^\s+2 (1 tensor|161 \(ResNet-50\))\s+0\.25\s+[0-9.]+\s+[0-9]+/[0-9]+(\s+-?[0-9.]+){4}", out, re.M)
    assert [r[0] for r in rows] == ["1 tensor", "161 (ResNet-50)"], out
    assert re.search(r"reduce_gradients within 2x of the floor in \d of 2 rows", out), out


def test_input_pipeline_benchmark_prints_every_row():
    out = _run("input_pipeline.py", "--images", "12", "--rounds", "1", "--batch", "4", "--no-pillow",
               "--tune-malloc")
    assert "glibc malloc tuned" in out, out
    for label in ("ours, simplejpeg", "no Dataset (ref.)", "processes (ceiling)"):
        assert re.search(rf"^{re.escape(label)}\s+[0-9]+ \(.*\)\s.*\s[0-9.]+x$", out, re.M), out


@pytest.mark.timeout(300)
def test_fit_throughput_benchmark_prints_every_row_and_the_scaling_curve():
    # (6 processes start, each importing torch: 60 s on the 2-core box at load 5, over 100 s at load 12)
    out = _run("fit_throughput.py", "--batches", "8", "--images", "16", "--rounds", "1", "--scaling", "1,2",
               "--model", "resnet8", "--tune-malloc", timeout_s=280)
    # (every row on the tuned allocator, the worker processes too: mirrored._allocator.child_environment)
    assert re.search(r"^machine: .* \| malloc tuned \(mr\.tune_allocator\)$", out, re.M), out
    assert re.findall(r"^model: resnet_cifar\(depth=(\d+)\)", out, re.M) == ["8"], out  # the small model (issue 35)
    assert re.search(r"load average before [0-9.]+ [0-9.]+ [0-9.]+, after", out), out
    assert re.search(r"^  memory format: fit's convolutions ran channels_last \(compile\(memory_format='auto'\)\); "
                     r"every row runs channels_last$", out, re.M), out  # (issue 29)
    for label in ("1 replica's step alone x 2", "2 independent processes at once",
                  "mirrored fit, 2 CPU replicas", "DDP (gloo), 2 processes x 1 thread", "plain PyTorch, 1 process"):
        assert re.search(rf"^  {re.escape(label)}.*\s[0-9.]+ \([0-9]+-[0-9]+\)\s+[0-9.]+\s+[0-9.]+$", out, re.M), out
    assert re.search(r"^  mirrored fit, 2 CPU replicas.*\s1\.000\s+[0-9.]+$", out, re.M), out  # fit / fit
    for replicas in (1, 2):
        assert re.search(rf"^\s+{replicas}\s+[0-9.]+ \([0-9]+-[0-9]+\)\s+[0-9.]+$", out, re.M), out


def test_fit_breakdown_benchmark_prints_the_parts_of_a_step():
    out = _run("fit_breakdown.py", "--batch", "8", "--steps", "2", "--rounds", "1")
    for part in ("forward + loss", "backward", "gradient all-reduce (reduce_gradients)",
                 "BatchNorm buffer sync (sync_buffers)", "step journal (before_forward)", "asleep (GIL, meetings)"):
        assert re.search(rf"^\s+{re.escape(part)}\s+-?[0-9.]+\s+(-?[0-9.]+|nan)\s+\(", out, re.M), out


def test_step_overhead_benchmark_prints_the_phases_the_scaling_and_the_python_tables():
    out = _run("step_overhead.py", "--quick")
    phases = r"\s+".join(["input", "split", "hand-off", "all-reduce", "metrics", "checks", "compute", "CPU total"])
    assert len(re.findall(phases, out)) == 2, out
    assert re.search(r"^  global batch 8(\s+-?[0-9.]+){9}$", out, re.M), out
    assert re.search(r"one replica's step alone [0-9.]+ ms \(the limit of 2 at once\)", out), out
    for replicas in (1, 2):
        assert re.search(rf"^  {replicas}(\s+-?[0-9.]+){{9}}$", out, re.M), out
    # Table 3 (issue 35): every row of fit's replica step beside the plain loop's, for both models, and the ratio.
    for net in ("resnet20", "resnet8"):
        assert re.search(rf"^  {net}: fit, per replica step", out, re.M), out
    for row in ("gradient all-reduce", "buffer sync", "checks \\(journal, copy watch\\)", "module forward \\(torch\\)",
                "other \\(threads, GC, what no row names\\)"):
        assert len(re.findall(rf"^    {row}[^\n]*?\s+-?[0-9.]+", out, re.M)) == 2, (row, out)
    assert len(re.findall(r"^    fit / plain loop \(untimed runs\): [0-9.]+ \(rounds: [0-9., ]+\); target <= 1\.25$",
                          out, re.M)) == 2, out
    assert len(re.findall(r"^    fit - plain loop: -?[0-9.]+ ms per replica step; on 8 replicas -?[0-9.]+ ms more", out,
                          re.M)) == 2, out


def test_vs_tensorflow_without_tensorflow_says_so_and_prints_our_rows(tmp_path):
    """TensorFlow is never installed with the package: with no interpreter that has it, the script
    names what is missing and still prints our rows, exit status 0."""
    out = _run("vs_tensorflow.py", "--tf-python", str(tmp_path / "no-python"), "--batches", "8", "--images", "8",
               "--calls", "5", "--rounds", "1")
    assert re.search(r"^TensorFlow: not run \(.*no-python.*\)", out, re.M), out
    assert re.search(r"^fit, global batch 8\s+mirrored\s+[0-9.]+ \([0-9]+-[0-9]+\)\s+1\.00x\s+[0-9.]+ \([0-9]+-[0-9]+\)"
                     r"\s+1\.00x$", out, re.M), out
    assert re.search(r"^fit, global batch 8\s+2 processes\s+[0-9.]+ ", out, re.M), out
    assert re.search(r"^target, fit, global batch 8: mirrored / 2 processes >= 0\.95x: (met|MISSED)", out, re.M), out
    assert re.search(r"^strategy\.run no-op, us per call\s+mirrored\s+[0-9.]+ ", out, re.M), out
    assert "TF 2.21" not in out, out


@pytest.mark.timeout(300)
def test_gpu_check_runs_in_cpu_smoke_mode():
    """benchmarks/gpu_check.py --cpu-smoke: every section runs (or says why it is skipped) and the
    table is printed, so the script that a GPU machine runs later has not rotted."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-smoke"], cwd=REPO,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    for section in ("environment", "cuda tests", "resnet50 fit vs plain", "resnet50 channels_last vs nchw",
                    "fp16 loss scaling", "sync batchnorm",
                    "fit on 2 replicas", "seeded dropout", "quiet steps", "checkpoint -> cpu", "profiler", "nccl"):
        assert re.search(rf"^{re.escape(section)}\s+(PASS|SKIP)\s+[0-9.]+\s+\S", proc.stdout, re.M), proc.stdout
    assert "12 of 12 sections without failure" in proc.stdout, proc.stdout


def test_replica_random_benchmark_prints_its_three_comparisons():  # issue 26
    out = _run("replica_random.py", "--quick")
    for label in ("1. strategy.run(noop)", "2. resnet_cifar(20)", "2b. the same forward", "3. MLP with 3 x Dropout"):
        assert label in out, out
    assert re.search(r"True / False: [0-9.]+$", out, re.M), out


@pytest.mark.slow
def test_multi_worker_benchmark_prints_every_contestant():
    """(~60 s: it starts 5 worker processes.)"""
    out = _run("multi_worker.py", "--depth", "8", "--steps", "1", "--rounds", "1", "--batch", "8")
    for name in ("2 workers x 1", "1 worker x 2", "DDP"):
        assert re.search(rf"^{re.escape(name)}\s+[0-9.]+\s+[0-9.]+$", out, re.M), out


def test_sparse_allreduce_benchmark_prints_both_ways_for_both_transports():
    out = _run("sparse_allreduce.py", "--quick")
    for who in ("2 replica threads", "2 workers (gloo, 1 thread each)"):
        assert who in out, out
    rows = re.findall(r"^\s+2000\s+8\s+[0-9.]+\s+[0-9.]+ \(\s*[0-9.]+\)\s+[0-9.]+ \(\s*[0-9.]+\)\s+[0-9.]+$", out, re.M)
    assert len(rows) == 4, out  # 2 shares x 2 transports
