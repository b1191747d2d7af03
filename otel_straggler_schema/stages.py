"""Megatron timer names -> coarse stage groups (``otel_straggler_schema.STAGE_GROUPS``).

Names are matched EXACTLY (megatron-core 0.12-0.16 ``megatron/core`` and ``megatron/training``); only
two documented families use a rule: ``startup-*`` (training.py startup timestamps) and
``*-data-iterators-setup`` (train/valid/test iterator setup). Anything else is ``other``: an unknown
name is never guessed into a group.
"""

from __future__ import annotations

from typing import Final

STAGE_SCHEMA: Final = "megatron-v1"

P2P_TIMERS: Final = (
    "forward-recv",
    "backward-recv",
    "forward-send",
    "backward-send",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "forward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
)

# The timers inside ``optimizer``, in the order Megatron's optimizer step runs them.
OPTIMIZER_TIMERS: Final = (
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
)

STAGE_GROUP_BY_NAME: Final[dict[str, str]] = {
    # level 2
    "forward-compute": "forward",
    "backward-compute": "backward",
    "batch-generator": "data",
    **dict.fromkeys(P2P_TIMERS, "p2p"),
    # level 1
    "forward-backward": "step",
    "all-grads-sync": "grad-sync",
    "conditional-embedder-grads-all-reduce": "grad-sync",
    "non-tensor-parallel-grads-all-reduce": "grad-sync",
    "embedding-grads-all-reduce": "grad-sync",
    **dict.fromkeys(("optimizer", *OPTIMIZER_TIMERS), "optimizer"),
    "params-all-gather": "param-gather",
    # level 0 (training.py)
    "interval-time": "step",
    "eval-time": "eval",
    "evaluate": "eval",
    "save-checkpoint": "checkpoint",
    "save-checkpoint-non-persistent": "checkpoint",
    "load-checkpoint": "checkpoint",
    "model-and-optimizer-setup": "setup",
}

# Timers whose time is an all-reduce over the model-parallel group (TP x PP x CP): the found-inf flag, the gradient
# norm, the zero count. A rank slow there waits for a member of its group, it is not slow itself.
MP_WAIT_TIMERS: Final = ("optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros")
# Timers that enclose MP_WAIT_TIMERS: their excess is a wait where those timers' excess explains it.
MP_WAIT_ENCLOSING: Final[dict[str, tuple[str, ...]]] = {"optimizer": MP_WAIT_TIMERS}

# (prefix or suffix, group): a name with more than the prefix (suffix) to it
PREFIX_RULES: Final = (("startup-", "setup"),)
SUFFIX_RULES: Final = (("-data-iterators-setup", "setup"),)


def stage_group(name: str) -> str:
    """Group of a timer name; ``other`` when the name is not a known Megatron timer."""
    group = STAGE_GROUP_BY_NAME.get(name)
    if group is not None:
        return group
    for prefix, g in PREFIX_RULES:
        if name.startswith(prefix) and len(name) > len(prefix):
            return g
    for suffix, g in SUFFIX_RULES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return g
    return "other"
