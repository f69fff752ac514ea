"""The report: every section's blocks as Markdown (with its figures beside it) and as one
self-contained HTML page (figures embedded as PNG data, the style inline)."""

from __future__ import annotations

import base64
import html

from ..tables import pipe_table, table_cell
from .blocks import Code, Failed, Figure, Table, Text, Verdict
from .section import Section


def _sentence(text: str) -> str:
    return "Evidence: " + text + ("" if text.endswith(".") else ".")


def _verdict_line(v: Verdict) -> str:
    name = v.label if v.label != "check" else "Check"
    return f"**{name} {v.word}**: {v.claim}. {_sentence(v.evidence)}"


def hypotheses(parts: list[tuple[Section, list]]) -> list[Verdict]:
    """The verdicts on hypotheses (not the checks), in the sections' order."""
    return [
        b for _, blocks in parts for b in blocks if isinstance(b, Verdict) and b.label != "check"
    ]


def render_markdown(
    title: str, preface: list[str], parts: list[tuple[Section, list]], figures: str
) -> str:
    out = [f"# {title}", "", *preface, "", "## Verdicts", ""]
    out += [f"- {_verdict_line(b)}" for b in hypotheses(parts)]
    out.append("")
    for number, (section, blocks) in enumerate(parts, 1):
        out += [f"## {number}. {section.title}", ""]
        for b in blocks:
            if isinstance(b, Text):
                out += [b.text, ""]
            elif isinstance(b, Verdict):
                out += [_verdict_line(b), ""]
            elif isinstance(b, Table):
                out += [f"*{b.caption}*", ""] if b.caption else []
                out += [pipe_table(b.frame) if len(b.frame) else "(empty)", ""]
            elif isinstance(b, Figure):
                out += [f"![{b.caption}]({figures}/{b.name}.png)", ""]
            elif isinstance(b, Code):
                out += ["```", b.text, "```", ""]
            elif isinstance(b, Failed):
                out += [f"**FAILED**: {b.error}", ""]
    return "\n".join(out)


CSS = (
    "body{font-family:system-ui,sans-serif;max-width:75em;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0 1.5em}"
    "th,td{border:1px solid #ccc;padding:2px 6px}th{background:#f0f0f0}"
    "caption{caption-side:top;text-align:left;font-style:italic;padding:4px 0}"
    ".verdict{padding:0.5em 0.8em;margin:0.8em 0;border-left:5px solid #999}"
    ".yes{border-color:#2a9d8f;background:#eef8f6}.no{border-color:#e76f51;background:#fdf0ec}"
    "img{max-width:100%}figure{margin:1em 0}figcaption{font-style:italic}"
)


def _html_block(b) -> str:
    if isinstance(b, Text):
        return f"<p>{html.escape(b.text)}</p>"
    if isinstance(b, Verdict):
        kind = {True: "yes", False: "no", None: ""}[b.supported]
        name = b.label if b.label != "check" else "Check"
        return (
            f'<div class="verdict {kind}"><b>{html.escape(name)} {b.word}</b>: '
            f"{html.escape(b.claim)}. "
            f"{html.escape(_sentence(b.evidence))}</div>"
        )
    if isinstance(b, Table):
        shown = b.frame.map(table_cell) if len(b.frame) else b.frame
        table = (
            shown.to_html(index=False, border=0, escape=True) if len(b.frame) else "<p>(empty)</p>"
        )
        return (f"<p><i>{html.escape(b.caption)}</i></p>" if b.caption else "") + table
    if isinstance(b, Code):
        return f"<pre>{html.escape(b.text)}</pre>"
    if isinstance(b, Failed):
        return f'<div class="verdict no"><b>FAILED</b>: {html.escape(b.error)}</div>'
    data = base64.b64encode(b.png).decode()
    return (
        f'<figure><img alt="{html.escape(b.caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(b.caption)}</figcaption></figure>"
    )


def render_html(title: str, preface: list[str], parts: list[tuple[Section, list]]) -> str:
    verdicts = hypotheses(parts)
    body = [
        f"<h1>{html.escape(title)}</h1>",
        *(f"<p>{html.escape(p)}</p>" for p in preface),
        "<h2>Verdicts</h2>",
        "<ul>" + "".join(f"<li>{_html_block(v)}</li>" for v in verdicts) + "</ul>",
    ]
    for number, (section, blocks) in enumerate(parts, 1):
        body.append(f'<h2 id="{section.name}">{number}. {html.escape(section.title)}</h2>')
        body += [_html_block(b) for b in blocks]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta '
        f'charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
