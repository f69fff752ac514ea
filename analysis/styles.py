"""How the figures tell policies and outcomes apart: one colour per policy, in every figure and the
notebook.

A policy's colour depends on its name alone, never on which other policies a figure shows, so
``predictive`` is the same blue beside three policies or ten. A curve labelled by a variant of a
policy ("predictive / two-tenant", see :func:`analysis.plot_labels.per_variant`) keeps its policy's
colour and gets a line style, marker and hatch of its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

#: Okabe and Ito's eight colours, which colour-blind readers tell apart too ("Color Universal
#: Design").
OKABE_ITO = {
    "black": "#000000",
    "orange": "#e69f00",
    "sky blue": "#56b4e9",
    "bluish green": "#009e73",
    "yellow": "#f0e442",
    "blue": "#0072b2",
    "vermillion": "#d55e00",
    "reddish purple": "#cc79a7",
}

#: Every built-in policy (qsim.policy.PRESETS) in the order figures list them: the reference study's
#: four first, then the other predictive ones, then the orders that need no estimate. The first
#: eight take the Okabe-Ito colours (grey for none, the baseline), so that the headline pair,
#: bounded and predictive, are orange and blue: apart in hue and lightness alike, for every reader.
POLICY_COLORS: dict[str, str] = {
    "none": "#999999",  # grey: the baseline
    "bounded": OKABE_ITO["orange"],
    "bounded-deadline": OKABE_ITO["bluish green"],
    "predictive": OKABE_ITO["blue"],
    "predictive-edf": OKABE_ITO["reddish purple"],
    "predictive-sjf": OKABE_ITO["vermillion"],
    "predictive-priority": OKABE_ITO["sky blue"],
    "predictive-reserved": OKABE_ITO["yellow"],
    "predictive-fair": "#bcbd22",  # olive
    "adaptive-lifo": "#17becf",  # cyan
    "codel": "#393b79",  # indigo
    "predictive-kv": "#ff9896",  # light red: predictive that also knows the memory
    "vllm-caps": "#98df8a",  # light green
    "llm-d-shed": "#c5b0d5",  # lavender
}
#: A policy of one's own (module:Class) takes one of these, chosen by a checksum of its name, so it
#: too keeps its colour from figure to figure (two such policies may share one).
OTHER_COLORS = (
    "#637939",
    "#8c6d31",
    "#843c39",
    "#7b4173",
    "#5254a3",
    "#8ca252",
    "#bd9e39",
    "#ad494a",
    "#a55194",
    "#6b6ecf",
    "#b5cf6b",
    "#e7ba52",
    "#d6616b",
    "#ce6dbd",
)

OUTCOME_COLORS = {
    "good": "#2a9d8f",
    "late": "#e9c46a",
    "rejected": "#e76f51",
    "expired": "#8d99ae",
    "error": "#264653",
    "abandoned": "#b56576",
    "cancelled": "#6d597a",
}

#: What tells a policy's variants apart, the first variant (in a figure's order) getting the first
#: of each.
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")
HATCHES = ("", "//", "..", "xx")

#: Between a policy's name and its variant in a curve's label (analysis.plot_labels.per_variant).
VARIANT_SEPARATOR = " / "


def base_policy(label: str) -> str:
    """The policy a curve's label is of: "predictive" for "predictive / two-tenant"."""
    return str(label).split(VARIANT_SEPARATOR, 1)[0]


def variant(label: str) -> str:
    """The variant a curve's label names: "two-tenant" for "predictive / two-tenant", "" for
    "predictive"."""
    return str(label).partition(VARIANT_SEPARATOR)[2]


def policy_order(labels: Iterable[str]) -> list[str]:
    """Curves' labels in the order figures list them: by policy (:func:`policy_rank`, then name), a
    policy's variants in the order their variants first appear among all ``labels``."""
    labels = list(dict.fromkeys(labels))
    variants = list(dict.fromkeys(map(variant, labels)))
    return sorted(
        labels,
        key=lambda label: (policy_rank(label), base_policy(label), variants.index(variant(label))),
    )


def policy_color(label: str) -> str:
    """The colour of a policy (or of a variant of one): fixed per name."""
    name = base_policy(label)
    if name in POLICY_COLORS:
        return POLICY_COLORS[name]
    # crc32, not hash(): Python salts str hashes per process, and the colour must not change between
    # runs.
    return OTHER_COLORS[zlib.crc32(name.encode()) % len(OTHER_COLORS)]


def policy_rank(label: str) -> int:
    """Where a policy comes in a figure: the built-in ones in POLICY_COLORS' order, any other
    after them."""
    order = list(POLICY_COLORS)
    name = base_policy(label)
    return order.index(name) if name in order else len(order)


@dataclass(frozen=True)
class PolicyStyle:
    """How one curve (or bar) of a policy is drawn."""

    color: str
    linestyle: str = "-"
    marker: str = "o"
    hatch: str = ""

    def line(self) -> dict:
        """Keyword arguments of Axes.plot."""
        return {"color": self.color, "ls": self.linestyle, "marker": self.marker}

    def bar(self) -> dict:
        """Keyword arguments of Axes.bar (a white edge so that a hatch shows on a dark colour)."""
        return {
            "color": self.color,
            "hatch": self.hatch,
            "edgecolor": "white" if self.hatch else None,
        }


def policy_styles(labels: Iterable[str]) -> dict[str, PolicyStyle]:
    """A style for each label: its policy's colour, and a line style, marker and hatch by its
    variant (the part after " / "), in the order the variants first appear."""
    labels = list(dict.fromkeys(labels))
    variants = list(dict.fromkeys(map(variant, labels)))
    styles = {}
    for label in labels:
        i = variants.index(variant(label)) if len(variants) > 1 else 0
        styles[label] = PolicyStyle(
            policy_color(label),
            LINE_STYLES[i % len(LINE_STYLES)],
            MARKERS[i % len(MARKERS)],
            HATCHES[i % len(HATCHES)],
        )
    return styles
