"""The labels of a sweep's curves: a policy's curve named by the sweep's axes that tell its variants
apart ("predictive / two-tenant / immediate", :func:`per_variant`), by its client set alone
(:func:`per_client_set`), or by its [policy_args] variant (:func:`_with_args`)."""

from __future__ import annotations

import pandas as pd


def per_client_set(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its policy labelled "POLICY / CLIENTS" where it holds more than one client set
    (the sweep's ``clients`` axis; "no clients" for requests naming none), else as it is."""
    if "clients" not in table:
        return table
    sets = _axis_text(table, "clients")
    if sets.nunique() < 2:
        return table
    return table.assign(policy=table["policy"].astype(str) + " / " + sets)


#: Axes of a sweep that label a policy's curve when they hold more than one value (None: "none").
VARIANT_AXES = (
    "clients",
    "retry",
    "patience",
    "used",
    "speed_schedule",
    "estimator",
    "fixed_estimate",
    "cancel_at_deadline",
    "arrivals",
    "policy_args",
)
#: How a yes/no axis reads in a label: (its False, its True).
FLAG_LABELS = {
    "fixed_estimate": ("tracking", "fixed estimate"),
    "cancel_at_deadline": ("runs on", "cut at deadline"),
}


#: What a cell without an axis's value is, in a label: "none / none" said nothing of which "none"
#: was the policy and which the client set.
NONE_WORDS = {
    "clients": "no clients",
    "retry": "no retries",
    "patience": "no patience",
    "used": "full lengths",
    "speed_schedule": "steady speed",
    "estimator": "own estimator",
    "policy_args": "preset",
}


def _axis_text(table: pd.DataFrame, axis: str) -> pd.Series:
    """An axis's values as label text: a cell without in words (NONE_WORDS; "none" for any other),
    a yes/no axis in words."""
    none = NONE_WORDS.get(axis, "none")
    if axis in FLAG_LABELS:
        no, yes = FLAG_LABELS[axis]
        return table[axis].map(lambda v: none if pd.isna(v) else yes if bool(v) else no).astype(str)
    text = table[axis].astype(object).where(table[axis].notna(), "none").astype(str)
    return text.where(text != "none", none)


def per_variant(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its policy labelled "POLICY / CLIENTS / RETRY / PATIENCE", naming each of
    those axes that holds more than one value (NONE_WORDS for a cell without), else as it is; with
    only a clients axis the same as :func:`per_client_set`."""
    parts = []
    for axis in VARIANT_AXES:
        if axis in table:
            values = _axis_text(table, axis)
            if values.nunique() > 1:
                parts.append(values)
    if not parts:
        return table
    label = table["policy"].astype(str)
    for values in parts:
        label = label + " / " + values
    return table.assign(policy=label)


def _with_args(table: pd.DataFrame) -> pd.Series:
    """The policy column, with its [policy_args] variant where the row has one: "adaptive-lifo /
    lifo_threshold=4"."""
    if "policy_args" not in table:
        return table["policy"].astype(str)
    args = table["policy_args"].astype(object)
    return table["policy"].astype(str) + args.map(
        lambda a: "" if a is None or a != a else f" / {a}"
    )
