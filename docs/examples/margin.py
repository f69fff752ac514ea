"""A safety margin on the deadline: an admission rule of one's own, written once, run everywhere.

Predictive admission compares an estimate with the deadline, but an estimate is a mean: with noisy
engines about half of what only just fits ends late. ``Margin`` is the predictive preset's rules and
one more part, :class:`KeepMargin`, which refuses a request unless its estimated wait plus service
fits ``margin_s`` inside its deadline. ``qlab simulate --policy margin:Margin --policy-arg
margin_s=0.3``, a sweep's ``policy = ["margin:Margin"]`` (with ``[policy_args."margin:Margin"]``),
``qlab serve --policy margin:Margin`` and ``qlab compare`` all run it
(the module must be importable: run from this folder, or put it on PYTHONPATH).
"""

from dataclasses import dataclass

from qsim.outcomes import Reason
from qsim.policy import Policy, Rejection, View, retry_after
from qsim.rules import Rule


@dataclass(frozen=True)
class KeepMargin(Rule):
    """Refuse unless the estimated wait plus service ends ``margin_s`` before the deadline."""

    margin_s: float

    def check(self, view: View) -> Rejection | None:
        if view.deadline_s is None:
            return None
        # the core's estimate of its wait (a batching engine's projection where there is one)
        wait = view.wait
        if wait + view.est_service_s > view.deadline_s - self.margin_s:
            return Rejection(
                Reason.DEADLINE_UNREACHABLE,
                {
                    "wait_s": wait,
                    "est_service_s": view.est_service_s,
                    "deadline_s": view.deadline_s,
                    "margin_s": self.margin_s,
                },
                retry_after(wait),
            )
        return None


@dataclass(frozen=True)
class Margin(Policy):
    """Predictive admission and expiry at the front, with ``margin_s`` seconds kept free before
    each deadline."""

    predictive: bool = True
    expire_at_front: bool = True
    margin_s: float = 0.3  # a parameter of its own: --policy-arg margin_s=0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.margin_s >= 0:
            raise ValueError(f"margin_s must be >= 0, got {self.margin_s}")

    def make_rules(self):
        # The built-in checks first (bounds, the deadline itself), so their reasons come first.
        return (*super().make_rules(), KeepMargin(self.margin_s))
