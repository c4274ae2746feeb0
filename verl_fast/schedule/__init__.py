"""``verl_fast.schedule``: the batch scheduler under the package's short name, so that
``from verl_fast.schedule import rollout_buckets`` works as ``vf.schedule.rollout_buckets`` does.
The module is ``verl_fast.ops.schedule`` itself (this name is bound to it; no second copy)."""

import sys

from verl_fast.ops import schedule

sys.modules[__name__] = schedule
