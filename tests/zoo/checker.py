"""The checker: what became of one zoo entry, from what the worker wrote and what the
entry's library holds (tests.zoo.references).

Outcomes:
- correct: every row the worker analysed is a matrix the library holds (λ_max within
  TOLERANCE relative of float64 SVD; a too_small row by its shape), no two rows the same
  matrix, and every parameter of the library is some row, or of a kind (embedding, norm,
  conv1d, ...) that result.json's `coverage` says it skipped by a documented rule;
- refused: a failure record whose error is one line from the worker's own error handling
  (a PermanentModelError, exit 3): expected for the zoo's `refusal` entries;
- wrong: a row that is no matrix of the library (a wrong number), or an expected refusal
  that was analysed;
- partial-with-warning: something held is neither analysed nor skipped by a rule, and
  coverage's `warning` says so;
- silently partial: the same without a warning (or coverage's counts do not add up);
- crashed: no result and no failure record, or a failure that is not a clean refusal (an
  internal error, a traceback, a retryable failure);
- unknown: everything analysed is right but what was left out can only be judged from
  `coverage`, which result.json does not have yet.

Rows are matched to the library by shape (either orientation: Conv1D stores in × out) and
λ_max, never by name: the worker names rows by module names or checkpoint key stems, the
library by its own parameter names (fused experts, renamed keys). The match is one-to-one
(a maximum bipartite matching), so one matrix counted twice leaves another uncovered.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.zoo.catalog import Entry
from tests.zoo.library import MUST_ANALYSE, RULES_FOR, Ref, Unit

TOLERANCE = 1e-4  # relative, on λ_max, the bound at the default precision
MEASURED = frozenset({"ok", "fit_failed"})  # rows whose spectral_norm is λ_max
SHAPE_ONLY = frozenset({"too_small"})  # reported, not measured: matched by shape

CORRECT = "correct"
REFUSED = "refused"
WRONG = "wrong"
SILENT = "silently partial"
NOTED = "partial-with-warning"
CRASHED = "crashed"
UNKNOWN = "unknown"
NOT_BUILT = "not built"
OUTCOMES = (CORRECT, REFUSED, WRONG, SILENT, NOTED, CRASHED, UNKNOWN, NOT_BUILT)


@dataclass
class Outcome:
    entry: Entry
    outcome: str
    details: list[str] = field(default_factory=list)

    @property
    def cause(self) -> str:
        return self.details[0] if self.details else ""

    @property
    def as_expected(self) -> bool:
        return self.outcome == CORRECT or (
            self.outcome == REFUSED and self.entry.refusal is not None)


def _model_folder(output: Path, entry: Entry) -> tuple[Path, Path]:
    from esd_worker.core.models.naming import model_key

    key = model_key(str(entry.path))
    return output / key / "result.json", output / "_failures" / f"{key}.json"


def check_entry(entry: Entry, output: Path, units: list[Unit] | None) -> Outcome:
    """The entry's outcome; `units` its library's (None: the reference could not be read)."""
    if entry.not_built is not None:
        return Outcome(entry, NOT_BUILT, [entry.not_built])
    result, failure = _model_folder(output, entry)
    if result.is_file():
        if entry.refusal is not None:
            return Outcome(entry, WRONG, [f"analysed, expected a refusal ({entry.refusal})"])
        if units is None:
            return Outcome(entry, CRASHED, ["the reference could not be read"])
        marker = json.loads(result.read_text())
        rows = list(csv.DictReader(io.StringIO((result.parent / "layers.csv").read_text())))
        return judge(entry, marker, rows, units)
    if failure.is_file():
        return _failed(entry, json.loads(failure.read_text()))
    return Outcome(entry, CRASHED, ["neither result.json nor a failure record"])


def _failed(entry: Entry, record: dict[str, Any]) -> Outcome:
    from esd_worker.core import errors

    error = str(record.get("error", ""))
    name = error.split(":", 1)[0].strip()
    cls = getattr(errors, name, None)
    clean = (isinstance(cls, type) and issubclass(cls, errors.PermanentModelError)
             and record.get("exit_code") == 3 and not record.get("retryable")
             and "\n" not in error and "internal error" not in error and len(error) > len(name) + 2)
    return Outcome(entry, REFUSED if clean else CRASHED, [error or "(empty error)"])


def _match(rows: list[dict[str, str]], refs: list[Ref], first: set[int]
           ) -> tuple[dict[int, int], list[int]]:
    """Maximum one-to-one matching of measurable rows to refs: {row index: ref index}, and
    the rows left unmatched. A row tries the refs in `first` before the others (a too_small
    row, matched by shape alone, goes to a router's matrix before a stack of biases)."""
    edges: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        status = row.get("status", "")
        if status not in MEASURED | SHAPE_ONLY:
            continue
        shape = sorted((int(row["M"]), int(row["N"])))
        lam = float(row["spectral_norm"]) if row.get("spectral_norm") else math.nan
        edges[i] = sorted((j for j, ref in enumerate(refs) if sorted(ref.shape) == shape and (
            status in SHAPE_ONLY or abs(lam - ref.lam) <= TOLERANCE * abs(ref.lam))),
            key=lambda j: j not in first)
    owner: dict[int, int] = {}  # ref -> row

    def augment(i: int, seen: set[int]) -> bool:
        for j in edges[i]:
            if j in seen:
                continue
            seen.add(j)
            if j not in owner or augment(owner[j], seen):
                owner[j] = i
                return True
        return False

    # Rows with fewest candidates first: a shape-only row never takes a ref a measured
    # row needs when another is free.
    for i in sorted(edges, key=lambda i: len(edges[i])):
        augment(i, set())
    matched = {row: ref for ref, row in owner.items()}
    return matched, [i for i in edges if i not in matched]


def _nearest(row: dict[str, str], refs: list[tuple[str, Ref]]) -> str:
    shape = sorted((int(row["M"]), int(row["N"])))
    lam = float(row["spectral_norm"] or "nan")
    same = [(name, r) for name, r in refs if sorted(r.shape) == shape]
    if not same:
        return "the library holds no matrix of that shape"
    name, ref = min(same, key=lambda nr: abs(nr[1].lam - lam))
    off = abs(lam - ref.lam) / ref.lam if ref.lam else math.inf
    return f"nearest {name} λ_max={ref.lam:.6g} (off by {off:.2g} relative)"


def judge(entry: Entry, marker: dict[str, Any], rows: list[dict[str, str]],
          units: list[Unit]) -> Outcome:
    """The outcome of an analysed entry: its rows against its library's units."""
    refs: list[Ref] = []
    where: list[tuple[int, int]] = []  # ref -> (unit, alternative)
    for u, unit in enumerate(units):
        for a, alternative in enumerate(unit.alternatives):
            refs.extend(alternative)
            where.extend([(u, a)] * len(alternative))
    first = {j for j, (u, _a) in enumerate(where) if units[u].category in MUST_ANALYSE}
    matched, unmatched = _match(rows, refs, first)
    details: list[str] = []
    named = [(units[where[j][0]].name, ref) for j, ref in enumerate(refs)]
    for i in unmatched:
        row = rows[i]
        details.append(f"row {row['layer']} ({row['M']}x{row['N']}, {row['status']}) "
                       f"λ_max={row['spectral_norm']}: {_nearest(row, named)}")
    if details:
        return Outcome(entry, WRONG, details)
    taken = {where[j] for j in matched.values()}
    counts: dict[tuple[int, int], int] = {}
    for j in matched.values():
        counts[where[j]] = counts.get(where[j], 0) + 1
    covered = {u for u, unit in enumerate(units) for a, alt in enumerate(unit.alternatives)
               if (u, a) in taken and counts[(u, a)] == len(alt)}
    left = [unit for u, unit in enumerate(units) if u not in covered]
    unmeasured = [r for r in rows if r.get("status") not in MEASURED | SHAPE_ONLY]
    coverage = marker.get("coverage")
    rules = set((coverage or {}).get("skipped") or {})
    must = [u for u in left if u.category in MUST_ANALYSE or u.category not in RULES_FOR]
    ruled = [u for u in left if u not in must and RULES_FOR[u.category] & rules]
    unruled = [u for u in left if u not in must and u not in ruled]
    details += [f"{len(unmeasured)} row(s) not measured: " + ", ".join(
        f"{r['layer']} ({r['status']})" for r in unmeasured[:3])] if unmeasured else []
    if must:
        details.append(f"{len(must)} matrix(es) of the library in no row: " + ", ".join(
            f"{u.name} ({u.category})" for u in must[:3]))
    if coverage is None:
        if must or unmeasured:
            return Outcome(entry, SILENT, [*details, "result.json has no coverage"])
        if unruled:
            return Outcome(entry, UNKNOWN, [
                f"result.json has no coverage: {len(unruled)} parameter(s) left out by kind "
                f"({', '.join(sorted({u.category for u in unruled}))}) cannot be judged"])
        return Outcome(entry, CORRECT)
    if unruled:
        details.append(f"{len(unruled)} parameter(s) left out under no rule coverage lists: "
                       + ", ".join(f"{u.name} ({u.category})" for u in unruled[:3]))
    said = coverage.get("unexplained") or {}
    if said.get("tensors"):
        details.append(f"coverage: {said.get('tensors')} tensor(s) unexplained, e.g. "
                       + ", ".join(map(str, (said.get("examples") or [])[:3])))
    details += _count_problems(coverage, len(rows))
    if not details:
        return Outcome(entry, CORRECT)
    warning = coverage.get("warning")
    return Outcome(entry, NOTED if warning else SILENT,
                   details + ([f"warning: {warning}"] if warning else ["no coverage warning"]))


def _count_problems(coverage: dict[str, Any], rows: int) -> list[str]:
    """Coverage's tensors add up: analysed + each rule's + unexplained = held (`unexplained`
    absent: none, as when the worker refuses a model with unexplained tensors instead); its
    analysed matrices are layers.csv's rows."""
    try:
        matrices = int(coverage["analysed"]["matrices"])
        held = int(coverage["tensors"])
        unexplained = int((coverage.get("unexplained") or {}).get("tensors", 0))
        parts = (int(coverage["analysed"]["tensors"]) + unexplained
                 + sum(int(r["tensors"]) for r in coverage["skipped"].values()))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return [f"coverage is not in the documented form ({type(e).__name__}: {e})"]
    problems = []
    if held != parts:
        problems.append(f"coverage's tensors do not add up: {held} held, {parts} analysed, "
                        "skipped and unexplained")
    if matrices != rows:
        problems.append(f"coverage counts {matrices} matrices analysed, layers.csv has {rows} "
                        "rows")
    return problems
