"""`python -m sparse_jax.bench.accelerator STAGE PLAN_JSON`: one stage of the report, its results
as JSON lines on stdout (the driver keeps the last)."""

import json
import sys

from sparse_jax.bench.accelerator import MODULES, run_stage
from sparse_jax.bench.accelerator.common import emit

if len(sys.argv) != 3 or sys.argv[1] not in MODULES:
    raise SystemExit("usage: python -m sparse_jax.bench.accelerator STAGE PLAN_JSON "
                     f"(STAGE one of {', '.join(MODULES)})")
emit(run_stage(sys.argv[1], json.loads(sys.argv[2])))
