"""autopar's cost model: pure Python + numpy, no torch.

``stage_costs`` gives the per-stage coefficients the solver optimises over; ``estimate``
evaluates exactly them for one placement. See ``cost_models.stages`` for the formulas.
"""

from cost_models.axes import Axis, Degrees
from cost_models.estimate import estimate, even_stage_layers, model_flops_per_step, stage_costs
from cost_models.hardware import HardwareProfile, LinkTier, ProfileError, load_profile
from cost_models.model_profile import ModelProfile
from cost_models.stages import StageCosts
from cost_models.strategy import Estimate, Strategy

__all__ = [
    "Axis", "Degrees", "Estimate", "HardwareProfile", "LinkTier", "ModelProfile", "ProfileError", "StageCosts",
    "Strategy", "estimate", "even_stage_layers", "load_profile", "model_flops_per_step",
    "stage_costs",
]
