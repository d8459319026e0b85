"""The zoo's acceptance table (issue 41): build the zoo of tiny random-weight checkpoints
(tests/zoo: every family, format, quantized scheme and peft method), analyse it with one
`esd-worker --models` process on the CPU, judge every entry against its own library
(tests.zoo.checker) and print the markdown table: per family, how many were built, correct,
refused, wrong, silently partial, partial with a warning, crashed, unknown; then every
entry not correct with its one-line cause; then the share handled as expected and the
wall times. The same run as tests/esd_worker/test_zoo.py, without its assertions.

  python benchmarks/zoo_report.py                     # in a temporary folder, removed
  python benchmarks/zoo_report.py --keep /tmp/zoo     # keep the models, output and log
  python benchmarks/zoo_report.py --json zoo.json     # the outcomes as JSON too

Exit 0 when the acceptance holds (no wrong, no silently partial, >= 95% as expected, each
expected refusal refused), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.zoo.checker import REFUSED, SILENT, WRONG  # noqa: E402
from tests.zoo.run import ZooRun, markdown_table, run_zoo  # noqa: E402


def accepted(run: ZooRun) -> bool:
    bad = [o for o in run.outcomes if o.outcome in (WRONG, SILENT)]
    unrefused = [o for o in run.outcomes if o.entry.refusal is not None and o.outcome != REFUSED]
    return not bad and not unrefused and run.share >= 0.95


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build and analyse here, and keep it")
    parser.add_argument("--json", type=Path, help="write every entry's outcome here")
    args = parser.parse_args(argv)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        run = run_zoo(args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="esd-zoo-") as tmp:
            run = run_zoo(Path(tmp))
    print(markdown_table(run))
    if args.json is not None:
        args.json.write_text(json.dumps([
            {"entry": o.entry.name, "family": o.entry.family, "outcome": o.outcome,
             "expected_refusal": o.entry.refusal, "details": o.details}
            for o in run.outcomes], indent=2))
    return 0 if accepted(run) else 1


if __name__ == "__main__":
    sys.exit(main())
