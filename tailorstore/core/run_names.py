"""What a run may be named: a pure rule, shared by the store (run objects, manifest keys) and by
what reads a run's name from outside it (a job's head file beside DeepSpeed's ``latest``)."""

from __future__ import annotations

import re

RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")  # 1 to 100 letters, digits, '.', '_' or '-'; not '.' or '..'
