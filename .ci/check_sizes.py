"""Size rules that keep the code readable in one sitting (run by `make lint`).

- no Python file over 500 lines (the packages, their tests and the benchmarks), but for
  EXEMPT: a fake whose size is the thing it fakes;
- no class over 250 lines in the packages (controller/, esd_worker/);
- controller.run.sweep.run_sweep under 60 lines and free of isinstance checks (the sweep
  never asks which backend it has: docs/design.md).
Prints every breach, one per line, and exits 1 when there is one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("controller", "esd_worker", "tests", "benchmarks", "examples")
MAX_FILE = 500
MAX_CLASS = 250
MAX_RUN_SWEEP = 60
CLASS_TREES = ("controller", "esd_worker")
# The Kubernetes API fake: kmock's emulator extended with what the controller relies on
# (selectors, watches, 410s, garbage collection, faults) is one attrs class by kmock's design.
EXEMPT = frozenset({"tests/support/kubesim.py"})


def breaches(root: Path = ROOT) -> list[str]:
    found: list[str] = []
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            rel = path.relative_to(root)
            text = path.read_text(encoding="utf-8")
            lines = text.count("\n") + (not text.endswith("\n") and bool(text))
            if lines > MAX_FILE and rel.as_posix() not in EXEMPT:
                found.append(f"{rel}: {lines} lines (at most {MAX_FILE})")
            if tree not in CLASS_TREES:
                continue
            module = ast.parse(text, filename=str(rel))
            for node in ast.walk(module):
                if isinstance(node, ast.ClassDef):
                    size = (node.end_lineno or node.lineno) - node.lineno + 1
                    if size > MAX_CLASS:
                        found.append(f"{rel}:{node.lineno}: class {node.name} has {size} "
                                     f"lines (at most {MAX_CLASS})")
    sweep = ast.parse((root / "controller" / "run" / "sweep.py").read_text(encoding="utf-8"))
    for node in sweep.body:
        if isinstance(node, ast.FunctionDef) and node.name == "run_sweep":
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size >= MAX_RUN_SWEEP:
                found.append(f"controller/run/sweep.py: run_sweep has {size} lines "
                             f"(under {MAX_RUN_SWEEP})")
            for call in ast.walk(node):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                        and call.func.id == "isinstance"):
                    found.append(f"controller/run/sweep.py:{call.lineno}: isinstance in run_sweep")
    return found


def main() -> int:
    found = breaches()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
