"""analysis: what a run's records mean, written once against qsim's record schema.

``metrics`` (outcomes, goodput, latency, intervals across seeds), ``validation`` (the
simulator against every closed form: ``qlab theory``), ``compare`` (a live run against
the simulator, request by request) and ``plots`` (a sweep's figures).
"""
