"""analysis: what a run's records mean, written once against qsim's record schema.

``metrics`` (outcomes, goodput, latency, intervals across seeds and differences paired by seed),
``validation`` (the simulator against every closed form: ``qlab theory``; ``run_stats``, the
statistics its checks read of a run), ``compare`` (a live run against the simulator, request by
request: ``replay`` replays it with what the gate knew, ``diagnosis`` says where and why the two
parted), ``prediction`` (the run predicted from its arrivals alone) and ``plots`` (a sweep's
figures).
"""
