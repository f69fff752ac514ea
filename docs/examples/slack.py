"""Least slack first: a qlab policy of one's own, written once, run everywhere.

``qlab simulate --policy slack:LeastSlack``, a sweep's ``policy = ["slack:LeastSlack"]``,
``qlab serve --policy slack:LeastSlack --policy-arg weight=0.5`` and ``qlab compare`` all
read it the same way (the module must be importable: run from this folder, or put it on
PYTHONPATH).
"""

from dataclasses import dataclass

from qsim.disciplines import Keyed
from qsim.policy import Policy


class SlackOrder(Keyed):
    """Start the waiting request with the least slack: its deadline minus weight x its estimate."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.weight = weight

    def key(self, entry) -> tuple:
        return (entry.due - self.weight * entry.base_s,)  # an entry: qsim.entry.Entry


@dataclass(frozen=True)
class LeastSlack(Policy):
    """Predictive admission, expiry at the front, and least-slack order."""

    predictive: bool = True
    expire_at_front: bool = True
    weight: float = 1.0  # a parameter of its own: --policy-arg weight=0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.weight >= 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")

    def make_discipline(self):
        return SlackOrder(self.weight)
