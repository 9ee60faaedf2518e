"""codegen + runtime: a Plan becomes a per-rank program on stock torch.distributed.

Nothing here calls the solver: the Plan is the only input besides the model spec it names.
"""

from autopar.runtime.launch import RunSpec, run_job, run_plan
from autopar.runtime.train import RunResult, TrainConfig

__all__ = ["RunResult", "RunSpec", "TrainConfig", "run_job", "run_plan"]
