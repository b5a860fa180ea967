"""Imported once by the suite's forkserver (`harness.PRELOAD`), before it forks any job: torch (and
torch._dynamo, which the first DDP() imports), the trainers the integration jobs run and the experiment
trackers' clients, each seconds of import per process otherwise. One that is not installed is passed over.

Then every object imported so far is frozen out of the garbage collector: a forked job's full collection
would otherwise walk (and, writing each object's GC header, copy page by page) the whole imported heap
every time, and the jobs collect at each teardown."""

from __future__ import annotations

import gc
import importlib

from tokaudit._recipes import INTEGRATIONS

MODULES = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.nn.parallel",
    "scenarios.strategies",
    *(module for integration in INTEGRATIONS for module in integration.modules),
    # the trackers' clients, and what W&B imports when a run starts
    "torch.utils.tensorboard",
    "mlflow",
    "wandb",
    "wandb.sdk.launch",
    "wandb.apis.public",
)

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:
        pass
gc.freeze()
