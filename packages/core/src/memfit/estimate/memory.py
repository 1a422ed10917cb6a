"""The old home of the step description, its accounting and its runs, split by job; kept so that code
written against it keeps working. Current names:

- ``memfit.step``: ``TrainStep``, ``default_optimizer``, ``AMP_DTYPES`` (users: ``memfit.memory``);
- ``memfit.estimate.tracker``: the accounting (``MemoryReport``, ``_StorageTracker``, ``GIB``...), the fast
  fake-tensor path and building any model under fake tensors (``fake_mode``, ``build_model``);
- ``memfit.estimate.steps``: running a step for real or on fake tensors (``measure_training_step``,
  ``estimate_training_step``, ``measure_peak``, ``memtracker_peak``).

A setting changed here (``FAST_FAKE``) does not reach the code: set it on ``memfit.estimate.tracker``.
"""

from memfit.estimate.steps import (  # noqa: F401
    PeakMemory,
    _autocast,
    _prime_optimizer,
    _run_step,
    _tracked_steps,
    estimate_training_step,
    measure_peak,
    measure_training_step,
    memtracker_peak,
    training_state_tensors,
)
from memfit.estimate.tracker import (  # noqa: F401
    _FAKE_ATTRS,
    _INPLACE_RESULT,
    _KEY_IGNORES,
    _LARGE_WRITE,
    _LOCAL_SCALAR,
    _NO_CACHE_TAGS,
    _NONE_MADE,
    _OP_KIND,
    _OUT_META,
    _PRIM_DEVICE,
    _QUERIES,
    _QUERY_IDS,
    _SCALAR_TYPES,
    _SCALARS,
    _UNCACHED,
    CATEGORIES,
    FAST_FAKE,
    GIB,
    MIB,
    WORKSPACES,
    MemoryReport,
    _build,
    _fake_deepcopy,
    _fake_view,
    _fast_fake_call,
    _key_of,
    _meta,
    _new_fake,
    _old_objects_frozen,
    _op_kind,
    _out_meta,
    _query,
    _Ref,
    _remember,
    _SkipLargeWrites,
    _spare_storage,
    _StorageTracker,
    _tensors,
    _to_fake,
    build_model,
    fake_mode,
)
from memfit.step import AMP_DTYPES, TrainStep, default_optimizer  # noqa: F401
