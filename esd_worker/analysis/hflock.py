"""The one lock around importing and using transformers in a worker.

transformers is imported lazily, module by module: two threads importing it at once can see
it half initialised ("module 'transformers' has no attribute 'AutoConfig'", seen with
warm_up running beside a discovery), and a discovery would silently fall back. Whoever
imports or uses it to build or read a model (esd_worker.analysis.metamodel,
esd_worker.analysis.modulemap) holds this lock.
"""

from __future__ import annotations

import threading

TRANSFORMERS = threading.RLock()
