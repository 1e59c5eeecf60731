"""Calls that mypy must reject: the runner keywords are typed (``Unpack[CaptureKwargs]``).

Never run, only type-checked by ``check_typed_keywords.py`` beside it: the call after
each ``# mypy rejects:`` comment must get exactly one mypy error containing the text
after the colon, and every other call must pass, so a misspelt keyword is caught at the
call site rather than at run time.
"""

import torch

import graphguard as gg

x = (torch.zeros(2),)
# mypy rejects: Unexpected keyword argument "sizess" for "GraphRunner"
gg.GraphRunner(lambda t: t, x, sizess=[1, 2])
# mypy rejects: Unexpected keyword argument "warmup_iter" for "PiecewiseRunner"
gg.PiecewiseRunner(lambda t: t, x, split_ops=[], warmup_iter=2)
# mypy rejects: Unexpected keyword argument "progres" for "CaptureOptions"
gg.CaptureOptions(progres=False)
# mypy rejects: Unexpected keyword argument "max_size" for "GraphRunner"
gg.GraphRunner(lambda t: t, x, max_size=64)
# mypy rejects: Argument "progress" to "GraphRunner" has incompatible type "str"
gg.GraphRunner(lambda t: t, x, sizes=[1, 2], progress="no")
gg.GraphRunner(lambda t: t, x, sizes=[1, 2], progress=False, fill_values=0)
gg.PiecewiseRunner(lambda t: t, x, split_ops=[], options=gg.CaptureOptions(sizes=[1]))
gg.GraphRunner(lambda t: t, x, options=gg.CaptureOptions(max_size=64, warmup_iters=2))
