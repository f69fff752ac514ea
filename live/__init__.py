"""live: the real harness — an asyncio gate and FastAPI service in front of GPT-2 or a
synthetic engine, an open-loop replayer of qsim traces, calibration, and live passes.

The server side: ``gate`` (the asyncio driver of qsim's queue), ``engine`` and ``gpt2``
(what runs a request), ``http_api`` (the FastAPI app), ``headcap`` (the cap on request
heads), ``serve_options`` (every option of ``qlab serve``, written once) and ``commands``
(``qlab serve``). The load side: ``procs`` (a server as a child process), ``loadgen``
(open-loop replay), ``rows`` (an exchange as a record), ``calibrate``, ``live_config``
(``qlab live``'s file). The commands of the load side (``qlab replay``, ``calibrate``,
``compare``, ``live``) are :mod:`experiments.replay_command` and its siblings, and
:mod:`experiments.live_runner`: they use :mod:`analysis` too, and live imports nothing from
analysis (tests/test_layout.py).

It reuses qsim's ``decide``, ``cannot_finish``, ``SpeedTracker``, traces and record
schema rather than copies of them. Torch is imported only by ``live.gpt2``.
"""
