"""The long-lived worker imports transformers in a background thread
(esd_worker.analysis.layers.warm_up)
while its first model may already be discovering layers: the two must not race. Unserialised,
discovery saw a half-imported transformers ("no attribute 'AutoConfig'") and silently fell back
to name-based layers, one run in one (a fresh interpreter each time: imports happen once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import REPO_ROOT

_CHILD = r"""
import json, sys, threading
from pathlib import Path
from esd_worker.analysis.metamodel import discover_layers, warm_up
from esd_worker.analysis.weights import Checkpoint

warm = threading.Thread(target=warm_up, kwargs={"cuda": False})
warm.start()
with Checkpoint(Path(sys.argv[1])) as ckpt:
    found = discover_layers(Path(sys.argv[1]), ckpt, include_embeddings=False,
                            trust_remote_code=False)
warm.join()
print(json.dumps({"discovery": found.discovery, "layers": len(found.layers)}))
"""


def test_warm_up_beside_a_discovery_changes_nothing(gpt2_dir: Path) -> None:
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", _CHILD, str(gpt2_dir)], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout.splitlines()[-1])["discovery"] == "architecture", run.stderr
