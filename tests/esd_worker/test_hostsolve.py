"""Host eigensolvers beside the device (esd_worker.analysis.hostsolve), the device played by
the CPU: which side takes a layer (only an idle host thread, within the memory budget, that
would end before the device ends the model), a model analysed with host solvers gives the
plain path's results (the same float64 solve of the same Gram matrices: α within 1e-9),
a failing host solve stops the run, and how many host solvers a worker runs by default
(the CPUs its affinity, cgroup quota and $ESD_CPU_SHARE leave)."""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from esd_worker.analysis.hostsolve import HostSolvers, default_host_solvers, solve_units
from esd_worker.analysis.metamodel import discover_layers
from esd_worker.analysis.modellayers import LayerAnalysis
from esd_worker.analysis.spectra import gram_matrices, solve_gram, sorted_evals
from esd_worker.analysis.weights import Checkpoint
from esd_worker.core.command.settings import AnalysisSettings
from esd_worker.core.cpus import CPU_SHARE_ENV, cgroup_quota, usable_cpus
from esd_worker.fetch.resolve import ResolvedModel
from tests.support.builders import make_llama

CPU = torch.device("cpu")


def a_gram(n: int = 24, seed: int = 0):  # type: ignore[no-untyped-def]
    w = torch.randn(n + 8, n, generator=torch.Generator().manual_seed(seed))
    return gram_matrices(w, "Linear")


def offered(host: HostSolvers, units: float = 1.0, remaining: float = 1e9
            ) -> Future[np.ndarray] | None:
    return host.offer(a_gram(), units, remaining, 1, lambda evals: evals)


# -- which side ----------------------------------------------------------------------------------


def test_the_device_solves_until_its_rate_is_known() -> None:
    host = HostSolvers(2, pinned=False)
    try:
        assert offered(host) is None
        host.device_solved(1.0, 0.01)
        future = offered(host)
        assert future is not None
        g = a_gram()
        assert np.array_equal(future.result(), sorted_evals(solve_gram(g.gram, fallback=g.mats)))
        assert host.host_layers == 1
    finally:
        host.close()


def test_a_layer_goes_to_the_host_only_if_it_ends_before_the_device() -> None:
    """Unmeasured, the host counts HOST_PRIOR (30) times slower: a layer goes there only with
    at least 30 of its like left for the device; once measured, by the measured rates."""
    host = HostSolvers(1, pinned=False)
    try:
        host.device_solved(10.0, 1.0)
        assert offered(host, units=10.0, remaining=299.0) is None
        first = offered(host, units=10.0, remaining=300.0)
        assert first is not None
        first.result()
        assert host._host_rate is not None
        host._host_rate = 0.2  # measured: twice the device's time a unit
        assert offered(host, units=10.0, remaining=19.0) is None
        second = offered(host, units=10.0, remaining=20.0)
        assert second is not None
        second.result()
    finally:
        host.close()


def test_no_layer_goes_to_a_busy_host_or_past_the_budget() -> None:
    gate = threading.Event()
    host = HostSolvers(1, pinned=False)
    try:
        host.device_solved(1.0, 1e-6)
        busy = host.offer(a_gram(), 1.0, 1e9, 1, lambda evals: gate.wait(10))
        assert busy is not None
        assert offered(host) is None  # its one thread is busy
        gate.set()
        busy.result()
        assert offered(host) is not None
    finally:
        host.close()
    small = HostSolvers(4, pinned=False, budget_bytes=a_gram().nbytes)
    try:
        small.device_solved(1.0, 1e-6)
        assert offered(small) is None  # the slot, its float64 copy and LAPACK's do not fit
    finally:
        small.close()


def test_none_without_host_threads() -> None:
    host = HostSolvers(0, pinned=False)
    try:
        host.device_solved(1.0, 1.0)
        assert offered(host) is None
        assert host.finish(lambda x: x + 1, 1).result() == 2  # the finisher is always there
    finally:
        host.close()


def test_solve_units() -> None:
    assert solve_units((64, 32), conv2d=False) == 32.0**3
    assert solve_units((8, 4, 3, 3), conv2d=True) == 9 * 4.0**3


# -- a model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 blocks of equal layers: enough left after each for the host to take some."""
    return make_llama(tmp_path_factory.mktemp("deep") / "llama", hidden_size=64,
                      intermediate_size=128, num_layers=12)


def analysed(folder: Path, host_solvers: int) -> LayerAnalysis:
    model = ResolvedModel(ref=str(folder), model_id=str(folder), revision=None,
                          resolved_revision=None, directory=folder, source="local")
    with Checkpoint(folder) as ckpt:
        job = LayerAnalysis(model, discover_layers(folder, ckpt), ckpt.read, AnalysisSettings(),
                            [CPU], None, False, reader=ckpt, host_solvers=host_solvers)
        job.run()
    return job


def test_host_solvers_give_the_devices_results(deep_llama: Path) -> None:
    plain = analysed(deep_llama, 0)
    dealt = analysed(deep_llama, 2)
    assert dealt.host is not None and dealt.host.host_layers > 0
    assert plain.host is not None and plain.host.host_layers == 0
    assert [r["layer"] for r in dealt.rows] == [r["layer"] for r in plain.rows]
    for got, want in zip(dealt.rows, plain.rows, strict=True):
        for column in ("alpha", "xmin", "spectral_norm", "stable_rank", "entropy"):
            assert math.isclose(got[column], want[column], rel_tol=1e-9), (got["layer"], column)
        assert got["num_evals"] == want["num_evals"]
    for name, evals in plain.eigs.items():
        np.testing.assert_allclose(dealt.eigs[name], evals, rtol=1e-9, atol=1e-12 * evals[-1])


def test_a_failing_host_solve_stops_the_run(deep_llama: Path) -> None:
    class Broken(RuntimeError):
        pass

    model = ResolvedModel(ref="m", model_id="m", revision=None, resolved_revision=None,
                          directory=deep_llama, source="local")
    with Checkpoint(deep_llama) as ckpt:
        job = LayerAnalysis(model, discover_layers(deep_llama, ckpt), ckpt.read,
                            AnalysisSettings(), [CPU], None, False, reader=ckpt, host_solvers=2)

        def broken(*args: object) -> None:
            raise Broken("host")

        job._host_fitted = broken  # type: ignore[method-assign]
        with pytest.raises(Broken):
            job.run()
    assert job.host is not None and job.host.host_layers >= 1
    # Stopped by the failure itself (Streams.fail), not found only when results were read.
    assert job.streams is not None and job.streams.stopping.is_set()
    assert not any(t.name.startswith(("esd-host-solve", "esd-finish", "esd-read"))
                   for t in threading.enumerate())


# -- how many by default ---------------------------------------------------------------------------


def test_the_default_leaves_the_devices_and_the_readers_their_cores() -> None:
    gpu = [torch.device("cuda:0")]
    assert default_host_solvers([CPU], cpus=64) == 0
    assert default_host_solvers(gpu, cpus=16) == 13
    assert default_host_solvers(gpu * 2, cpus=16) == 12
    assert default_host_solvers(gpu, cpus=2) == 0
    assert default_host_solvers(gpu, cpus=192) == 32  # a pod without a CPU limit


def cgroup(tmp_path: Path, files: dict[str, str], self_cgroup: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(self_cgroup)
    return root, proc


@pytest.mark.parametrize(("files", "self_cgroup", "expected"), [
    pytest.param({"cpu.max": "max 100000\n"}, "0::/\n", math.inf, id="v2-no-limit"),
    pytest.param({"cpu.max": "max 100000\n", "pod/cpu.max": "450000 100000\n",
                  "pod/ctr/cpu.max": "max 100000\n"}, "0::/pod/ctr\n", 4.5, id="v2-pod-limit"),
    pytest.param({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
                  "cpu/k/cpu.cfs_quota_us": "300000\n", "cpu/k/cpu.cfs_period_us": "100000\n"},
                 "4:memory:/k\n1:cpu,cpuacct:/k\n0::/\n", 3.0, id="v1-quota"),
    pytest.param({}, "garbage", math.inf, id="unreadable"),
])
def test_the_cgroup_quota(tmp_path: Path, files: dict[str, str], self_cgroup: str,
                          expected: float) -> None:
    root, proc = cgroup(tmp_path, files, self_cgroup)
    assert cgroup_quota(root, proc) == expected


def test_usable_cpus_is_the_smallest_limit(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "150000 100000\n"}, "0::/\n")
    cores = len(__import__("os").sched_getaffinity(0))
    assert usable_cpus(cgroup=root, proc_cgroup=proc, env={}) == min(cores, 1.5)
    none, proc = cgroup(tmp_path / "none", {}, "0::/\n")
    assert usable_cpus(cgroup=none, proc_cgroup=proc, env={}) == cores
    assert usable_cpus(cgroup=none, proc_cgroup=proc, env={CPU_SHARE_ENV: "0.5"}) == 1.0
    assert usable_cpus(cgroup=none, proc_cgroup=proc, env={CPU_SHARE_ENV: "x"}) == cores


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        pytest.param("four", "'four'", id="text"),
        pytest.param("0", "'0'", id="zero"),
        pytest.param("-2", "'-2'", id="negative"),
        pytest.param("nan", "'nan'", id="nan"),
        pytest.param("inf", "'inf'", id="inf"),
        pytest.param("2\x1b[2J\nWARNING forged", "'2\\x1b[2J\\nWARNING forged'",
                     id="escapes-on-one-line"),
    ],
)
def test_a_bad_cpu_share_is_ignored_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: str, shown: str
) -> None:
    """A share that is no number of CPUs above 0 is not silently dropped: one warning line,
    however often the CPUs are asked for, names the variable, shows the value (escaped: no
    control byte reaches the log) and the CPUs used instead (affinity and quota alone). The
    warning is once a process for each value: no other test here uses these values."""
    none, proc = cgroup(tmp_path, {}, "0::/\n")
    cores = len(__import__("os").sched_getaffinity(0))
    env = {CPU_SHARE_ENV: value}
    with caplog.at_level(logging.WARNING, logger="esd_worker.core.cpus"):
        got = [usable_cpus(cgroup=none, proc_cgroup=proc, env=env) for _ in range(3)]
    assert got == [float(cores)] * 3
    assert [r.getMessage() for r in caplog.records if r.name == "esd_worker.core.cpus"] == [
        f"ESD_CPU_SHARE={shown} is not a number of CPUs above 0: "
        f"ignored, using {cores} CPU(s) (the cores this process may run on, within its "
        "cgroup's CPU quota)"]


@pytest.mark.parametrize("flag", [[], ["--host-eigensolvers", "2"]], ids=["default", "two"])
def test_the_worker_flag_reaches_the_analysis(deep_llama: Path, tmp_path: Path,
                                              flag: list[str]) -> None:
    """`esd-worker --host-eigensolvers N` runs N host solvers beside the device (here the
    CPU, whose default is none) and says so in result.json; the layers are the plain run's."""
    import json
    import subprocess

    from esd_worker.core.store.results import layers_from_csv
    from tests.support import REPO_ROOT
    from tests.support.builders import worker_command

    out = tmp_path / "out"
    run = subprocess.run([*worker_command(), "--model", str(deep_llama), "--output", str(out),
                          "--device", "cpu", *flag], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)},
                         timeout=300)
    assert run.returncode == 0, run.stderr
    [folder] = [p for p in out.iterdir() if (p / "result.json").exists()]
    device = json.loads((folder / "result.json").read_text())["device"]
    assert device["host_eigensolvers"] == (2 if flag else 0)
    plain = analysed(deep_llama, 0)
    rows = layers_from_csv((folder / "layers.csv").read_bytes())
    assert [r["layer"] for r in rows] == [r["layer"] for r in plain.rows]
    for got, want in zip(rows, plain.rows, strict=True):
        assert math.isclose(float(got["alpha"]), want["alpha"], rel_tol=1e-9)
