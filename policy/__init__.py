"""The controller's decisions, as pure code over typed snapshots.

    decision = decide(snapshot, now)

imports nothing but `shared.contracts`: the autoscaler service, `replay
--verify-decisions` and the policy lab's simulated cluster all call this very
code. The alias's policy (`hybrid.py`, `heteroscale.py`, `baselines.py`)
proposes; the shared rules (`rules.py`) bound and pace every policy's proposal
the same way; `reconcile.py` turns the plan into ordered commands with ids
derived from the decision; `placement.py` is the placement service's choice
of a worker for a new instance (seed 000 §7). Every threshold the
controller compares against is read here, from the snapshot's settings, and
nowhere else.
"""

from policy.decide import POLICIES, UnknownPolicy, decide, policy_named

__all__ = ["POLICIES", "UnknownPolicy", "decide", "policy_named"]
