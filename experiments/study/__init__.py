"""``qlab study``: the whole reference study (docs/study.md) as one resumable command, written up.

The study is a list of sections (:data:`experiments.study.runner.SECTIONS`), run in order into
``DIR/sections/NAME/``:

theory, reference (hypotheses H1-H3), burst, estimation, stale (H4), cancellation, batching (H5),
capacity (exercise 8), fleet (H6), live, live_stale, live_cancellation, configuration.

Each section has its inputs (everything that decides its results: the scaled sweep config, the
theory's replications, the live config); their digest goes into ``inputs.json`` when the section
starts and into ``done.json`` when it ends. A re-run skips a done section whose inputs did not
change, resumes an unfinished one (a sweep's finished cells, a live experiment's finished runs are
kept), and starts afresh one whose inputs changed (its folder is cleared: the old results answer
another question). The report (``report.md``, ``report.html`` and ``figures/``) is rebuilt from the
sections' files on every run, which takes seconds.

Hypotheses are judged from the numbers with 95 % Student-t intervals across seeds. Cells that
differ only in policy (or speed, or load) share their seed's random numbers, so a comparison is the
interval of the per-seed *difference* (paired by seed), which is narrower than two separate
intervals (:func:`analysis.metrics.paired_difference`).

The modules: ``scale`` (how big the study is), ``section`` (a section, its markers, and how one
is run, skipped or resumed), ``blocks`` (what a section's report is made of), ``sweeps`` (the
sections that run a sweep), one module per section with its hypothesis (``theory``,
``reference``, ``burst``, ``estimation`` for the estimation, stale and cancellation sweeps,
``batching``, ``capacity``, ``fleet``, ``live_pass``, ``live_stale``, ``live_cancellation``,
``configuration``), ``live_runs`` (the live sections' servers and runs) and ``live_checks`` (their
verdicts), ``render`` (the report as Markdown and HTML) and ``runner`` (the sections in order, the
report, and the ``qlab study`` command).
"""
