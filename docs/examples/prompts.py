"""Refuse long prompts: a rule of one's own added to a preset as one more part.

``ShortPrompts`` is the ``predictive`` preset's rules plus :class:`PromptBound`, which refuses a
prompt over ``max_prompt_tokens`` (reason ``too_large``, no Retry-After: sending it again cannot
help). ``qlab simulate --policy prompts:ShortPrompts --policy-arg max_prompt_tokens=256`` and
``qlab serve --policy prompts:ShortPrompts`` run it (the module must be importable: run from this
folder, or put it on PYTHONPATH).
"""

from dataclasses import dataclass

from qsim.outcomes import Reason
from qsim.policy import Policy, Rejection, View
from qsim.rules import Rule


@dataclass(frozen=True)
class PromptBound(Rule):
    """Refuse a prompt longer than ``max_prompt_tokens``."""

    max_prompt_tokens: int

    def check(self, view: View) -> Rejection | None:
        if view.prompt_tokens > self.max_prompt_tokens:  # the view is read by name
            return Rejection(
                Reason.TOO_LARGE,
                {"prompt_tokens": view.prompt_tokens, "max_prompt_tokens": self.max_prompt_tokens},
                None,
            )
        return None


@dataclass(frozen=True)
class ShortPrompts(Policy):
    """The predictive preset, and no prompt over ``max_prompt_tokens``."""

    predictive: bool = True
    expire_at_front: bool = True
    max_prompt_tokens: int = 512  # a parameter of its own: --policy-arg max_prompt_tokens=256

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.max_prompt_tokens >= 0:
            raise ValueError(f"max_prompt_tokens must be >= 0, got {self.max_prompt_tokens}")

    def make_rules(self):
        return (*super().make_rules(), PromptBound(self.max_prompt_tokens))
