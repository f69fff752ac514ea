"""live: the real harness — an asyncio gate and FastAPI service in front of GPT-2 or a
synthetic engine, an open-loop replayer of qsim traces, calibration, and live passes.

The server side: ``gate`` (the asyncio driver of qsim's queue), ``engine`` and ``gpt2``
(what runs a request), ``http_api`` (the FastAPI app), ``headcap`` (the cap on request
heads), ``serve_options`` (every option of ``qlab serve``, written once) and ``commands``
(``qlab serve``). The load side: ``procs`` (a server as a child process), ``loadgen``
(open-loop replay), ``rows`` (an exchange as a record), ``calibrate``, ``live_config``
and ``runner`` (``qlab live``), ``load_commands`` (``qlab replay``, ``calibrate``,
``compare``, ``live``).

It reuses qsim's ``decide``, ``cannot_finish``, ``SpeedTracker``, traces and record
schema rather than copies of them. Torch is imported only by ``live.gpt2``.
"""
