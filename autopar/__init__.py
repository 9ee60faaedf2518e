"""autopar: plan and run parallel training of transformers (see README.md)."""


def parallelize(*args, **kwargs):
    """``autopar.api.parallelize`` (imported on first use: it loads torch.distributed)."""
    from autopar.api import parallelize as _parallelize
    return _parallelize(*args, **kwargs)
